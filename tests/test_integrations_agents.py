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
