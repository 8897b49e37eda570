"""Forced tool calls (``tool_choice: "required"`` or a named function): a grammar in the model family's
own call syntax (`graftmem.core.toolcalls.call_grammar`, llama.cpp's schema converter for the arguments)
makes the answer a call that parses, with arguments the tool's schema accepts: for every family's syntax,
random paths through the grammar over a real vocabulary (no model runs: the tiny Phi-3.5 of tests/tiny.py,
whose 32k vocabulary makes each masked step ~2x cheaper than SmolLM2's 49k), SmolLM2's own decode under
the grammar, and (tests/test_server_forced_tools.py) through the server with the real ``openai`` client on
tiny real-family models."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from graftmem.core import decode
from graftmem.core import toolcalls as tc
from graftmem.core import Engine
from graftmem.server.chat import answer_text

from .tiny import tiny_path

PROMPT = "<|im_start|>user\nWhat is the weather in Paris for the next 3 days?<|im_end|>\n<|im_start|>assistant\n"
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer"},
    "unit": {"type": "string", "enum": ["C", "F"]}}}
TIME = {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 12}}}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def vocab():
    """The engine whose vocabulary the grammar walks go over: only its tokens and grammar sampler are
    used (no prefill, no decode), so the tiny Phi-3.5 (real SentencePiece vocabulary of 32k tokens)."""
    with Engine(tiny_path("phi35"), {"n_threads": 1}) as eng:
        yield eng


def _forced(eng, fmt, functions, *, parallel=False, max_tokens=96):
    """Greedy answer to PROMPT under the forced-call grammar, the first step's logits, and the parse."""
    with eng.session():
        eng.prefill(eng.tokenize(PROMPT))
        first = eng.logits().copy()
        grammar = eng.grammar(tc.call_grammar(fmt, functions, parallel=parallel))
        try:
            d = decode(eng, max_tokens, grammar=grammar)
        finally:
            grammar.close()
    text = answer_text(eng, d.tokens)
    return d, first, text, tc.parse(text, fmt, [f["name"] for f in functions])


def _walk(eng, gbnf, seed, limit=600):
    """A random path through the grammar over the engine's real vocabulary: random logits each step,
    the best token llama.cpp's grammar sampler allows, until it allows only the end of generation.
    No model runs: what is checked is that EVERY answer the grammar lets through parses, whatever
    the logits (the model's decode is checked on SmolLM2 below and through the server). The cost is the
    grammar sampler's pass over the vocabulary at each step: the smaller the vocabulary, the cheaper."""
    rng = np.random.default_rng(seed)
    grammar = eng.grammar(gbnf)
    tokens = []
    try:
        for _ in range(limit):
            allowed = grammar.mask(rng.standard_normal(eng.n_vocab).astype(np.float32))
            tok = int(np.argmax(allowed))
            assert np.isfinite(allowed[tok]), "the grammar allows nothing"
            if eng.is_eog(tok):
                return answer_text(eng, tokens)
            grammar.accept(tok)
            tokens.append(tok)
    finally:
        grammar.close()
    raise AssertionError(f"no end after {limit} tokens: {answer_text(eng, tokens)!r}")


def _valid(call):
    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[name])
    return name, args


def test_every_family_is_forceable():
    assert tc.FORCEABLE == set(tc.FORMATS)


@pytest.mark.parametrize("family", sorted(tc.FORMATS))
def test_every_answer_the_grammar_allows_parses(vocab, family):
    """In every family's syntax, random paths through the grammar (one named function; both tools,
    several calls where the family writes several) are calls the family's own parser reads, with
    arguments the schema accepts."""
    fmt = tc.FORMATS[family]
    for seed, fns, parallel in ((0, [FUNCTIONS[0]], False), (1, FUNCTIONS, False), (2, FUNCTIONS, True)):
        text = _walk(vocab, tc.call_grammar(fmt, fns, parallel=parallel), seed)
        parsed = tc.parse(text, fmt, [f["name"] for f in fns])
        assert parsed.calls and (parallel or len(parsed.calls) == 1), text
        for call in parsed.calls:
            _valid(call)
        assert not (parsed.content or "").strip(" \n`"), (text, parsed.content)  # nothing but the call(s)


def test_smollm2_answers_with_a_call_under_the_grammar(smol):
    """SmolLM2's own decode: a call of one of the tools that parses and validates; the logits are the
    model's (the grammar picks among them), so the receipts and the graft's exactness are untouched."""
    with smol.session():
        smol.prefill(smol.tokenize(PROMPT))
        free_first = smol.logits().copy()
        free = decode(smol, 3)
    d, first, text, parsed = _forced(smol, tc.HERMES, FUNCTIONS)
    assert np.array_equal(first, free_first)
    assert d.finish_reason == "stop" and len(parsed.calls) == 1, text
    _valid(parsed.calls[0])
    assert d.tokens[:3] != free.tokens, text  # the free answer is prose, the forced one a call


def test_unsupported_schemas_and_families_are_config_errors():
    from graftmem import ConfigError

    with pytest.raises(ConfigError, match="JSON schema"):
        tc.call_grammar(tc.HERMES, [{"name": "f", "parameters": {"$ref": "#/definitions/missing"}}])
    with pytest.raises(ConfigError, match="cannot be forced"):
        tc.call_grammar(tc.ToolCallFormat("made-up", ("<x>",)), FUNCTIONS)
    with pytest.raises(ConfigError, match="at least one"):
        tc.call_grammar(tc.HERMES, [])


def test_rules_of_two_schemas_do_not_clash(vocab):
    """Two tools whose schemas define a ``$defs`` entry of the same name and another meaning: each keeps
    its own (one converter for both would have given both the first one's rule)."""
    a = {"$defs": {"Item": {"type": "string", "enum": ["apple"]}}, "type": "object", "required": ["x"],
         "properties": {"x": {"$ref": "#/$defs/Item"}}}
    b = {"$defs": {"Item": {"type": "integer"}}, "type": "object", "required": ["x"],
         "properties": {"x": {"$ref": "#/$defs/Item"}}}
    fns = [{"name": "a", "parameters": a}, {"name": "b", "parameters": b}]
    for name, schema in (("a", a), ("b", b)):
        for seed in range(3):
            text = _walk(vocab, tc.call_grammar(tc.HERMES, [f for f in fns if f["name"] == name]), seed)
            parsed = tc.parse(text, tc.HERMES, [name])
            jsonschema.validate(json.loads(parsed.calls[0]["function"]["arguments"]), schema)


def test_a_think_block_the_prompt_opened_is_closed_first(vocab):
    """A prompt that ends inside ``<think>`` (DeepSeek R1's generation prompt): the forced answer closes
    the block, then calls; the parser splits the (empty) reasoning off and reads the call."""
    for seed in range(2):
        text = _walk(vocab, tc.call_grammar(tc.HERMES, [FUNCTIONS[0]], think_open=True), seed)
        assert text.startswith("</think>"), text
        parsed = tc.parse(text, tc.HERMES, ["get_weather"])
        assert len(parsed.calls) == 1 and not parsed.reasoning, text
        _valid(parsed.calls[0])
