"""Argument checks for the memory's verbs, in one place, each raising `ConfigError`.

Why one module: the same verb is reached from Python (`Memory`), from the REST routes and from the
OpenAI routes; when each door checked its own arguments, the HTTP doors missed what the SDK caught (a
lone surrogate reached the tokenizer and became a 500, ``min_score: NaN`` grafted whatever scored
top, ``kind: ""`` was accepted). Every door now calls these, and the server maps `ConfigError` to a
400 in the route's error shape. The checks run before any work (no prefill, no graft, no write).
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from ..core.blocks import Scope
from ..core.errors import ConfigError
from .router import LEX_WEIGHT

if TYPE_CHECKING:
    from ..core.grammar_limits import GrammarLimits

__all__ = ["text", "integer", "flag", "score", "choice", "ids", "metadata", "path", "instance", "scope",
           "max_tokens", "response_format", "MAX_TEXT_CHARS"]

#: The longest text a verb accepts (characters). A block's text is prefilled in one context, so a
#: text longer than any context is refused before it is tokenized (tokenizing 8 MB took seconds).
MAX_TEXT_CHARS = 4 << 20


def _error(name: str, message: str) -> ConfigError:
    """A `ConfigError` that names its field (``param``: what an HTTP route reports as the error's param)."""
    exc = ConfigError(message)
    exc.param = name  # type: ignore[attr-defined]
    return exc


def text(name: str, value: Any, *, optional: bool = False, empty: bool = False,
         max_chars: int = MAX_TEXT_CHARS) -> None:
    """A str that UTF-8 can encode (no lone surrogates), non-empty unless ``empty``, at most
    ``max_chars`` characters."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise _error(name, f"{name} must be a str, got {type(value).__name__}"
                          + (" (decode bytes first, e.g. data.decode('utf-8'))" if isinstance(value, (bytes, bytearray)) else ""))
    if len(value) > max_chars:
        raise _error(name, f"{name} is {len(value)} characters, over the {max_chars}-character limit")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _error(name, f"{name} is not valid Unicode: character {exc.start} is a lone surrogate "
                          f"({value[exc.start]!r}); fix the text's decoding") from None
    if not empty and not value.strip():
        raise _error(name, f"{name} must not be empty")


def integer(name: str, value: Any, *, lo: int, hi: Optional[int] = None, optional: bool = False) -> None:
    """An int (not a bool) in ``lo..hi``."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(name, f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    if value < lo or (hi is not None and value > hi):
        raise _error(name, f"{name}={value} is out of range: give {lo}" + (f"..{hi}" if hi is not None else " or more"))


def max_tokens(value: Any, n_ctx: int) -> None:
    """How many tokens an answer may decode: 1 up to the engine's context (an answer never holds more
    cells than the context has). Unbounded, one request held an engine for 20 minutes."""
    integer("max_tokens", value, lo=1, hi=n_ctx)


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _error(name, f"{name} must be True or False, got {type(value).__name__} {value!r:.40}")


def score(name: str, value: Any) -> None:
    """A routing score threshold, or None: a finite number in the range scores take (NaN compares false
    with everything, so a NaN threshold would graft whatever block scored top)."""
    if value is None:
        return
    top = 1.0 + LEX_WEIGHT  # a routing score is a cosine in [-1, 1] plus LEX_WEIGHT x a coverage in [0, 1]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not -1.0 <= value <= top:
        raise _error(name, f"{name} must be a routing score in [-1, {top}], got {value!r:.40}")


def choice(name: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise _error(name, f"{name}={value!r:.40}: use one of {', '.join(map(repr, choices))}")


def ids(name: str, value: Any) -> None:
    """A list of block ids (or None)."""
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise _error(name, f"{name} must be a list of block ids, got {type(value).__name__}")
    for v in value:
        text(f"{name} item", v)


def metadata(value: Any) -> None:
    """JSON-serialisable (it goes into the block file's manifest): checked before any prefill."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise _error("metadata", f"metadata must be a mapping, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(f"metadata keys must be str, got {type(k).__name__} {k!r:.40}")
    try:
        json.dumps(dict(value), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"metadata must be JSON-serialisable (str, numbers, bools, None, lists, dicts; no "
                          f"NaN, no lone surrogates): {exc}") from None


def path(name: str, value: Any) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise _error(name, f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    raw = os.fspath(value)
    if not isinstance(raw, str):
        raise _error(name, f"{name} must be a str path, got {type(raw).__name__}")
    text(name, raw)


def instance(name: str, value: Any, cls: type, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, cls):
        raise _error(name, f"{name} must be a {cls.__name__}, got {type(value).__name__}")


def scope(user_id: Any, agent_id: Any, session_id: Any) -> Scope:
    """A checked `Scope` (each id a non-empty str, or None)."""
    for field, value in (("user_id", user_id), ("agent_id", agent_id), ("session_id", session_id)):
        text(field, value, optional=True)
    return Scope(user_id=user_id, agent_id=agent_id, session_id=session_id)


def response_format(value: Any, name: str = "response_format",
                    limits: Optional["GrammarLimits"] = None) -> Optional[str]:
    """The grammar (GBNF) that OpenAI's ``response_format`` asks for, or None for free text.

    ``{"type": "text"}`` (or None): free text. ``{"type": "json_object"}``: any JSON object.
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON that
    the schema accepts (strict or not: the grammar always enforces it, as llama-server does). The
    grammar is built with llama.cpp's own schema converter (`graftmem.core.engine.json_grammar`); a
    schema it cannot express, or one over ``limits`` (`graftmem.core.grammar_limits`: repetitions, enum
    sizes, ...), is a `ConfigError` naming the keyword's path, before any work.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise _error(name, f"{name} must be an object such as {{\"type\": \"json_object\"}}, got {value!r:.80}")
    kind = value["type"]
    from ..core.engine import json_grammar  # the converter ships with llama.cpp's Python bindings

    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise _error(name, f"{name}.json_schema must be an object with a \"schema\" object")
        schema = spec.get("schema") or {}
        if limits is None:
            return json_grammar(schema, f"{name}.json_schema.schema")
        return json_grammar(schema, f"{name}.json_schema.schema", limits)
    raise _error(name, f"{name}.type must be text, json_object or json_schema, got {kind!r:.40}")
