"""LangGraph on graftmem (`graftmem.integrations.langgraph`): the checkpointer passes LangGraph's own
conformance suite and survives a reload; the store's items are blocks (namespaces = scopes, search = the
router, recall grafts one); and a real graph (tests/langgraph_app.py) run in two processes, the second
after the first exited, resumes its thread with the conversation grafted from the stored chain."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from graftmem import Memory

pytest.importorskip("langgraph")

from graftmem.integrations import GraftmemCheckpointer, GraftmemStore

ROOT = Path(__file__).resolve().parents[1]


def test_the_checkpointer_passes_langgraphs_conformance_suite(tmp_path):
    conformance = pytest.importorskip("langgraph.checkpoint.conformance")
    made = []

    @conformance.checkpointer_test(name="GraftmemCheckpointer")
    async def saver():
        made.append(tmp_path / f"c{len(made)}.json")
        yield GraftmemCheckpointer(made[-1])

    report = asyncio.run(conformance.validate(saver))
    base = {"put", "put_writes", "get_tuple", "list", "delete_thread"}
    assert {name for name, r in report.results.items() if r.passed} == base, report
    assert sum(report.results[n].tests_passed for n in base) >= 50
    assert any(p.stat().st_size > 0 for p in made if p.exists())  # the suite's writes went to the files


def test_the_checkpointer_keeps_a_thread_across_a_reload(tmp_path):
    from langgraph.graph import START, MessagesState, StateGraph

    def echo(state: MessagesState) -> dict:
        return {"messages": [("ai", f"heard {len(state['messages'])}")]}

    def graph(saver):
        g = StateGraph(MessagesState)
        g.add_node("echo", echo)
        g.add_edge(START, "echo")
        return g.compile(checkpointer=saver)

    cfg = {"configurable": {"thread_id": "t"}}
    graph(GraftmemCheckpointer(tmp_path / "c.json")).invoke({"messages": [("user", "one")]}, cfg)
    reloaded = GraftmemCheckpointer(tmp_path / "c.json")  # a new process reads the file
    out = graph(reloaded).invoke({"messages": [("user", "two")]}, cfg)
    assert [m.content for m in out["messages"]] == ["one", "heard 1", "two", "heard 3"]
    assert len(list(reloaded.list(cfg))) >= 4


@pytest.fixture
def served(tiny_llama, minilm, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "home", embedder=minilm) as mem:
        srv = mem.serve(api=True, warm=False).start()
        try:
            yield mem, srv
        finally:
            srv.close()


def test_the_store_keeps_items_as_blocks_searched_by_the_router(served):
    mem, srv = served
    store = GraftmemStore(srv.url)
    store.put(("users", "ana"), "drink", {"text": "Ana drinks green tea every morning.", "topic": "food"})
    store.put(("users", "ana"), "city", {"text": "Ana lives in Lisbon near the river.", "topic": "home"})
    store.put(("users", "bo"), "drink", {"text": "Bo drinks black coffee.", "topic": "food"})
    item = store.get(("users", "ana"), "drink")
    assert item is not None and item.value["topic"] == "food" and item.namespace == ("users", "ana")
    block = next(b for b in mem.get_all(kind="langgraph") if b.name == "drink" and "Ana" in b.text)
    assert "users/ana/drink: Ana drinks green tea every morning." in block.text  # learned once, as a chat block
    hits = store.search(("users", "ana"), query="what does Ana drink in the morning?")
    assert [h.key for h in hits][0] == "drink" and all(h.namespace == ("users", "ana") for h in hits)
    assert hits[0].score is not None
    assert [h.key for h in store.search(("users",), filter={"topic": "food"})] != []
    assert {tuple(h.namespace) for h in store.search(("users",), filter={"topic": "food"})} == {
        ("users", "ana"), ("users", "bo")}
    assert store.list_namespaces(prefix=("users",)) == [("users", "ana"), ("users", "bo")]
    answer = store.recall(("users", "ana"), "What does Ana drink?", max_tokens=4)
    assert answer["block"]["id"] == block.id and answer["receipt"]["tokens_restored"] == block.n_tokens
    store.put(("users", "ana"), "city", {"text": "Ana lives in Lisbon near the river.", "topic": "work"})
    assert store.get(("users", "ana"), "city").value["topic"] == "work"  # same text, a changed field: stored
    store.put(("users", "ana"), "drink", {"text": "Ana switched to coffee.", "topic": "food"})  # a new value
    assert store.get(("users", "ana"), "drink").value["text"] == "Ana switched to coffee."
    assert not any(b.id == block.id for b in mem.get_all())  # the old block went with it
    store.delete(("users", "ana"), "drink")
    assert store.get(("users", "ana"), "drink") is None and store.get(("users", "bo"), "drink") is not None


def _app(url: str, checkpoints: Path, text: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "langgraph_app.py"), url, str(checkpoints), "t", text],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_graph_resumes_its_thread_grafted_after_a_restart(smol, minilm, tmp_path):
    """Turn 1 in one process, turn 2 in another: the thread (checkpointer file) resumes, LangChain sends
    ``previous_response_id``, the server grafts the stored chain from the store (an unrelated request
    took the engine's RAM meanwhile); the answer is the one the conversation gets re-sent whole with
    graftmem's cache off."""
    with Memory(engine=smol, home=tmp_path / "home", embedder=minilm) as mem:
        srv = mem.serve(api=True, warm=False).start()
        try:
            first = _app(srv.url, tmp_path / "thread.json", "My name is Ana. Say hello.")
            # another client in between: the engine's cells are no longer the thread's
            httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
                "model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "Unrelated."}]})
            second = _app(srv.url, tmp_path / "thread.json", "What is my name?")
            stored = httpx.get(f"{srv.url}/v1/responses/{second['response_id']}", timeout=30).json()
            receipt, usage = stored["graftmem"], stored["usage"]
            # the same conversation without graftmem's cache: sent whole, prefilled from nothing
            cold = httpx.post(srv.url + "/v1/responses", timeout=300, json={
                "model": "smollm2", "max_output_tokens": 12, "temperature": 0, "store": False,
                "graftmem": {"cache": False},
                "input": [{"role": "user", "content": "My name is Ana. Say hello."},
                          {"role": "assistant", "content": first["answer"]},
                          {"role": "user", "content": "What is my name?"}]}).json()
        finally:
            srv.close()
    assert second["messages"] == 4 and second["memories"] == ["turn-1", "turn-2"]
    assert receipt["source"] == "store" and receipt["tokens_restored"] > 0
    assert receipt["response"]["previous_response_id"] == first["response_id"]
    assert receipt["tokens_prefilled"] == usage["input_tokens"] - receipt["tokens_restored"] < 32  # the new turn only
    assert cold["graftmem"]["tokens_restored"] == 0
    assert second["answer"] == cold["output"][0]["content"][0]["text"]


def test_a_thread_whose_stored_chain_is_gone_is_resent_whole(served, tmp_path):
    """With ``url``, a thread whose last response the server no longer holds comes back without the
    response ids (ChatOpenAI then sends the whole conversation instead of a previous_response_id that
    would be a 404); one whose response is there is left as it was."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import START, MessagesState, StateGraph

    _, srv = served
    kept = httpx.post(srv.url + "/v1/responses", timeout=300, json={
        "model": "tiny", "input": "Hello", "max_output_tokens": 2, "temperature": 0}).json()["id"]

    def node(state: MessagesState) -> dict:
        return {}

    g = StateGraph(MessagesState)
    g.add_node("n", node)
    g.add_edge(START, "n")
    saver = GraftmemCheckpointer(tmp_path / "c.json", url=srv.url)
    graph = g.compile(checkpointer=saver)
    for thread, rid in (("alive", kept), ("gone", "resp_0000000000000000000000000000dead")):
        graph.invoke({"messages": [HumanMessage("Hi"), AIMessage("Hello", response_metadata={"id": rid})]},
                     {"configurable": {"thread_id": thread}})
    alive = saver.get_tuple({"configurable": {"thread_id": "alive"}}).checkpoint["channel_values"]["messages"]
    gone = saver.get_tuple({"configurable": {"thread_id": "gone"}}).checkpoint["channel_values"]["messages"]
    assert alive[-1].response_metadata.get("id") == kept
    assert "id" not in gone[-1].response_metadata and gone[-1].content == "Hello"
