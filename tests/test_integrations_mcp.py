"""The MCP server (`graftmem.integrations.mcp`), driven by the ``mcp`` SDK's own client: over streamable
HTTP at ``/mcp`` of a real server on 127.0.0.1 (tenants: one key's session never sees another's blocks),
over stdio (``graftmem mcp`` in a child process, through a server and on its own model), and by an agent
framework (the OpenAI Agents SDK's ``MCPServerStreamableHttp``, its model served by graftmem).

The memory verbs hold on any model: the server's engine is the tiny Llama 3.1 of tests/tiny.py; the
agent framework's model is SmolLM2 (it must emit a tool call, forced by ``tool_choice``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from graftmem import Memory
from graftmem.server import ApiKeys, hash_key

pytest.importorskip("mcp")

from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from graftmem.integrations import McpDoor

ROOT = Path(__file__).resolve().parents[1]
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
MANUAL = "Refunds take 14 days and need the receipt. Exchanges are free within 30 days."
TOOLS = {"learn", "recall", "search", "ask", "verify", "forget", "list", "show"}


def _keys(tmp_path: Path) -> ApiKeys:
    f = tmp_path / "keys"
    f.write_text(f"alice {hash_key(ALICE)}\nbob {hash_key(BOB)}\n")
    return ApiKeys.load(f)


@pytest.fixture
def served(tiny_llama, minilm, tmp_path):
    """A server with tenants, its memory routes (a router) and the MCP door at /mcp, on 127.0.0.1."""
    with Memory(engine=tiny_llama, home=tmp_path / "home", embedder=minilm) as mem:
        srv = mem.serve(api=True, api_key=_keys(tmp_path), warm=False, mounts=(("/mcp", McpDoor()),)).start()
        try:
            yield mem, srv
        finally:
            srv.close()


def _http(url: str, key: str) -> Client:
    c = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
    return Client(streamable_http_client(url + "/mcp", http_client=c))


async def _learn_and_recall(client: Client) -> tuple[dict, dict]:
    """What the issue asks an MCP client to do: list the tools, learn a manual, recall with it."""
    listed = {t.name for t in (await client.list_tools()).tools}
    assert TOOLS <= listed, listed
    got = await client.call_tool("learn", {"text": MANUAL, "name": "refunds",
                                           "when_to_use": "questions about refunds and exchanges"})
    assert not got.is_error, got
    block = got.structured_content["block"]
    ans = await client.call_tool("recall", {"task": "How long do refunds take?", "max_tokens": 6})
    assert not ans.is_error, ans
    return block, ans.structured_content


def test_mcp_over_http_learns_recalls_with_a_receipt_and_keeps_tenants_apart(served):
    mem, srv = served

    async def run() -> None:
        async with _http(srv.url, ALICE) as alice:
            block, ans = await _learn_and_recall(alice)
            assert ans["matched"] and ans["block"]["id"] == block["id"]
            receipt = ans["receipt"]
            assert receipt["exact"] is True and receipt["block_id"] == block["id"]
            assert receipt["tokens_restored"] == block["n_tokens"] > 0 and receipt["tokens_prefilled"] > 0
            hits = (await alice.call_tool("search", {"query": "refund delay", "top_k": 3})).structured_content["hits"]
            assert hits[0]["block_id"] == block["id"]
            asked = (await alice.call_tool("ask", {"block_id": block["id"][:12], "question": "How long?",
                                                   "max_tokens": 4})).structured_content
            assert asked["receipt"]["tokens_restored"] == block["n_tokens"]
            rep = (await alice.call_tool("verify", {"block_id": block["id"], "samples": 2})).structured_content
            assert rep["ok"] is True and rep["sha_equal"] == rep["samples"] == 2
            shown = (await alice.call_tool("show", {"block_id": block["id"]})).structured_content
            assert shown["text"] == mem.get(block["id"]).text and "tokens" not in shown
            text = (await alice.read_resource(f"graftmem://blocks/{block['id']}")).contents[0].text
            assert text == mem.get(block["id"]).text
            listing = json.loads((await alice.read_resource("graftmem://blocks")).contents[0].text)
            assert [b["id"] for b in listing] == [block["id"]] and listing[0]["shared"] is False

            async with _http(srv.url, BOB) as bob:  # another tenant: alice's block is not there for it
                assert (await bob.call_tool("list", {})).structured_content["blocks"] == []
                assert json.loads((await bob.read_resource("graftmem://blocks")).contents[0].text) == []
                for name, args in (("show", {"block_id": block["id"]}), ("forget", {"block_id": block["id"]}),
                                   ("ask", {"block_id": block["id"], "question": "How long?"}),
                                   ("verify", {"block_id": block["id"]})):
                    res = await bob.call_tool(name, args)
                    assert res.is_error and "BlockNotFound" in res.content[0].text, (name, res)
                r = (await bob.call_tool("recall", {"task": "How long do refunds take?"})).structured_content
                assert not r["matched"] and r["block"] is None and r["receipt"]["tokens_restored"] == 0
                assert (await bob.call_tool("search", {"query": "refund delay"})).structured_content["hits"] == []
            gone = (await alice.call_tool("forget", {"block_id": block["id"]})).structured_content
            assert gone["deleted"] == [block["id"]]

    asyncio.run(run())
    # no key, no MCP: the server's key middleware stands in front of the door
    import httpx

    r = httpx.post(srv.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                   headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 401


def _stdio(*args: str, **env: str) -> Client:
    return Client(StdioServerParameters(
        command=sys.executable, args=["-m", "graftmem", "mcp", *args], cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **env}))


def test_mcp_over_stdio_through_a_server(served):
    """``graftmem mcp --url``: the stdio server's tools are requests to a running server, with the key of
    $GRAFTMEM_API_KEY (its tenant's view)."""
    mem, srv = served

    async def run() -> None:
        async with _stdio("--url", srv.url, GRAFTMEM_API_KEY=ALICE) as client:
            block, ans = await _learn_and_recall(client)
            assert ans["matched"] and ans["block"]["id"] == block["id"]
            assert ans["receipt"]["exact"] is True and ans["receipt"]["tokens_restored"] == block["n_tokens"]
    asyncio.run(run())
    assert [b.id for b in mem.get_all()] and mem.get_all()[0].text.count("Refunds take 14 days") == 1


def test_mcp_over_stdio_on_its_own_model(tmp_path):
    """``graftmem mcp`` without a server: the model loads in that process, the tools answer there."""
    from tests.tiny import tiny_path

    async def run() -> None:
        async with _stdio("--model", str(tiny_path("llama31")), "--home", str(tmp_path / "own")) as client:
            assert TOOLS <= {t.name for t in (await client.list_tools()).tools}
            got = (await client.call_tool("learn", {"text": MANUAL, "name": "refunds"})).structured_content
            ans = (await client.call_tool("ask", {"block_id": got["block"]["id"], "question": "How long?",
                                                  "max_tokens": 3})).structured_content
            assert ans["receipt"]["tokens_restored"] == got["block"]["n_tokens"] and ans["receipt"]["exact"] is True
    asyncio.run(run())
    assert Memory.__name__ and (tmp_path / "own").is_dir()


def test_an_agents_sdk_agent_calls_graftmems_mcp_tools(smol, minilm, tmp_path):
    """The OpenAI Agents SDK's own MCP client (``MCPServerStreamableHttp``) lists graftmem's tools and its
    agent calls one, its model (SmolLM2) served by the same graftmem server; the call is forced with
    ``tool_choice`` (a 135M model picks tools poorly; the protocol is what is checked)."""
    agents = pytest.importorskip("agents")
    from agents.mcp import MCPServerStreamableHttp, create_static_tool_filter
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # nothing leaves the machine
    with Memory(engine=smol, home=tmp_path / "home", embedder=minilm) as mem:
        block = mem.learn(MANUAL, name="refunds", chat=True, when_to_use="questions about refunds")
        srv = mem.serve(api=True, warm=False, mounts=(("/mcp", McpDoor()),)).start()
        try:
            async def run() -> object:
                async with MCPServerStreamableHttp({"url": srv.url + "/mcp"}, client_session_timeout_seconds=120) as door:
                    assert TOOLS <= {t.name for t in await door.list_tools()}
                    # the agent gets the one tool it is forced to call: a shorter prompt for a 135M model
                    door.tool_filter = create_static_tool_filter(allowed_tool_names=["search"])
                    model = agents.OpenAIChatCompletionsModel(
                        "smollm2", AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0))
                    agent = agents.Agent(name="support", instructions="Search the memory for the task.", model=model,
                                         mcp_servers=[door], tool_use_behavior="stop_on_first_tool",
                                         model_settings=agents.ModelSettings(tool_choice="search", max_tokens=96, temperature=0))
                    return await agents.Runner.run(agent, "How long do refunds take?", max_turns=2)
            result = asyncio.run(run())
        finally:
            srv.close()
    calls = [i for i in result.new_items if type(i).__name__ == "ToolCallItem"]
    assert calls and calls[0].raw_item.name == "search"
    assert block.id in str(result.final_output)  # the tool's answer (its hits), which the agent stopped on


