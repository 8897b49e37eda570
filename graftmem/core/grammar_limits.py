"""Bounds on what a grammar may cost, checked before a JSON schema is converted or a GBNF compiled.

Why: llama-cpp-python's schema converter writes a repetition as nested groups (``maxLength: N`` is
``(c (c (c ...)?)?)?``, N levels deep), and llama.cpp's recursive-descent GBNF parser recurses once per
level: a ~200-byte schema (``{"type": "string", "maxLength": 30000}``, ``maxItems: 100000``, the
pattern ``(a|b){0,100000}``) overflowed the stack of the thread compiling it and killed the whole
server (SIGSEGV), through every door that builds a grammar. A 100,000-value ``enum`` compiled for
~13 s and then made each decode step mask the vocabulary against 100,000 alternatives (the engine
held for minutes). Nothing after the conversion can stop a C call, so the only safe place to refuse
is before it: `check_schema` walks the schema (iteratively: a deep schema must not raise RecursionError
either) and refuses, naming the keyword's path and the limit, anything over `GrammarLimits`;
`check_gbnf` is the last guard on the text llama.cpp parses (any grammar, from any door or the SDK):
its size and its group nesting.

The defaults follow OpenAI's published structured-output limits where they have one (5,000 object
properties, 1,000 enum values, 120,000 characters of names and enum values, an enum over 250 values at
most 15,000 characters) and, for repetitions, stay under llama.cpp's own ``MAX_REPETITION_THRESHOLD``
(2,000) with the nesting measured safe on a 512 KiB thread stack (macOS' default for secondary threads;
Linux gives 8 MiB): docs/security.md has the measurements.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from .errors import ConfigError

__all__ = ["GrammarLimits", "DEFAULT_GRAMMAR_LIMITS", "check_schema", "check_gbnf", "gbnf_depth"]


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar (a ``response_format`` schema, a forced tool call's schemas) may ask for."""

    #: any one repetition bound: ``minLength`` / ``maxLength`` / ``minItems`` / ``maxItems`` /
    #: ``minProperties`` / ``maxProperties`` and a pattern's ``{m,n}`` (each is unrolled by the converter)
    max_repeat: int = 500
    #: all repetition bounds of one schema added up (a pattern's nested ones multiplied): the grammar's size
    max_repeat_total: int = 20_000
    #: enum (and const) values across the schema
    max_enum_values: int = 1000
    #: an enum with more than 250 values holds at most this many characters (its values' JSON)
    max_large_enum_chars: int = 15_000
    #: characters of property names, definition names, enum and const values across the schema
    max_name_chars: int = 120_000
    #: optional properties (not in ``required``) of one object: the converter's grammar for them costs
    #: quadratic time to make (512: 0.31 CPU-s, 900: 3.2 s with the GIL held under load; 5,000 a
    #: RecursionError), where required ones cost linear time
    max_optional_properties: int = 256
    #: object properties across the schema
    max_properties: int = 5000
    #: subschemas (every object under properties, items, anyOf, $defs, ...) across the schema
    max_nodes: int = 10_000
    #: a ``pattern``'s length in characters
    max_pattern_chars: int = 1000
    #: the grammar text llama.cpp parses, in bytes
    max_gbnf_bytes: int = 1 << 20
    #: nested groups ``( ... )`` in the grammar text (llama.cpp's parser recurses once per level)
    max_gbnf_depth: int = 600


DEFAULT_GRAMMAR_LIMITS = GrammarLimits()

def _ref_target(root: Any, ref: str) -> Any:
    """The subschema a ``$ref`` names, found as llama-cpp-python's converter finds it (the path after the
    last ``#``, split at ``/``, each part a key; no JSON-pointer unescaping): the converter follows a
    ``$ref`` to any place in the document, ``{"$ref": "#/x-anything"}`` included, so a walk over the
    schema keywords only missed a ``maxLength`` of 10^7 (1 GB while converting) or an enum of 100,000
    values put under a key that is no keyword. None where it names nothing (the converter refuses it)."""
    if not ref.startswith("#/") and "#/" not in ref:
        return None
    target = root
    for sel in ref.split("#")[-1].split("/")[1:]:
        if not isinstance(target, Mapping) or sel not in target:
            return None
        target = target[sel]
    return target


_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _refuse(where: str, message: str) -> ConfigError:
    exc = ConfigError(f"{where}: {message}")
    exc.param = where  # type: ignore[attr-defined]
    return exc


