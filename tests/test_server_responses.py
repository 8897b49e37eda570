"""The OpenAI Responses API on a real uvicorn socket with the official ``openai`` package and the OpenAI
Agents SDK (only ``base_url`` changed): answers streamed and not, stored responses as KV chains continued
with ``previous_response_id`` (in RAM, and from the store in a second server process: the same greedy
answer and first-step logits), branching that shares the parent's block, tenants that cannot see each
other's responses, TTL and size-cap retention, refusals in OpenAI's error shape.

Every assertion here is the server's plumbing or an equality of two computations (streamed == not,
RAM == store after a restart, re-rendered == cold), which holds on any model: the tests run on the tiny
random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: a real llama.cpp engine, real tokenizer and chat
template), whose prefill costs ~1/100th of SmolLM2's. The Agents SDK's run stays on SmolLM2 (`smol_srv`):
the model chooses the tool call by itself, and the run needs an answer the model ends (the SDK refuses a
response cut at ``max_output_tokens``, and random weights never end one); a forced call would not help.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from graftmem.server import api_server
from graftmem.server.tenants import ApiKeys, hash_key
from graftmem.store.local import Store

from .tiny import tiny_path

REPO = Path(__file__).resolve().parents[1]
ALICE, BOB = "sk-alice-responses-key", "sk-bob-responses-key"
INSTRUCTIONS = "You are a terse assistant. Answer in one short sentence."
GREEDY = {"temperature": 0, "max_output_tokens": 12}
SUPPORT = "You are the shop's support agent. For every question, first call the lookup tool."
LOOKUP = {"type": "function", "name": "lookup", "description": "Look up a section of the shop manual by topic.",
          "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}}


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("responses-keys") / "keys"
    p.write_text(f"alice {hash_key(ALICE)}\nbob {hash_key(BOB)}\n")
    return p


@pytest.fixture(scope="module")
def srv(tiny_llama, tmp_path_factory, keyfile):
    home = tmp_path_factory.mktemp("responses") / "home"
    with api_server(Store(home), [tiny_llama], api_key=ApiKeys.load(keyfile)) as s:
        yield s


@pytest.fixture(scope="module")
def smol_srv(smol, tmp_path_factory, keyfile):
    home = tmp_path_factory.mktemp("responses-smol") / "home"
    with api_server(Store(home), [smol], api_key=ApiKeys.load(keyfile)) as s:
        yield s


def _client(srv, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def _receipt(r) -> dict:
    return r.model_extra["graftmem"]


def test_create_stream_get_and_input_items(srv):
    c = _client(srv)
    r = c.responses.create(model="smollm2", instructions=INSTRUCTIONS, input="What is the capital of France?",
                           **GREEDY)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens >= 1 and r.store is True
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(c.responses.create(model="smollm2", instructions=INSTRUCTIONS, stream=True,
                                     input="What is the capital of France?", **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text  # greedy: the same answer streamed or not
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == r.usage.output_tokens
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = c.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "What is the capital of France?"


def test_previous_response_id_across_a_restart_equals_continuing_in_ram(srv, keyfile):
    """Turn 1 on server A; turn 2 continued on A (its engine kept the cells: the same process continuing
    in RAM) and, with the same input, on server B, a second process on the same home started without a
    warm start: B grafts the stored chain and computes the same first-step logits and greedy answer.
    The two continuations are branches of turn 1: both new blocks have turn 1's block as parent."""
    c = _client(srv)
    r1 = c.responses.create(model="smollm2", instructions=INSTRUCTIONS, input="Name a primary colour.", **GREEDY)
    chain = _receipt(r1)
    follow = {"model": "smollm2", "instructions": INSTRUCTIONS, "input": "Name another one.",
              "previous_response_id": r1.id, **GREEDY}
    in_ram = c.responses.create(**follow)
    ra = _receipt(in_ram)
    assert ra["source"] == "ram" and ra["response"]["continued"] is True
    assert in_ram.usage.input_tokens_details.cached_tokens == ra["response"]["chain_tokens"] > 0
    assert ra["tokens_restored"] == r1.usage.input_tokens + r1.usage.output_tokens  # prompt + answer, no re-prefill
    assert chain["source"] is None or chain["tokens_restored"] < ra["tokens_restored"]
    store = Store(srv.store.home)
    parent = ra["response"]["chain"]
    assert store.get(parent).metadata["response"]["id"] == r1.id
    # its answer's cells came from one-token calls: their thread count is recorded (docs/exactness.md), and B,
    # with the same count, grafts it below
    calls = store.get(parent).metadata["one_token_calls"]
    assert calls["threads"] == 1 and 0 < calls["from"] < r1.usage.input_tokens + r1.usage.output_tokens
    proc = subprocess.Popen(
        # B serves the same model with the same engine configuration as A (the tiny_llama fixture)
        [sys.executable, "-m", "graftmem", "--home", str(srv.store.home), "--model", str(tiny_path("llama31")),
         "--config", json.dumps({"n_threads": 1}), "serve", "--port", "0", "--no-warm",
         "--api-key-file", str(keyfile)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "serving" in line, (proc.stderr.read() if proc.poll() is not None else line)  # type: ignore[union-attr]
        url = line.split(" at ")[1].split()[0]
        groups = [proc.stdout.readline().split()[0] for _ in range(6)]  # type: ignore[union-attr]
        assert "responses" in groups and "anthropic" in groups  # serve prints what it answers
        b = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
        restarted = b.responses.create(**follow)
        rb = _receipt(restarted)
        assert rb["source"] == "store" and rb["block_id"] == parent  # grafted from the stored chain
        assert rb["response"]["chain"] == parent and restarted.usage.input_tokens_details.cached_tokens > 0
        assert rb["first_logits_sha256"] == ra["first_logits_sha256"]
        assert restarted.output_text == in_ram.output_text
        with pytest.raises(openai.NotFoundError):  # another tenant's response, on the other server too
            openai.OpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0).responses.create(**follow)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    store = Store(srv.store.home)
    leaves = [b for b in store.list(kind="auto") if b.metadata.get("response", {}).get("id") in
              (in_ram.id, restarted.id)]
    assert len(leaves) == 2 and {b.parent for b in leaves} == {parent}  # two branches share turn 1's block
    # the whole state after turn 2 (prompt, answer and all), captured on A from RAM and on B after the
    # graft: the same bytes (stored whole, so each block's state digest is the digest of the full state)
    assert leaves[0].storage == leaves[1].storage == "full"
    assert leaves[0].state_digest == leaves[1].state_digest
    # a response's blocks are named from its words, not the template's markers (what `graftmem ls` shows)
    names = [b.name for b in store.list(kind="auto")]
    assert names and all(n.startswith("auto") and "<|" not in n and "|>" not in n for n in names), names
    assert c.responses.retrieve(restarted.id).output_text == restarted.output_text  # stored by B, read by A


def test_function_call_items_round_trip_through_a_stored_chain(srv):
    """A function call and its output as input items; the next turn continues the stored chain with the
    tool's result (rendered as the template renders a tool message), streamed with the Responses events."""
    c = _client(srv)
    history = [{"role": "user", "content": "How do returns work?"},
               {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"topic": "returns"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Returns are accepted within 30 days."},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Returns are accepted within 30 days."}]},
               {"role": "user", "content": "When do parcels ship?"}]
    r1 = c.responses.create(model="smollm2", instructions="For every question, first call the lookup tool.",
                            input=history, tools=[LOOKUP], temperature=0, max_output_tokens=40)
    calls = [o for o in r1.output if o.type == "function_call"]
    call_id = calls[0].call_id if calls else "call_2"
    follow = [{"type": "function_call_output", "call_id": call_id, "output": "Parcels ship on Mondays."}]
    events = list(c.responses.create(model="smollm2", instructions="For every question, first call the lookup tool.",
                                     input=follow, tools=[LOOKUP], previous_response_id=r1.id, temperature=0,
                                     max_output_tokens=16, stream=True))
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
    assert final.model_extra["graftmem"]["response"]["continued"] is True
    for o in final.output:  # every item announced and closed
        assert any(e.type == "response.output_item.done" and e.item.id == o.id for e in events)
        if o.type == "function_call":
            assert json.loads(o.arguments) is not None
            assert any(e.type == "response.function_call_arguments.done" and e.arguments == o.arguments for e in events)


