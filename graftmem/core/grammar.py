"""Grammars: llama.cpp's grammar sampler over an engine's vocabulary, and JSON schemas turned into GBNF
with llama.cpp's own converter (structured outputs, forced tool calls).

Why here and not in the engine: a grammar changes which token is *chosen*, never the logits the
model computed, so it is a separate idea from what the engine computes; it needs only an engine's
vocabulary (`_Vocabulary`). The bounds on what llama.cpp is asked to parse live in
`graftmem.core.grammar_limits`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import re
from typing import Any, Mapping, Optional, Protocol

import numpy as np

from .backend import C, schema_converter_module
from .errors import ConfigError
from .grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits, check_gbnf, check_schema

__all__ = ["Grammar", "json_grammar", "json_rules"]


class _Vocabulary(Protocol):
    """What a grammar needs of an engine (`graftmem.core.engine.Engine`): its llama.cpp vocabulary."""

    n_vocab: int
    _vocab: Any

    def _check(self) -> None: ...


class Grammar:
    """A llama.cpp grammar sampler over one engine's vocabulary: masks the tokens the grammar forbids.

    Why llama.cpp's sampler: the grammar engine (GBNF, partial UTF-8, lazy triggers) is the one
    llama-server and llama-cpp-python constrain `response_format` with; graftmem only feeds it the
    logits of each step and tells it the token picked. It changes which token is *chosen*, never the
    logits the model computed, so grafts stay exactly as exact (the receipts hash the raw logits).
    Not thread-safe: one grammar per answer.
    """

    def __init__(self, engine: _Vocabulary, gbnf: str, root: str = "root",
                 limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> None:
        engine._check()
        check_gbnf(gbnf, limits)  # llama.cpp's parser recurses per nested group: a deep one kills the process
        self._smpl = C.llama_sampler_init_grammar(engine._vocab, gbnf.encode("utf-8"), root.encode())
        if not self._smpl:
            raise ConfigError(f"llama.cpp could not parse the grammar (root {root!r}); its log says why "
                              f"(logger graftmem.llama at DEBUG). Grammar starts: {gbnf[:120]!r}")
        self.gbnf = gbnf
        self._n = engine.n_vocab
        self._cands = np.zeros(self._n, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids here set to -inf (a new array)."""
        c = self._cands
        c["id"] = np.arange(self._n, dtype=np.int32)
        c["logit"] = logits
        c["p"] = 0.0
        arr = C.llama_token_data_array(data=ctypes.cast(c.ctypes.data, ctypes.POINTER(C.llama_token_data)),
                                       size=self._n, selected=-1, sorted=False)
        C.llama_sampler_apply(self._smpl, ctypes.byref(arr))
        out = np.full(self._n, -np.inf, dtype=np.float32)
        kept = c[: arr.size]
        out[kept["id"]] = kept["logit"]
        return out

    def accept(self, token: int) -> None:
        """Advance the grammar past the token that was picked."""
        C.llama_sampler_accept(self._smpl, int(token))

    def close(self) -> None:
        if self._smpl:
            C.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:  # a forgotten grammar must not leak its sampler
        with contextlib.suppress(Exception):
            self.close()


def json_grammar(schema: Optional[Mapping[str, Any]] = None, where: str = "schema",
                 limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> str:
    """GBNF for any JSON object (``schema=None``: OpenAI's ``json_object``) or for a JSON schema, with
    llama.cpp's own schema converter (as llama-cpp-python ships it): the grammars llama-server uses.
    A schema over ``limits`` is a `ConfigError` naming the keyword's path under ``where``
    (`graftmem.core.grammar_limits`)."""
    # an object at the top (schema None), as OpenAI's json_object mode promises
    return json_rules(schema, "root", where, limits)


#: A JSON string's character as llama.cpp's C++ converter (``json-schema-to-grammar.cpp``) writes it.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[a-zA-Z0-9-]+|.', re.S)


@functools.lru_cache(maxsize=1)
def _converter(LG: Any) -> type:
    """llama-cpp-python's schema converter, plus the integer bounds it ignores (``minimum``, ``maximum``
    and their exclusive forms: `graftmem.core.intrange`, llama.cpp's own converter's digit ranges), so a
    structured output's ``"age": {"type": "integer", "minimum": 0, "maximum": 150}`` is kept in range by
    the grammar instead of only by luck."""
    from .intrange import int_range, integer_bounds

    class Converter(LG.SchemaConverter):
        def visit(self, schema: Any, name: str) -> str:
            if isinstance(schema, dict) and schema.get("type") == "integer" and "$ref" not in schema:
                lo, hi = integer_bounds(schema)
                if lo is not None or hi is not None:
                    rule = name + "-" if name in LG.RESERVED_NAMES else name or "root"
                    return self._add_rule(rule, f"({int_range(lo, hi)}) space")
            return super().visit(schema, name)

    return Converter


def json_rules(schema: Optional[Mapping[str, Any]], name: str, where: str = "schema",
               limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> str:
    """GBNF rules whose rule ``name`` matches the JSON values ``schema`` accepts (None: any object),
    for a grammar that puts JSON inside other text (a tool call between a model family's markers,
    `graftmem.core.toolcalls.call_grammar`), as llama.cpp's ``common_grammar_builder.add_schema`` does.

    Why renamed: llama.cpp's converter names the rules of ``$defs`` after their last path element,
    so two schemas converted by one converter would share a rule named ``Item`` whatever each meant;
    each schema gets its own converter here, and every rule of it is called ``name`` or ``name-...``,
    so the rules of several schemas join without a clash. ``name`` is letters, digits and ``-``.

    The schema is checked against ``limits`` first (`graftmem.core.grammar_limits.check_schema`; errors
    name the keyword's path under ``where``): the converter unrolls repetitions into nested groups."""
    LG = schema_converter_module()

    if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9-]*", name):
        raise ConfigError(f"a grammar rule name is letters, digits and -, got {name!r}")
    check_schema(schema, where, limits)
    try:
        conv = _converter(LG)(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        resolved = conv.resolve_refs(json.loads(json.dumps(dict(schema if schema is not None else {"type": "object"}))), "input")
        conv.visit(resolved, "")
        rules: dict[str, str] = dict(conv._rules)  # the converter keeps its rules here (name -> body)
    except Exception as exc:  # the converter raises bare errors on unsupported schema features
        err = ConfigError(f"{where}: this JSON schema cannot be turned into a grammar: {exc!r:.300}")
        err.param = where  # type: ignore[attr-defined]
        raise err from exc
    if "char" in rules:  # the Python port lets raw control characters into strings (invalid JSON that
        rules["char"] = _JSON_CHAR  # json.loads refuses); llama.cpp's C++ converter excludes them
    new = {old: name if old == "root" else f"{name}-{old}" for old in rules}

    def rename(body: str) -> str:  # rule references only: literals and character classes stay as they are
        return "".join(new.get(t, t) for t in _GBNF_TOKEN.findall(body))

    return "\n".join(f"{new[old]} ::= {rename(body)}" for old, body in sorted(rules.items()))