def check_schema(schema: Any, where: str = "schema", limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> None:
    """Raise `ConfigError` (``param``: the path of the keyword, e.g. ``schema.properties.name.maxLength``)
    if ``schema`` asks for a grammar over ``limits``. Unknown keywords are left to the converter."""
    nodes = props = enum_values = name_chars = 0
    total = 0
    stack: list[tuple[Any, str]] = [(schema, where)]
    seen: set[int] = set()  # every subschema once, also where several $refs name it (the converter makes one rule)
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):  # an items array (draft 4) or a stray list: its schemas
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, Mapping) or id(node) in seen:
            continue
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str):  # what the converter converts in its place, wherever in the document it is
            stack.append((_ref_target(schema, ref), f"{path}.$ref"))
        nodes += 1
        if nodes > limits.max_nodes:
            raise _refuse(where, f"the schema has more than {limits.max_nodes} subschemas (this server's limit)")
        for key in _REPEAT_KEYS:
            if key not in node:
                continue
            v = node[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise _refuse(f"{path}.{key}", f"must be a non-negative integer, got {v!r:.40}")
            if v > limits.max_repeat:
                raise _refuse(f"{path}.{key}", f"{v} is over this server's limit of {limits.max_repeat} "
                                               "(a grammar unrolls every repetition)")
            total += v
        pattern = node.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise _refuse(f"{path}.pattern", f"must be a string, got {type(pattern).__name__}")
            total += _pattern_cost(pattern, f"{path}.pattern", limits)
        if total > limits.max_repeat_total:
            raise _refuse(path, f"the schema's repetitions add up to more than this server's limit of "
                                f"{limits.max_repeat_total} (the sum of its minLength/maxLength/minItems/maxItems and "
                                "pattern counts)")
        values = []
        if "enum" in node:
            if not isinstance(node["enum"], list):
                raise _refuse(f"{path}.enum", "must be a list")
            values = node["enum"]
        if "const" in node:
            values = [*values, node["const"]]
        if values:
            enum_values += len(values)
            if enum_values > limits.max_enum_values:
                raise _refuse(f"{path}.enum", f"the schema has more than {limits.max_enum_values} enum/const values (this server's limit)")
            chars = sum(len(json.dumps(v, ensure_ascii=False)) for v in values)
            if len(values) > 250 and chars > limits.max_large_enum_chars:
                raise _refuse(f"{path}.enum", f"an enum of more than 250 values may hold at most "
                                              f"{limits.max_large_enum_chars} characters (this server's limit), "
                                              f"this one holds {chars}")
            name_chars += chars
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, Mapping):
                if key == "properties":
                    props += len(sub)
                    required = node.get("required")
                    optional = len(sub) - len(set(required) & set(sub) if isinstance(required, list) and
                                             all(isinstance(r, str) for r in required) else set())
                    if optional > limits.max_optional_properties:
                        raise _refuse(f"{path}.properties", f"an object may have at most "
                                                            f"{limits.max_optional_properties} optional properties "
                                                            f"(this server's limit), this one has {optional}: list "
                                                            "the others in 'required'")
                    if props > limits.max_properties:
                        raise _refuse(f"{path}.properties", f"the schema has more than {limits.max_properties} "
                                                            "properties (this server's limit)")
                name_chars += sum(len(str(k)) for k in sub)
                stack.extend((v, f"{path}.{key}.{k}") for k, v in sub.items())
        if name_chars > limits.max_name_chars:
            raise _refuse(path, f"the schema's names and enum values hold more than {limits.max_name_chars} characters "
                                "(this server's limit)")
        for key in _SCHEMA_LISTS:
            sub = node.get(key)
            if isinstance(sub, list):
                stack.extend((v, f"{path}.{key}[{i}]") for i, v in enumerate(sub))
        for key in _SCHEMA_ONE:
            if key in node:
                stack.append((node[key], f"{path}.{key}"))


def _quantifier(pattern: str, i: int, where: str) -> tuple[int, Optional[int], int]:
    r"""The quantifier ``{...}`` at ``pattern[i]`` read as llama-cpp-python's converter reads it (up to the
    next ``}``, split at ``,``, each side stripped and given to ``int``, which takes spaces, ``+``, ``_``
    and any Unicode digit): ``(min, max or None for unbounded, the index after it)``. What the converter
    would refuse is refused here (a regular expression's reading, ``\{(\d*),(\d*)\}``, let ``{ 0, 100000 }``
    and ``{1_000_000}`` through uncounted)."""
    end = pattern.find("}", i)
    if end < 0:
        raise _refuse(where, f"an unclosed quantifier {pattern[i:i + 20]!r}")
    nums = [x.strip() for x in pattern[i + 1:end].split(",")]
    hi: Optional[int]
    try:
        if len(nums) == 1:
            lo = hi = int(nums[0])
        elif len(nums) == 2:
            lo, hi = (int(nums[0]) if nums[0] else 0), (int(nums[1]) if nums[1] else None)
        else:
            raise ValueError
    except ValueError:
        raise _refuse(where, f"the quantifier {pattern[i:end + 1]!r:.40} is not {{m}}, {{m,}} or {{m,n}}") from None
    if lo < 0 or (hi is not None and hi < 0):
        raise _refuse(where, f"the quantifier {pattern[i:end + 1]!r:.40} is negative")
    return lo, hi, end + 1