def test_other_instructions_re_render_the_conversation_from_its_items(srv):
    """The chain holds turn 1's instructions: a turn with other instructions is served by re-rendering
    the stored items with the new ones (as OpenAI does: instructions are not carried over), and says so."""
    c = _client(srv)
    r1 = c.responses.create(model="smollm2", instructions=INSTRUCTIONS, input="Name a primary colour.", **GREEDY)
    r2 = c.responses.create(model="smollm2", instructions="You are a poet.", input="Name another one.",
                            previous_response_id=r1.id, **GREEDY)
    info = _receipt(r2)["response"]
    assert info["continued"] is False and info["chain"] is None and r2.output_text
    cold = c.responses.create(model="smollm2", instructions="You are a poet.", store=False, temperature=0,
                              max_output_tokens=12, input=[{"role": "user", "content": "Name a primary colour."},
                                                          {"role": "assistant", "content": r1.output_text},
                                                          {"role": "user", "content": "Name another one."}])
    assert cold.output_text == r2.output_text  # the same conversation as items: the same prompt


def test_tenants_cannot_reach_each_others_responses(srv):
    a, b = _client(srv), _client(srv, BOB)
    r = a.responses.create(model="smollm2", input="Say hi.", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        b.responses.create(model="smollm2", input="And?", previous_response_id=r.id, **GREEDY)
    assert exc.value.body["param"] == "previous_response_id"
    assert a.responses.retrieve(r.id).id == r.id  # still alice's, untouched
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)


