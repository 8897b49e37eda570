"""Tool use through the OpenAI API with the official `openai` client.

The tests check the mechanics (calls parsed, streamed, the round trip, the tool block grafted exactly),
not the model's judgement: the round trip runs on the tiny random-weight Phi-3.5 of tests/tiny.py (real
tokenizer and template, which renders no tools: graftmem's Hermes tool prompt, as on SmolLM2), ~1/100th of
SmolLM2's prefill and a 32k vocabulary (cheap grammar-masked steps). Random weights choose no call by
themselves, so the call is forced with ``tool_choice: "required"``: a grammar makes the answer a Hermes
``<tool_call>``, which goes through the same parsing and streaming (`AnswerParser`) as a call the model chose. Two examples in
the conversation exercise rendering assistant ``tool_calls`` and ``role: "tool"`` messages."""

from __future__ import annotations

import json

import openai
import pytest

from graftmem.server import api_server
from graftmem.server.chat import render_segments
from graftmem.server.tools import AnswerParser, answer_spec, parse_tools, split_answer
from graftmem.core.segments import detect_format
from graftmem.core import Engine
from graftmem.store.local import Store

from .tiny import tiny_path

#: ``maxLength`` bounds the forced call's argument: random weights under the grammar would write the string
#: until ``max_tokens`` (a closing quote is one token of 32k)
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up a section of the shop manual by topic.",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 12}},
                   "required": ["topic"]}}}]


def _example(q: str, topic: str, answer: str, i: int) -> list[dict]:
    return [{"role": "user", "content": q},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "lookup", "arguments": json.dumps({"topic": topic})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": answer},
            {"role": "assistant", "content": answer}]


HISTORY = ([{"role": "system", "content": "You are the shop's support agent. For every question, first call the "
             "lookup tool."}] + _example("How do returns work?", "returns", "Returns are accepted within 30 days.", 1)
           + _example("When do parcels ship?", "shipping", "Parcels ship on Mondays.", 2))
ASK = HISTORY + [{"role": "user", "content": "How do refunds work?"}]


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_tool_rendering_is_deterministic_and_parsing_is_strict(smol):
    fmt = detect_format(smol)
    spec = parse_tools({"tools": TOOLS})
    a = render_segments(fmt, ASK, spec)
    shuffled = [{"type": "function", "function": dict(reversed(list(TOOLS[0]["function"].items())))}]
    assert render_segments(fmt, ASK, parse_tools({"tools": shuffled})) == a  # key order does not matter
    assert "<tools>" in a[0] and '"name": "lookup"' in a[0] and "<tool_call>" in a[2] and "<tool_response>" in a[2]  # one turn
    text = 'ok <tool_call>\n{"name": "lookup", "arguments": {"topic": "x"}}\n</tool_call>'
    a = split_answer(text, answer_spec(None, spec))
    assert a.content == "ok" and a.calls[0]["function"] == {"name": "lookup", "arguments": '{"topic": "x"}'}
    assert split_answer(text.replace("lookup", "unknown"), answer_spec(None, spec)).calls == []  # only declared tools
    cut = split_answer(text[:-3], answer_spec(None, spec))
    assert (cut.content, cut.calls) == (text[:-3], [])  # a call cut inside its closer: plain text
    assert split_answer(text, answer_spec(None, parse_tools({"tools": TOOLS, "tool_choice": "none"}))).calls == []
    s = AnswerParser(answer_spec(None, spec))
    assert [e.text for e in s.feed("ok <tool")] == ["ok"] and s.feed("_call>{") == [] and s.feed("x") == []


def test_tool_call_round_trip_streamed_and_not(tmp_path):
    store = Store(tmp_path / "home")
    try:
        with Engine(tiny_path("phi35"), {"n_threads": 1}) as eng, \
                api_server(store, [eng], min_prefix_tokens=64, sightings=1) as srv:
            c = _client(srv)
            r = c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                          tool_choice="required")
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls", msg
            call = msg.tool_calls[0]
            assert call.function.name == "lookup" and isinstance(json.loads(call.function.arguments), dict)
            # streamed: the same call, assembled from the deltas the way an agent library does
            name, args, reason, content = "", "", None, ""
            for ch in c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=64,
                                                temperature=0, stream=True, tool_choice="required"):
                d = ch.choices[0]
                content += d.delta.content or ""
                for tc in d.delta.tool_calls or []:
                    name += tc.function.name or ""
                    args += tc.function.arguments or ""
                reason = d.finish_reason or reason
            assert (reason, name, args) == ("tool_calls", "lookup", call.function.arguments)
            assert "<tool_call>" not in content
            # the round trip: the call and its result go back, the answer is served, the tools and the
            # whole conversation before the last message are grafted (learned by the requests above)
            follow = ASK + [{"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": "Refunds take 14 days."}]
            warm = c.chat.completions.create(model="smollm2", messages=follow, tools=TOOLS, max_tokens=12,
                                             temperature=0, logprobs=True)
            assert warm.usage.prompt_tokens_details.cached_tokens > 64
            cold = c.chat.completions.create(model="smollm2", messages=follow, tools=TOOLS, max_tokens=12,
                                             temperature=0, logprobs=True, extra_body={"graftmem": {"cache": False}})
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            assert [(t.token, t.logprob) for t in warm.choices[0].logprobs.content] == \
                [(t.token, t.logprob) for t in cold.choices[0].logprobs.content]
            assert warm.choices[0].message.content == cold.choices[0].message.content
            with pytest.raises(openai.BadRequestError, match="tools"):
                c.chat.completions.create(model="smollm2", messages=ASK, tools=[{"type": "function"}], max_tokens=4)
            with pytest.raises(openai.BadRequestError, match="tool_calls"):
                c.chat.completions.create(model="smollm2", max_tokens=4, messages=[
                    {"role": "user", "content": "x", "tool_calls": [call.model_dump()]}])
    finally:
        store.close()


def test_answer_runs_to_the_context_without_max_tokens(tmp_path):
    """No ``max_tokens``: the answer may run to the end of the context, as llama-server's (it was cut at
    256 tokens, so a reasoning model's answer ended ``incomplete`` and the OpenAI Agents SDK raised)."""
    store = Store(tmp_path / "home")
    try:
        with Engine(tiny_path("phi35"), {"n_threads": 1, "n_ctx": 512}) as eng, api_server(store, [eng]) as srv:
            r = _client(srv).chat.completions.create(model="m", messages=ASK[:2], temperature=0)
            used = r.usage.prompt_tokens + r.usage.completion_tokens
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens > 256, r.usage
            assert used <= 512, r.usage
    finally:
        store.close()