def _pattern_cost(pattern: str, where: str, limits: GrammarLimits) -> int:
    """What a regex pattern's repetitions cost once unrolled: each ``{m,n}`` counts max(m, n) times the
    size of what it repeats (a group's or an earlier quantifier's repetitions included: ``a{0,500}{0,500}``
    is 250,000). Refuses a count over ``limits.max_repeat``, a pattern longer than
    ``limits.max_pattern_chars``, and any repetition of something that can match nothing (``(a?){5}``,
    ``a?{20}{20}``, ``(a{0,9})*``): llama.cpp's grammar sampler follows every way of splitting the text
    among such units, once per candidate token and character, so nesting them costs exponentially per
    decode step (``^(((a?){5}){5}){5}$``, 125 items: 28 s per token on SmolLM2's vocabulary, uncancellable
    in one C call), while the same language is written without the ambiguity (``a{0,n}``).

    Reads the pattern as the converter does (`_quantifier`; ``\\`` escapes one character; ``[...]`` is
    one atom; ``(`` opens a group)."""
    if len(pattern) > limits.max_pattern_chars:
        raise _refuse(where, f"a pattern of {len(pattern)} characters is over the {limits.max_pattern_chars}-"
                             "character limit")
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") else body
    # one frame per open group: [size so far, the current alternative can match nothing so far,
    # an earlier alternative can, the pending atom (size, can match nothing) or None]
    frames: list[list[Any]] = [[0, True, False, None]]

    def commit(f: list[Any]) -> None:
        if f[3] is not None:
            f[0] += f[3][0]
            f[1] = f[1] and f[3][1]
            f[3] = None

    i, n = 0, len(body)
    while i < n:
        c, f = body[i], frames[-1]
        if c in "?*+{":
            atom = f[3] if f[3] is not None else (1, False)
            if c == "{":
                lo, hi, i = _quantifier(body, i, where)
                count = max(lo, hi if hi is not None else lo)
                if count > limits.max_repeat:
                    raise _refuse(where, f"the repetition {{{lo},{'' if hi is None else hi}}} is over this "
                                         f"server's limit of {limits.max_repeat}")
                repeats, empty = hi is None or hi > 1, lo == 0
            else:
                i, count = i + 1, 1
                repeats, empty = c != "?", c != "+"
            if repeats and atom[1]:
                raise _refuse(where, f"the pattern repeats something that can match nothing ({body[max(0, i - 16):i]!r}): "
                                     "over this server's limit of none, since its grammar is ambiguous and "
                                     "exponentially slow to sample; write x{0,n} instead of (x?){n}")
            size = atom[0] * max(count, 1)
            if size > limits.max_repeat_total:
                raise _refuse(where, f"the pattern's repetitions unroll to more than {limits.max_repeat_total} items "
                                     "(this server's limit)")
            f[3] = (size, atom[1] or empty)
            continue
        commit(f)
        if c == "(":
            frames.append([0, True, False, None])
            i += 1
        elif c == ")":
            if len(frames) > 1:
                frames.pop()
                frames[-1][3] = (max(f[0], 1), f[1] or f[2])
            i += 1
        elif c == "|":
            f[2], f[1] = f[2] or f[1], True
            i += 1
        elif c == "[":
            j = i + 1
            while j < n and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            f[3], i = (1, False), j + 1
        else:
            f[3], i = (1, False), i + (2 if c == "\\" else 1)
        if frames[-1][0] > limits.max_repeat_total:
            raise _refuse(where, f"the pattern's repetitions unroll to more than {limits.max_repeat_total} items "
                                 "(this server's limit)")
    for f in frames:
        commit(f)
    return sum(f[0] for f in frames)


_GBNF_SKIP = re.compile(rb'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*')


def gbnf_depth(gbnf: str) -> int:
    """The deepest nesting of ``( ... )`` groups in a GBNF text (parentheses inside literals, character
    classes and comments not counted)."""
    raw = gbnf.encode("utf-8")
    if raw.count(b"(") <= 64:
        return raw.count(b"(")  # an upper bound, and under every limit
    parens = _GBNF_SKIP.sub(b"", raw).translate(None, bytes(c for c in range(256) if c not in b"()"))
    if not parens:
        return 0
    arr = np.frombuffer(parens, dtype=np.uint8)
    return int(np.cumsum(np.where(arr == 0x28, 1, -1)).max())


def check_gbnf(gbnf: str, limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS, where: Optional[str] = None) -> None:
    """Raise `ConfigError` if llama.cpp's parser should not be given ``gbnf``: over
    ``limits.max_gbnf_bytes``, or nesting groups deeper than ``limits.max_gbnf_depth``."""
    where = where or "grammar"
    size = len(gbnf.encode("utf-8"))
    if size > limits.max_gbnf_bytes:
        raise _refuse(where, f"the grammar is {size} bytes, over this server's {limits.max_gbnf_bytes}-byte limit")
    depth = gbnf_depth(gbnf)
    if depth > limits.max_gbnf_depth:
        raise _refuse(where, f"the grammar nests groups {depth} deep, over this server's limit of "
                             f"{limits.max_gbnf_depth} (llama.cpp's parser recurses once per level)")