def test_retention_ttl_and_size_cap_are_bounded(srv):
    """TTL: a response expires ``ttl`` seconds after it was created (the clock injected: no sleeps); one
    that a later response continues loses its record but keeps its block until that one goes. Size cap:
    stored responses are automatic blocks, evicted least recently used under ``--max-auto-mb``."""
    c = _client(srv)
    stored = srv.responses.stored
    clock, ttl = stored.clock, stored.ttl
    try:
        now = [1_000_000.0]
        stored.clock, stored.ttl = (lambda: now[0]), 100.0
        r1 = c.responses.create(model="smollm2", input="Count to three.", **GREEDY)
        r2 = c.responses.create(model="smollm2", input="Again.", previous_response_id=r1.id, **GREEDY)
        now[0] += 60
        r3 = c.responses.create(model="smollm2", input="Say one word.", **GREEDY)
        assert stored.sweep(now[0]) == [] and c.responses.retrieve(r1.id).id == r1.id
        b1 = _receipt(r2)["response"]["chain"]
        now[0] += 50  # r1 and r2 are past the TTL, r3 is not
        gone = stored.sweep(now[0])
        assert b1 in gone and len(gone) == 2  # r2's block, then r1's (a leaf once r2 went)
        for r in (r1, r2):
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(r.id)
        assert c.responses.retrieve(r3.id).id == r3.id
        # the size cap: the least recently used automatic data goes first, the newest response stays
        cache = srv.cache
        cap = cache.max_auto_bytes
        try:
            size = stored.find(r3.id, "alice")[0].state_size
            cache.max_auto_bytes = 3 * size  # a tenant's share (2 tenants): room for one response, not two
            r4 = c.responses.create(model="smollm2", input="Say one word.", **GREEDY)  # as r3: the same size
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(r3.id)
            mine = [b for b in srv.store.list(kind="auto") if b.metadata.get("tenant") == "alice"]
            assert [b.metadata.get("response", {}).get("id") for b in mine] == [r4.id]
            assert sum(b.state_size for b in mine) <= cache.max_auto_bytes // 2
        finally:
            cache.max_auto_bytes = cap
    finally:
        stored.clock, stored.ttl = clock, ttl


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"previous_response_id": "resp_does_not_exist"}, "previous_response_id"),
])
def test_unsupported_fields_are_refused_in_openais_shape(srv, extra, param):
    body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 4, **extra}
    r = httpx.post(srv.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
    assert r.status_code == (404 if param == "previous_response_id" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"]


def test_json_schema_text_format(srv):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    r = _client(srv).responses.create(model="smollm2", input="Name a colour as JSON.", temperature=0,
                                      max_output_tokens=24, store=False,
                                      text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"colour"} and r.store is False


def test_openai_agents_sdk_runs_a_function_tool(smol_srv):
    """The Agents SDK's default model (OpenAIResponsesModel over AsyncOpenAI) runs an agent with one
    function tool to completion: its requests (input items with function calls and outputs, tools in
    the Responses shape, streaming or not) and our answers parse on both sides."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=smol_srv.url + "/v1", api_key=ALICE, max_retries=0)
    seen: list[str] = []

    async def lookup(ctx, args: str) -> str:
        seen.append(json.loads(args)["topic"])
        return "Refunds are paid within 5 days."

    # a plain schema (the SDK's strict one from a decorated function adds titles and additionalProperties,
    # after which this 135M model writes a runaway call; the protocol is the same)
    tool = agents.FunctionTool(name="lookup", description=LOOKUP["description"], params_json_schema=LOOKUP["parameters"],
                               on_invoke_tool=lookup, strict_json_schema=False)
    agent = agents.Agent(name="support", instructions=SUPPORT, tools=[tool], model=agents.OpenAIResponsesModel(model="smollm2", openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=40))
    examples = [{"role": "user", "content": "How do returns work?"},
                {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"topic": "returns"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "Returns are accepted within 30 days."},
                {"role": "assistant", "content": "Returns are accepted within 30 days."},
                {"role": "user", "content": "When do parcels ship?"},
                {"type": "function_call", "call_id": "call_2", "name": "lookup", "arguments": '{"topic": "shipping"}'},
                {"type": "function_call_output", "call_id": "call_2", "output": "Parcels ship on Mondays."},
                {"role": "assistant", "content": "Parcels ship on Mondays."},
                {"role": "user", "content": "How do refunds work?"}]

    async def run() -> tuple[object, object]:
        plain = await agents.Runner.run(agent, examples, max_turns=4)
        chained = await agents.Runner.run(agent, examples, max_turns=4, auto_previous_response_id=True)
        return plain, chained

    plain, chained = asyncio.run(run())
    for result in (plain, chained):
        assert isinstance(result.final_output, str)
        assert result.raw_responses and all(r.usage.output_tokens >= 1 for r in result.raw_responses)
    assert seen  # the model called the tool (after two worked examples SmolLM2 does)
    later = chained.raw_responses[1:]
    assert later and all(r.usage.input_tokens_details.cached_tokens > 0 for r in later)


@pytest.mark.parametrize("script", ["gpt-oss-script", "qwen3-script"])
def test_openai_agents_sdk_default_path_on_reasoning_templates(tmp_path, script):
    """Issue 40's must-show: the Agents SDK's default model (OpenAIResponsesModel, the SDK's default
    settings: no ``max_output_tokens``, its own temperature) gets a completed response from a model served
    with GPT-OSS's template (harmony channels: the analysis channel a reasoning item, the final channel
    the answer) and with Qwen 3's (a think block, then the answer), whole and streamed.

    The models are scripted (`scripts/tiny_models.py` `build_scripted`): one llama layer set so that it
    writes one answer in its family's format and stops, since random weights never close a harmony
    message. Before the one answer parser the GPT-OSS answer came back with the channel markers in it
    (``parse_calls`` left a no-tool answer raw)."""
    agents = pytest.importorskip("agents")
    from graftmem.core.engine import Engine

    from .tiny import scripted_path

    agents.set_tracing_disabled(True)
    with Engine(scripted_path(script), {"n_threads": 1}) as eng, \
            api_server(Store(tmp_path / "home"), [eng]) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(name="greeter", instructions="You greet people.",
                             model=agents.OpenAIResponsesModel(model=script, openai_client=client))

        async def both() -> tuple[object, object]:
            whole = await agents.Runner.run(agent, "hi")
            streamed = agents.Runner.run_streamed(agent, "hi")
            async for _ in streamed.stream_events():
                pass
            return whole, streamed

        result, streamed = asyncio.run(both())
    for run in (result, streamed):
        assert run.final_output == "Hello!"
        (raw,) = run.raw_responses
        assert raw.usage.output_tokens >= 10
        reasoning = [i for i in run.new_items if i.type == "reasoning_item"]
        assert [s.text for i in reasoning for s in (i.raw_item.summary or i.raw_item.content or [])] \
            == ["User says hi."]
