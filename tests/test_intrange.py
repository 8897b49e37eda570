"""Integer bounds in a JSON schema are kept by the grammar (``minimum`` / ``maximum`` and their exclusive
forms): llama-cpp-python's schema converter ignored them, so a structured output's bounded integer could be
any integer (seen: ``age = -1417092716023950`` for ``0 <= age <= 150`` on a random-weight model through
pydantic-ai). Checked here by llama.cpp's own grammar sampler over a real vocabulary (the tiny Phi-3.5's:
no model runs), integer by integer around every bound: each string is fed token by token and must be
allowed to the end of generation exactly when it is in range."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graftmem import ConfigError
from graftmem.core.engine import Engine, json_grammar
from graftmem.core.intrange import int_range, integer_bounds

from .tiny import tiny_path


@pytest.fixture(scope="module")
def vocab():
    with Engine(tiny_path("phi35"), {"n_threads": 1}) as eng:
        yield eng


_CHARS: dict = {}


def _char_tokens(eng) -> dict[str, int]:
    """A token per single character (a SentencePiece tokenizer would put a space before a text's first
    word, which no JSON grammar allows at the start): the text is fed one character per token."""
    if not _CHARS:
        for t in range(eng.n_vocab):
            piece = eng.piece(t)
            if len(piece) == 1 and chr(piece[0]) not in _CHARS:
                _CHARS[chr(piece[0])] = t
    return _CHARS


def _accepts(eng, gbnf: str, text: str) -> bool:
    """Whether the grammar lets ``text`` through, character by character, and then allows the end."""
    grammar = eng.grammar(gbnf)
    eog = next(t for t in range(eng.n_vocab) if eng.is_eog(t))
    chars = _char_tokens(eng)
    try:
        for tok in (chars[c] for c in text):
            if not np.isfinite(grammar.mask(np.zeros(eng.n_vocab, dtype=np.float32))[tok]):
                return False
            grammar.accept(tok)
        return bool(np.isfinite(grammar.mask(np.zeros(eng.n_vocab, dtype=np.float32))[eog]))
    finally:
        grammar.close()


BOUNDS = [(0, 150), (-20, 7), (-305, -12), (5, None), (-42, None), (None, 99), (None, -8), (1000, 1001), (19, 210)]


@pytest.mark.parametrize("lo,hi", BOUNDS)
def test_a_bounded_integer_allows_exactly_its_range(vocab, lo, hi):
    schema = {"type": "integer", **({"minimum": lo} if lo is not None else {}), **({"maximum": hi} if hi is not None else {})}
    gbnf = json_grammar(schema)
    edges = [v for v in (lo, hi) if v is not None]
    probe = sorted({v + d for v in edges for d in range(-12, 13)} | {0, 1, -1, 9, 10, 99, 100, -100, 12345, -12345})
    wrong = [v for v in probe if _accepts(vocab, gbnf, str(v)) != ((lo is None or v >= lo) and (hi is None or v <= hi))]
    assert not wrong, (schema, wrong)
    assert not _accepts(vocab, gbnf, "007") and not _accepts(vocab, gbnf, "1.5")  # JSON integers only


def test_exclusive_and_fractional_bounds_and_objects():
    assert integer_bounds({"exclusiveMinimum": 0, "exclusiveMaximum": 10}) == (1, 9)
    assert integer_bounds({"minimum": 0.5, "maximum": 9.5}) == (1, 9)
    assert integer_bounds({"minimum": True}) == (None, None)  # a bool is not a bound
    assert int_range(3, 3) == '"3"'
    with pytest.raises(ValueError):
        int_range(5, 4)
    with pytest.raises(ConfigError, match="above maximum"):
        json_grammar({"type": "integer", "minimum": 5, "maximum": 4})


def test_a_structured_output_object_keeps_its_bounds(vocab):
    """The shape pydantic-ai sends (an object with a bounded integer field): in range and out of range."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    gbnf = json_grammar(schema)
    ok = json.dumps({"name": "Ann", "age": 42})
    assert _accepts(vocab, gbnf, ok)
    for bad in (151, -1, 1417092716023950):
        assert not _accepts(vocab, gbnf, json.dumps({"name": "Ann", "age": bad})), bad
