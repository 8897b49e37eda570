"""A GBNF expression for the JSON integers between two bounds: what a JSON schema's ``minimum`` /
``maximum`` (and their ``exclusive`` forms) on an ``integer`` mean to a grammar.

Why here: the schema converter graftmem uses (llama-cpp-python's port of llama.cpp's, in
`graftmem.core.grammar.json_rules`) ignores those keywords, so a structured output with
``{"type": "integer", "minimum": 0, "maximum": 150}`` could be ``-1417092716023950`` (seen on a
random-weight model through pydantic-ai). llama.cpp's own converter (``common/json-schema-to-grammar.cpp``,
``build_min_max_int``, MIT) writes the range digit by digit; this is that function, ported line for line
(the same expressions for the same bounds), with Python's ``None`` for "no bound" where the C++ uses the
int64 limits. The C++ caps unbounded digit runs at 16 digits (a JSON integer past 2^53 is not exact in
most parsers); so does this.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["int_range", "integer_bounds"]


def integer_bounds(schema: Mapping[str, Any]) -> tuple[Optional[int], Optional[int]]:
    """The inclusive (minimum, maximum) an integer schema allows (None: unbounded on that side), as
    llama.cpp's schema reader takes them: ``minimum`` rounded up, ``exclusiveMinimum`` + 1 (rounded
    down first), and the mirror for the maximum."""
    import math

    def num(key: str) -> Optional[float]:
        v = schema.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        return v

    lo: Optional[int] = None
    hi: Optional[int] = None
    if (v := num("minimum")) is not None:
        lo = math.ceil(v)
    elif (v := num("exclusiveMinimum")) is not None:
        lo = math.floor(v) + 1
    if (v := num("maximum")) is not None:
        hi = math.floor(v)
    elif (v := num("exclusiveMaximum")) is not None:
        hi = math.ceil(v) - 1
    return lo, hi


def int_range(min_value: Optional[int], max_value: Optional[int]) -> str:
    """GBNF matching exactly the decimal integers in ``[min_value, max_value]`` (None: no bound)."""
    if min_value is None and max_value is None:
        raise ValueError("at least one of min_value or max_value must be set")
    if min_value is not None and max_value is not None and min_value > max_value:
        raise ValueError(f"minimum {min_value} is above maximum {max_value}: no integer fits")
    out: list[str] = []
    _build(min_value, max_value, out, 16, True)
    return "".join(out)


def _digit_range(out: list[str], lo: str, hi: str) -> None:
    out.append("[" + (lo if lo == hi else f"{lo}-{hi}") + "]")


def _more_digits(out: list[str], min_digits: int, max_digits: Optional[int]) -> None:
    out.append("[0-9]")
    if min_digits == max_digits == 1:
        return
    out.append("{" + str(min_digits))
    if max_digits != min_digits:
        out.append("," + (str(max_digits) if max_digits is not None else ""))
    out.append("}")


def _uniform_range(out: list[str], frm: str, to: str) -> None:
    i = 0
    while i < len(frm) and i < len(to) and frm[i] == to[i]:
        i += 1
    if i > 0:
        out.append(f'"{frm[:i]}"')
    if i < len(frm) and i < len(to):
        if i > 0:
            out.append(" ")
        sub_len = len(frm) - i - 1
        if sub_len > 0:
            frm_sub, to_sub = frm[i + 1:], to[i + 1:]
            zeros, nines = "0" * sub_len, "9" * sub_len
            to_reached = False
            out.append("(")
            if frm_sub == zeros:
                _digit_range(out, frm[i], chr(ord(to[i]) - 1))
                out.append(" ")
                _more_digits(out, sub_len, sub_len)
            else:
                out.append(f"[{frm[i]}] (")
                _uniform_range(out, frm_sub, nines)
                out.append(")")
                if ord(frm[i]) < ord(to[i]) - 1:
                    out.append(" | ")
                    if to_sub == nines:
                        _digit_range(out, chr(ord(frm[i]) + 1), to[i])
                        to_reached = True
                    else:
                        _digit_range(out, chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1))
                    out.append(" ")
                    _more_digits(out, sub_len, sub_len)
            if not to_reached:
                out.append(" | ")
                _digit_range(out, to[i], to[i])
                out.append(" ")
                _uniform_range(out, zeros, to_sub)
            out.append(")")
        else:
            out.append(f"[{frm[i]}-{to[i]}]")


def _build(min_value: Optional[int], max_value: Optional[int], out: list[str], decimals_left: int,
           top_level: bool) -> None:
    if min_value is not None and max_value is not None:
        if min_value < 0 and max_value < 0:
            out.append('"-" (')
            _build(-max_value, -min_value, out, decimals_left, True)
            out.append(")")
            return
        if min_value < 0:
            out.append('"-" (')
            _build(0, -min_value, out, decimals_left, True)
            out.append(") | ")
            min_value = 0
        min_s, max_s = str(min_value), str(max_value)
        for digits in range(len(min_s), len(max_s)):
            _uniform_range(out, min_s, "9" * digits)
            min_s = "1" + "0" * digits
            out.append(" | ")
        _uniform_range(out, min_s, max_s)
        return

    less_decimals = max(decimals_left - 1, 1)

    if min_value is not None:
        if min_value < 0:
            out.append('"-" (')
            _build(None, -min_value, out, decimals_left, False)
            out.append(") | [0] | [1-9] ")
            _more_digits(out, 0, decimals_left - 1)
        elif min_value == 0:
            if top_level:
                out.append("[0] | [1-9] ")
                _more_digits(out, 0, less_decimals)
            else:
                _more_digits(out, 1, decimals_left)
        elif min_value <= 9:
            c = str(min_value)
            start = "1" if top_level else "0"
            if c > start:
                _digit_range(out, start, chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, 1, less_decimals)
                out.append(" | ")
            _digit_range(out, c, "9")
            out.append(" ")
            _more_digits(out, 0, less_decimals)
        else:
            min_s = str(min_value)
            n, c = len(min_s), min_s[0]
            if c > "1":
                _digit_range(out, "1" if top_level else "0", chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, n, less_decimals)
                out.append(" | ")
            _digit_range(out, c, c)
            out.append(" (")
            _build(int(min_s[1:]), None, out, less_decimals, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                _digit_range(out, chr(ord(c) + 1), "9")
                out.append(" ")
                _more_digits(out, n - 1, less_decimals)
        return

    assert max_value is not None
    if max_value >= 0:
        if top_level:
            out.append('"-" [1-9] ')
            _more_digits(out, 0, less_decimals)
            out.append(" | ")
        _build(0, max_value, out, decimals_left, True)
    else:
        out.append('"-" (')
        _build(-max_value, None, out, decimals_left, False)
        out.append(")")
