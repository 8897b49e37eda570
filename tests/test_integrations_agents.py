"""`graftmem.integrations.agents.GraftmemSession`: an OpenAI Agents SDK session whose conversation is a
chain of stored Responses on ``graftmem serve``, run by the SDK's own ``Runner`` across a restart of the
server (its own process, SmolLM2) and of the session object: the resumed turn grafts the stored chain
(restored > 0, prefilled = only the new turn) and answers what the conversation answers without a restart."""

from __future__ import annotations

import asyncio

import pytest

from tests.served import serve_process

agents = pytest.importorskip("agents")

from openai import AsyncOpenAI  # noqa: E402

from graftmem.integrations import GraftmemSession  # noqa: E402


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def _turn(url: str, sid: str, text: str, heads) -> tuple[object, dict]:
    """One run of the SDK's Runner on the session ``sid`` (a new session object, as a new process makes)."""
    client = _client(url)
    session = GraftmemSession(sid, client, path=heads)
    agent = agents.Agent(name="assistant", instructions="Reply in at most five words.", model=session.model("smollm2"),
                         model_settings=agents.ModelSettings(max_tokens=64, temperature=0))
    result = await agents.Runner.run(agent, text, session=session)
    stored = await client.responses.retrieve(result.raw_responses[-1].response_id)
    return result, (stored.model_extra or {}).get("graftmem") or {}


def test_a_session_resumes_its_stored_chain_after_a_restart(tmp_path):
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    heads, home = tmp_path / "heads.json", tmp_path / "home"
    with serve_process("--no-warm", home=home) as (_, url):
        first, _ = asyncio.run(_turn(url, "ana", "My name is Ana. Say hello to me.", heads))
        assert first.final_output
        GraftmemSession("ana", _client(url), path=heads).fork("unrestarted")
        # the answer the conversation gives when nothing restarts: the fork continues the same chain now
        ref, ref_receipt = asyncio.run(_turn(url, "unrestarted", "What is my name?", heads))
    with serve_process("--no-warm", home=home) as (_, url):
        again, receipt = asyncio.run(_turn(url, "ana", "What is my name?", heads))
        items = asyncio.run(GraftmemSession("ana", _client(url), path=heads).get_items())
    assert again.final_output == ref.final_output
    usage = again.raw_responses[-1].usage
    assert receipt["tokens_restored"] > 0 and receipt["source"] == "store"  # grafted from the store, not RAM
    assert usage.input_tokens_details.cached_tokens == receipt["tokens_restored"]
    assert receipt["tokens_prefilled"] == usage.input_tokens - receipt["tokens_restored"] < 32  # the new turn only
    assert [(i.get("role"), i.get("type")) for i in items] == [("user", "message"), ("assistant", "message")] * 2
    assert items[2]["content"][0]["text"] == "What is my name?"


def test_the_session_protocol_on_a_stored_chain(tiny_llama, tmp_path):
    """get_items reads a chain of two stored responses back in order; pop_item takes the last item and
    moves the head back (the rest of that response waits in the tail); items added by hand wait in the
    tail; all of it survives a new session object on the same file; clear_session forgets it."""
    from graftmem import Memory

    heads = tmp_path / "heads.json"
    with Memory(engine=tiny_llama, home=tmp_path / "home") as mem:
        srv = mem.serve(api=True, warm=False).start()
        try:
            async def run() -> None:
                client = _client(srv.url)
                r1 = await client.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0)
                r2 = await client.responses.create(model="tiny", input="Again", previous_response_id=r1.id,
                                                   max_output_tokens=2, temperature=0)
                s = GraftmemSession("s", client, path=heads)
                s.head = r2.id
                items = await s.get_items()
                assert [(i["role"], i["content"][0]["text"]) for i in items][::2] == [("user", "Hi"), ("user", "Again")]
                assert [i["role"] for i in items] == ["user", "assistant"] * 2
                assert await s.get_items(limit=1) == items[-1:]
                popped = await s.pop_item()
                assert popped == items[-1] and s.head == r1.id
                await s.add_items([{"role": "user", "content": "By hand"}])
                again = GraftmemSession("s", client, path=heads)  # a new process, the same file
                assert again.head == r1.id and [i["role"] for i in await again.get_items()] == [
                    "user", "assistant", "user", "user"]
                await again.clear_session()
                assert await GraftmemSession("s", client, path=heads).get_items() == []
            asyncio.run(run())
        finally:
            srv.close()
