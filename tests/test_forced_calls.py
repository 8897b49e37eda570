"""Forced tool calls (``tool_choice: "required"`` or a named function): a grammar in the model family's
own call syntax (`graftmem.core.toolcalls.call_grammar`, llama.cpp's schema converter for the arguments)
makes the answer a call that parses, with arguments the tool's schema accepts; on the real SmolLM2 for
every family's syntax, and through the server with the real ``openai`` client on SmolLM2 and on tiny
real-family models whose own templates render the tools."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from graftmem.core import decode
from graftmem.core import toolcalls as tc

PROMPT = "<|im_start|>user\nWhat is the weather in Paris for the next 3 days?<|im_end|>\n<|im_start|>assistant\n"
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer"},
    "unit": {"type": "string", "enum": ["C", "F"]}}}
TIME = {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 12}}}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _forced(eng, fmt, functions, *, parallel=False, max_tokens=200):
    """Greedy answer to PROMPT under the forced-call grammar, and its parse."""
    with eng.session():
        eng.prefill(eng.tokenize(PROMPT))
        first = eng.logits().copy()
        grammar = eng.grammar(tc.call_grammar(fmt, functions, parallel=parallel))
        try:
            d = decode(eng, max_tokens, grammar=grammar)
        finally:
            grammar.close()
    text = eng.detokenize(d.tokens)
    return d, first, text, tc.parse(text, fmt, [f["name"] for f in functions])


def _valid(call):
    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[name])
    return name, args


def test_every_family_is_forceable():
    assert tc.FORCEABLE == set(tc.FORMATS)


@pytest.mark.parametrize("family", sorted(tc.FORMATS))
def test_a_forced_call_parses_in_every_family(smol, family):
    """SmolLM2 never saw most of these syntaxes: the grammar alone makes the answer a call of the named
    function, in the family's syntax, that the family's own parser reads back, with valid arguments."""
    fmt = tc.FORMATS[family]
    d, _, text, parsed = _forced(smol, fmt, [FUNCTIONS[0]])
    assert d.finish_reason == "stop", text  # the grammar completed and the model ended there
    assert [c["function"]["name"] for c in parsed.calls] == ["get_weather"], text
    _valid(parsed.calls[0])


def test_required_chooses_among_the_tools_and_parallel_allows_several(smol):
    for parallel in (False, True):
        d, _, text, parsed = _forced(smol, tc.HERMES, FUNCTIONS, parallel=parallel)
        assert d.finish_reason == "stop" and parsed.calls, text
        assert parallel or len(parsed.calls) == 1
        for call in parsed.calls:
            _valid(call)


def test_the_grammar_masks_never_changes_logits(smol):
    """A forced call picks other tokens than the free answer, from the same logits (the receipts hash
    them): the first step's logits are the model's own, bit for bit."""
    with smol.session():
        smol.prefill(smol.tokenize(PROMPT))
        free_first = smol.logits().copy()
        free = decode(smol, 4)
    d, first, text, _ = _forced(smol, tc.HERMES, [FUNCTIONS[0]])
    assert np.array_equal(first, free_first)
    assert d.tokens[:4] != free.tokens, text


def test_unsupported_schemas_and_families_are_config_errors():
    from graftmem import ConfigError

    with pytest.raises(ConfigError, match="JSON schema"):
        tc.call_grammar(tc.HERMES, [{"name": "f", "parameters": {"$ref": "#/definitions/missing"}}])
    with pytest.raises(ConfigError, match="cannot be forced"):
        tc.call_grammar(tc.ToolCallFormat("made-up", ("<x>",)), FUNCTIONS)
    with pytest.raises(ConfigError, match="at least one"):
        tc.call_grammar(tc.HERMES, [])


def test_rules_of_two_schemas_do_not_clash(smol):
    """Two tools whose schemas define a ``$defs`` entry of the same name and other meaning: each keeps its own."""
    a = {"$defs": {"Item": {"type": "string", "enum": ["apple"]}}, "type": "object", "required": ["x"],
         "properties": {"x": {"$ref": "#/$defs/Item"}}}
    b = {"$defs": {"Item": {"type": "integer"}}, "type": "object", "required": ["x"],
         "properties": {"x": {"$ref": "#/$defs/Item"}}}
    for fn, schema in (("a", a), ("b", b)):
        _, _, text, parsed = _forced(smol, tc.HERMES, [{"name": "a", "parameters": a},
                                                       {"name": "b", "parameters": b}][fn == "b":][:1])
        assert parsed.calls and parsed.calls[0]["function"]["name"] == fn, text
        jsonschema.validate(json.loads(parsed.calls[0]["function"]["arguments"]), schema)
