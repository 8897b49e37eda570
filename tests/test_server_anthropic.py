"""The Anthropic Messages API on a real uvicorn socket, with the official ``anthropic`` package (only
``base_url`` changed), on a real engine: non-streamed and streamed answers, the prefix cache
reported as ``cache_read_input_tokens`` (and the cached answer equal to the cold one), count_tokens,
stop sequences, tools, and Anthropic's error shape.

Every assertion is the route's plumbing or an equality of two computations (streamed == not, cached ==
cold, the cut text == the uncut one's prefix), which holds on any model: the engine is the tiny random-weight
Llama 3.1 of tests/tiny.py (`tiny_llama`: real tokenizer and chat template, whose template renders the
tools), ~1/100th of SmolLM2's prefill."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from graftmem.server import api_server
from graftmem.store.local import Store

from .conftest import long_text

KEY = "sk-anthropic-test-key"
SYSTEM = "You are the support agent of a shop. " + long_text(60, seed=7)
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def srv(tiny_llama, tmp_path_factory):
    with api_server(Store(tmp_path_factory.mktemp("anthropic") / "home"), [tiny_llama], api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


#: greedy decoding; this version of the SDK has no ``temperature`` argument, the API still takes it
GREEDY = {"temperature": 0}
COLD = {"temperature": 0, "graftmem": {"cache": False}}


def _cold(client: anthropic.Anthropic, **kw):
    return client.messages.create(model="smollm2", max_tokens=kw.pop("max_tokens", 12), extra_body=COLD, **kw)


def test_create_and_stream_answer_alike(client):
    msg = _cold(client, system=SYSTEM, messages=ASK)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0
    total = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK).input_tokens
    assert msg.usage.input_tokens == total  # served cold: every prompt token prefilled
    with client.messages.stream(model="smollm2", max_tokens=12, system=SYSTEM, messages=ASK,
                                extra_body=COLD) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == msg.content[0].text  # greedy: the same text, token for token
    assert final.content[0].text == streamed
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens == total


def test_repeated_system_prompt_is_read_from_the_cache_and_answers_the_same(client):
    other = [{"role": "user", "content": "Name a colour."}]
    cold = _cold(client, system=[{"type": "text", "text": SYSTEM}], messages=ASK)
    cold_other = _cold(client, system=SYSTEM, messages=other)  # served cold, it keeps nothing in RAM
    first = client.messages.create(model="smollm2", max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    second = client.messages.create(model="smollm2", max_tokens=12, system=SYSTEM, messages=other,
                                    extra_body=GREEDY)
    assert first.content[0].text == cold.content[0].text  # system as blocks or as a string: one prompt
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens > 0  # the system prompt was not prefilled again
    total = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=other).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.content[0].text == cold_other.content[0].text  # grafting changes the time, not the answer
    # streamed, the final usage says the same
    with client.messages.stream(model="smollm2", max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == cold.content[0].text
    assert final.usage.cache_read_input_tokens > 0
    total_ask = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total_ask


def test_stop_sequences_cut_and_are_named(client):
    text = _cold(client, system=SYSTEM, messages=ASK, max_tokens=16).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = _cold(client, system=SYSTEM, messages=ASK, max_tokens=16, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    assert _cold(client, system=SYSTEM, messages=ASK, max_tokens=1).stop_reason == "max_tokens"


TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _with_result(content: str) -> list:
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": content}]}]


def test_tools_and_tool_results_are_rendered_and_answered(client):
    short, long = _with_result("Sunny."), _with_result("Sunny, 24 degrees, a light breeze from the west.")
    n_short = client.messages.count_tokens(model="smollm2", messages=short, tools=TOOLS).input_tokens
    n_long = client.messages.count_tokens(model="smollm2", messages=long, tools=TOOLS).input_tokens
    assert n_long > n_short  # the tool result is in the prompt
    assert client.messages.count_tokens(model="smollm2", messages=short).input_tokens < n_short  # so are the tools
    msg = client.messages.create(model="smollm2", max_tokens=24, messages=short, tools=TOOLS, extra_body=GREEDY)
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in msg.content:
        assert block.type in ("text", "tool_use")
        if block.type == "tool_use":
            assert block.name == "get_weather" and isinstance(block.input, dict)
    with client.messages.stream(model="smollm2", max_tokens=24, messages=short, tools=TOOLS,
                                tool_choice={"type": "auto"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    assert final.stop_reason == msg.stop_reason


def test_errors_are_in_anthropics_shape(srv, client):
    # max_tokens is required (the SDK insists too, so the request is sent by hand)
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": "smollm2", "messages": ASK})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="smollm2", max_tokens=4, messages=ASK, extra_body={"temperature": 5})
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError):  # structured outputs: refused, never ignored
        client.messages.create(model="smollm2", max_tokens=4, messages=ASK, output_config={
            "format": {"type": "json_schema", "schema": {"type": "object", "properties": {}}}})
    bad = anthropic.Anthropic(base_url=srv.url, api_key="sk-wrong-key-000", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model="smollm2", max_tokens=4, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"
