"""JSON read from text nobody vouches for, depth-bounded: a request body, a model's answer (the tool-call
parsers of `graftmem.core.toolcalls`), a client's tool-call ``arguments`` string.

Why a bound: Python's decoder recurses once per ``[`` / ``{``, so 100,000 nested lists raise
``RecursionError`` (not a ``ValueError``: every ``except ValueError`` around a ``json.loads`` let it
through, a 500 on the server), and a value that did decode a few hundred levels deep raised again
wherever it was encoded next. Text nested deeper than `MAX_DEPTH` is therefore not JSON here: `loads` and
`load_prefix` raise `TooDeep`, a ``ValueError``, before decoding, so every caller's "not JSON" path (a
400, or "this is text, not a call") handles it, and whatever they return can be encoded again.
"""

from __future__ import annotations

import json
import re
from typing import Any, Union

__all__ = ["MAX_DEPTH", "TooDeep", "json_depth", "loads", "load_prefix"]

#: The deepest nesting of arrays and objects read (a request body's default, `graftmem.server.http.Limits`,
#: and every tool call's arguments): real payloads nest a few levels.
MAX_DEPTH = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


class TooDeep(ValueError):
    """JSON text nested deeper than the bound: refused before it is decoded."""


def json_depth(raw: Union[bytes, str], *, first_value: bool = False, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (brackets inside strings not counted), read without
    parsing; when the text has no more openings than ``limit``, their count stands in for it (an upper bound,
    found in a few ms for 8 MB). ``first_value``: of the value the text starts with only, up to where its
    brackets close (what `load_prefix` decodes; the text after it may be anything)."""
    n_open = raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
    if n_open <= limit:  # the usual text: no more openings than the limit, so no deeper
        return n_open
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    brackets = _STRING.sub(b'""', data).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    import numpy as np  # only for text with many brackets: importing the parsers stays light

    arr = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum(np.where((arr == 0x5B) | (arr == 0x7B), 1, -1))
    if first_value:
        closed = np.flatnonzero(depth <= 0)
        if closed.size:
            depth = depth[:closed[0] + 1]
    return int(depth.max())


def _check(text: Union[str, bytes], first_value: bool, limit: int) -> None:
    depth = json_depth(text, first_value=first_value, limit=limit)
    if depth > limit:
        raise TooDeep(f"JSON nested {depth} levels deep (more than {limit})")


def loads(text: Union[str, bytes], limit: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, or `TooDeep` (a ``ValueError``) when it nests deeper than ``limit``."""
    _check(text, False, limit)
    try:
        return json.loads(text)
    except RecursionError as exc:  # not reached under the bound; kept so nothing but ValueError leaves
        raise TooDeep(str(exc)) from None


def load_prefix(text: str, start: int = 0, limit: int = MAX_DEPTH) -> tuple[Any, int]:
    """The JSON value at ``text[start:]`` after whitespace and the index where it ends (``raw_decode``), or a
    ``ValueError`` (`TooDeep` when that value nests deeper than ``limit``)."""
    i = len(text) - len(text[start:].lstrip())
    _check(text[i:], True, limit)
    try:
        return json.JSONDecoder().raw_decode(text, i)
    except RecursionError as exc:
        raise TooDeep(str(exc)) from None