def test_graftmem_serve_mcp_answers_at_mcp_behind_its_key(tmp_path):
    """``graftmem serve --mcp`` (its own process, as an operator starts it): the banner names the door,
    a client with the key learns and asks through it, a wrong key is refused by the key middleware."""
    import httpx

    from tests.served import serve_process
    from tests.tiny import tiny_path

    with serve_process("--mcp", "--api-key", ALICE, "--no-warm", "--model", str(tiny_path("llama31")),
                       home=tmp_path / "home") as (proc, url):
        async def run() -> None:
            async with _http(url, ALICE) as client:
                assert TOOLS <= {t.name for t in (await client.list_tools()).tools}
                got = (await client.call_tool("learn", {"text": MANUAL, "name": "refunds"})).structured_content
                ans = (await client.call_tool("ask", {"block_id": got["block"]["id"], "question": "How long?",
                                                      "max_tokens": 3})).structured_content
                assert ans["receipt"]["tokens_restored"] == got["block"]["n_tokens"] > 0
        asyncio.run(run())
        wrong = httpx.post(url + "/mcp", headers={"Authorization": f"Bearer {BOB}",
                                                  "Accept": "application/json, text/event-stream"},
                           json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert wrong.status_code == 401
    banner = proc.stdout.read() if proc.stdout else ""  # type: ignore[union-attr]
    assert f"{url}/mcp (streamable HTTP" in banner


def test_without_the_mcp_extra_the_cli_says_which_to_install(tmp_path):
    """``graftmem mcp`` / ``serve --mcp`` where the SDK is missing: one line naming the extra, exit 2."""
    import subprocess

    code = ("import sys; sys.modules['mcp'] = None\n"  # as if `mcp` were not installed
            "from graftmem.cli import main\nsys.exit(main(sys.argv[1:]))")
    for args in (["mcp"], ["serve", "--mcp", "--port", "0"]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "GRAFTMEM_HOME": str(tmp_path)}, timeout=120)
        assert proc.returncode == 2 and "pip install 'graftmem[mcp]'" in proc.stderr, (args, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr
