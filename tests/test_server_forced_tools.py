"""``tool_choice: "required"`` and a named function through the server, with the real clients: the
answer is a call (a grammar in the model family's own call syntax masks everything else), parsed into
``tool_calls`` with arguments the tool's schema accepts; with a template that renders no tools (graftmem's
Hermes prompt, as on SmolLM2: the tiny random-weight Phi-3.5 of tests/tiny.py, whose own template renders
none) and on tiny real-family models whose own templates render the tools. The call is the grammar's, not
the model's judgement: random weights write no call by themselves, which makes the forced call's contrast
with the free answer sharper; their prefill costs ~1/100th of SmolLM2's, and Phi-3.5's 32k vocabulary makes
each grammar-masked step cheaper than SmolLM2's 49k."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from graftmem.core import Engine
from graftmem.server import api_server
from graftmem.store.local import Store

from .tiny import tiny_path

WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"], "description": "The city"},
    "days": {"type": "integer", "description": "How many days"}}}
TIME = {"type": "object", "required": ["zone"], "additionalProperties": False, "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"], "description": "The time zone"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Hello! How are you today?"}]  # nothing here asks for a tool


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hermes():
    """A tiny Phi-3.5 (real tokenizer and template): its template renders no tools, so the server writes
    graftmem's Hermes tool prompt and forces Hermes calls, as on SmolLM2."""
    with Engine(tiny_path("phi35"), {"n_threads": 1}) as eng:
        yield eng


def _check(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_with_the_openai_client(hermes, tmp_path):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [hermes], warm=False) as srv:
            c = _client(srv)
            free = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
            assert not free.choices[0].message.tool_calls  # on its own, the model answers in text
            r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=96, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            _check(r.choices[0].message.tool_calls, {"get_weather", "get_time"})
            assert len(r.choices[0].message.tool_calls) == 1  # parallel_tool_calls not asked: one call
            named = {"type": "function", "function": {"name": "get_time"}}
            r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named,
                                          max_tokens=96, temperature=0.8, seed=7)
            _check(r.choices[0].message.tool_calls, {"get_time"})
            # streamed: the call arrives as tool_calls deltas, never as content
            chunks = list(c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named,
                                                    max_tokens=96, temperature=0, stream=True))
            deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
            assert deltas and deltas[0].function.name == "get_time"
            assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()
            args = "".join(d.function.arguments or "" for d in deltas)
            jsonschema.validate(json.loads(args), TIME)
            # a forced call beats response_format (the answer is a call, not text)
            r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=96,
                                          temperature=0, response_format={"type": "json_object"})
            _check(r.choices[0].message.tool_calls, {"get_time"})
            for bad, why in (({"type": "function", "function": {"name": "nope"}}, "not one of the request's tools"),
                             ("always", "tool_choice must be")):
                with pytest.raises(openai.BadRequestError, match=why):
                    c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=bad, max_tokens=8)
            with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
                c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=8, extra_body={"parallel_tool_calls": "yes"})
    finally:
        store.close()


def test_forced_calls_through_responses_and_anthropic(hermes, tmp_path):
    import anthropic

    store = Store(tmp_path / "home")
    try:
        with api_server(store, [hermes], warm=False) as srv:
            tools = [{"type": "function", **t["function"]} for t in TOOLS]
            r = _client(srv).responses.create(model="m", input="Hello! How are you today?", tools=tools,
                                              tool_choice={"type": "function", "name": "get_weather"},
                                              max_output_tokens=96, temperature=0)
            calls = [o for o in r.output if o.type == "function_call"]
            assert [o.name for o in calls] == ["get_weather"], r.output
            jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
            a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
            m = a.messages.create(model="m", max_tokens=96, extra_body={"temperature": 0}, tool_choice={"type": "any"},
                                  messages=[{"role": "user", "content": "Hello! How are you today?"}],
                                  tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                                          "input_schema": t["function"]["parameters"]} for t in TOOLS])
            uses = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason == "tool_use" and uses, m.content
            jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    finally:
        store.close()


@pytest.mark.parametrize("family", ["llama31", "qwen35", "gemma4", "command-r"])
def test_forced_call_in_the_family_syntax(family, tmp_path):
    """A tiny random-weight model of the family (its real tokenizer and template): whatever it would
    write, the grammar makes it a call in the family's own syntax, which the family's parser reads."""
    with Engine(tiny_path(family), {"n_threads": 1}) as eng, \
            api_server(Store(tmp_path / "home"), [eng], warm=False) as srv:
        c = _client(srv)
        for choice, names in (("required", {"get_weather", "get_time"}),
                              ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
            r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                          max_tokens=160, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
            _check(r.choices[0].message.tool_calls, names)
