"""The OpenAI-compatible API on a real uvicorn socket, with the official `openai` package and
LangChain's ChatOpenAI (only base_url changed), on the real SmolLM2 engine.

Exactness is checked through the API: a request whose prefix was grafted returns the same greedy tokens
and the same log-probabilities (floats compared exactly) as the same request served cold.

The tests of server plumbing (grafting from the store / RAM / a warm start, refusal of another
fingerprint's or a corrupted block, concurrent clients, streamed log-probabilities and strict bodies, the
memory REST endpoints) run
on the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: a real llama.cpp engine, real
tokenizer and chat template), whose prefill costs ~1/100th of SmolLM2's: graft == cold holds on any model.
Those whose assertion depends on what SmolLM2 says (a completion's text, a tool call, an agent framework's
run) or on its ChatML template stay on SmolLM2."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import openai
import pytest

from graftmem import Memory
from graftmem.server import RECEIPT_HEADER, api_server
from graftmem.store.local import Store

from .conftest import long_text
from .test_bundle import forge, other_model

SYSTEM = "You are the support agent of a shop. " + long_text(70, seed=41)
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "What is two plus two?"}]


def _client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, **kw)


def _ask(c: openai.OpenAI, messages=MESSAGES, *, cache: bool = True, max_tokens: int = 8, **kw):
    return c.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0,
                                     logprobs=True, top_logprobs=2,
                                     extra_body=kw.pop("extra_body", {"graftmem": {"cache": cache}}), **kw)


def _fingerprint(r) -> list:
    """What must be equal byte for byte: the text, each token and its log-probability, the alternatives."""
    return [r.choices[0].message.content,
            [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]]


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def _receipt_of(c: openai.OpenAI, messages=MESSAGES):
    raw = c.chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    return raw.parse(), json.loads(raw.headers[RECEIPT_HEADER])


OTHER = [{"role": "system", "content": "You answer in French. " + long_text(40, seed=5)},
         {"role": "user", "content": "Bonjour"}]


def test_grafted_prefix_is_exact_and_survives_a_restart(tiny_llama, home):
    """Each way a prompt's prefix is reused gives the cold request's bytes: a graft from the store, the
    cells the previous request left in RAM, the warm start's graft after a restart, a restart without it."""
    store = Store(home)
    try:
        with api_server(store, [tiny_llama], min_prefix_tokens=32, sightings=2) as srv:
            assert srv.warm == []  # nothing learned yet: nothing to warm
            c = _client(srv)
            cold = _ask(c, cache=False)
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            assert cold.choices[0].logprobs.content  # tokens to compare: the model did not stop at once
            first, second = _ask(c), _ask(c)  # two sightings: learned after the second
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert srv.pipeline.wait_idle()  # the answer comes before the prefix is stored
            kinds = {b.kind for b in store.list()}
            assert kinds == {"auto"}, kinds
            _ask(c, OTHER)  # another prompt takes the engine's cells: the next request grafts from the store
            warm, receipt = _receipt_of(c)
            n_cached = warm.usage.prompt_tokens_details.cached_tokens
            assert receipt["source"] == "store" and receipt["block_id"]
            assert n_cached > 32 and receipt["tokens_restored"] == n_cached
            assert warm.model_extra["graftmem"]["block_id"] == receipt["block_id"]
            assert n_cached == warm.usage.prompt_tokens - 1  # the graft: all but the header's last token
            # the same prompt again: the previous request's cells, kept in RAM with their first logits
            # (`Kept.first`): nothing is prefilled, where the graft prefilled the header's last token
            again, receipt2 = _receipt_of(c)
            assert receipt2["source"] == "ram" and receipt2["tokens_prefilled"] == 0
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
            assert _fingerprint(warm) == _fingerprint(cold) == _fingerprint(first) == _fingerprint(second)
            assert _fingerprint(again) == _fingerprint(cold)
            # streaming from the kept prefix gives the same text
            parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if ch.choices]
            assert "".join(parts) == cold.choices[0].message.content
        # a new server on the same home (a restart) grafts the learned prefix before serving: in RAM at once
        with api_server(store, [tiny_llama], min_prefix_tokens=32) as srv2:
            assert [w["block_id"] for w in srv2.warm] == [receipt["block_id"]]
            r, rec = _receipt_of(_client(srv2))
            assert rec["source"] == "ram" and rec["block_id"] == receipt["block_id"]
            assert r.usage.prompt_tokens_details.cached_tokens == n_cached and _fingerprint(r) == _fingerprint(cold)
        # a restart without the warm start: the first request grafts from the store, same bytes
        with api_server(store, [tiny_llama], min_prefix_tokens=32, warm=False) as srv3:
            assert srv3.warm == []
            again = _ask(_client(srv3))
            assert again.usage.prompt_tokens_details.cached_tokens == n_cached
            assert again.model_extra["graftmem"]["source"] == "store"
            assert _fingerprint(again) == _fingerprint(cold)
            # the next turn of the conversation reuses the same prefix and prefills only the new turns
            longer = MESSAGES + [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"}]
            nxt, nxt_cold = _ask(_client(srv3), longer), _ask(_client(srv3), longer, cache=False)
            assert nxt.usage.prompt_tokens_details.cached_tokens >= n_cached
            assert _fingerprint(nxt) == _fingerprint(nxt_cold)
    finally:
        store.close()


def test_manual_block_is_used_other_fingerprint_never_corrupted_refused(tiny_llama, home, caplog):
    """A system turn learned with Memory.learn(chat=True) is grafted; the same block under another
    engine fingerprint is never used; a corrupted block is refused and the request served cold."""
    with Memory(engine=tiny_llama, home=home) as m:
        block = m.learn(SYSTEM, chat=True, name="system")
        with api_server(m.store, [tiny_llama], learn=False) as srv:
            c = _client(srv)
            cold = _ask(c, cache=False)
            assert cold.choices[0].logprobs.content  # tokens to compare: the model did not stop at once
            warm = _ask(c)
            assert warm.model_extra["graftmem"]["block_id"] == block.id
            assert warm.usage.prompt_tokens_details.cached_tokens == block.n_tokens
            assert _fingerprint(warm) == _fingerprint(cold)
        # the same tokens under another model's fingerprint: invisible to the lookup
        fid = forge(m.store, block.id, fingerprint=other_model(block.fingerprint))
        m.store.delete(block.id)
        assert [b.id for b in m.store.list()] == [fid]
        with api_server(m.store, [tiny_llama], learn=False) as srv:
            r = _ask(_client(srv))
            assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.model_extra["graftmem"]["block_id"] is None
            assert _fingerprint(r) == _fingerprint(cold)
        m.store.delete(fid)
        # a corrupted state: refused (logged), served cold, same answer
        block = m.learn(SYSTEM, chat=True, name="system")
        p = m.store.path_of(block.id)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        p.write_bytes(bytes(raw))
        with api_server(m.store, [tiny_llama], learn=False) as srv, caplog.at_level(logging.WARNING, logger="graftmem"):
            r = _ask(_client(srv))
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            assert _fingerprint(r) == _fingerprint(cold)
            assert any("refused" in rec.getMessage() and block.id[:12] in rec.getMessage() for rec in caplog.records)


def test_openai_errors_and_completions(smol, home):
    store = Store(home)
    try:
        with api_server(store, [smol]) as srv:
            c = _client(srv)
            assert [m.id for m in c.models.list()] == ["smollm2"]
            with pytest.raises(openai.BadRequestError, match="n must be 1"):
                c.chat.completions.create(model="smollm2", messages=MESSAGES, n=2)
            with pytest.raises(openai.BadRequestError, match="temperature"):
                c.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=5)
            with pytest.raises(openai.BadRequestError, match="messages"):
                c.chat.completions.create(model="smollm2", messages=[])
            r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and set(err) == {"message", "type", "param", "code"}
            assert httpx.get(srv.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
            done = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
            stopped = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                           temperature=0, stop=["aris"])
            assert "aris" in done.choices[0].text
            assert stopped.choices[0].text == done.choices[0].text.split("aris")[0]
            assert stopped.choices[0].finish_reason == "stop"
            # a seeded sample is reproducible
            a, b = (c.chat.completions.create(model="smollm2", messages=MESSAGES[-1:], max_tokens=6, temperature=0.9,
                                              top_p=0.95, seed=7).choices[0].message.content for _ in range(2))
            assert a == b
    finally:
        store.close()


def test_eight_concurrent_clients_get_their_own_answers(tiny_llama, home):
    """Two engines on one loaded model (two contexts decoding at once on the same weights), eight clients
    at once (half streaming): each answer equals the one it gets alone."""
    questions = [f"Name a color number {i}." for i in range(8)]
    msgs = [[{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": q}]
            for q in questions]
    with tiny_llama.sibling() as second:
        assert second.fingerprint == tiny_llama.fingerprint and second.model_handle == tiny_llama.model_handle
        store = Store(home)
        try:
            with api_server(store, [tiny_llama, second], max_queue=8, learn=False) as srv:
                c = _client(srv)
                alone = [c.chat.completions.create(model="m", messages=m, max_tokens=5, temperature=0)
                         .choices[0].message.content for m in msgs]
                got: dict[int, str] = {}

                def one(i: int) -> None:
                    cc = _client(srv)
                    if i % 2:
                        s = cc.chat.completions.create(model="m", messages=msgs[i], max_tokens=5, temperature=0,
                                                       stream=True)
                        got[i] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
                    else:
                        got[i] = cc.chat.completions.create(model="m", messages=msgs[i], max_tokens=5,
                                                            temperature=0).choices[0].message.content

                threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                assert [got.get(i) for i in range(8)] == alone and any(alone)  # answers with text to compare
                assert srv.pipeline.wait_idle(30)
                # a streamed answer's last chunk is sent just before its engine is handed back
                assert srv.pool.wait_all_free(30), srv.pool.in_use
        finally:
            store.close()


def test_full_queue_is_429_and_a_disconnect_frees_the_context(smol, home):
    store = Store(home)
    try:
        with api_server(store, [smol], max_queue=0, learn=False) as srv:
            c = _client(srv)
            long = [{"role": "user", "content": "Write a long story about a cat."}]
            stream = c.chat.completions.create(model="m", messages=long, max_tokens=400, temperature=0, stream=True)
            it = iter(stream)
            next(it), next(it)  # the engine is busy decoding
            assert srv.pool.in_use == 1
            with pytest.raises(openai.RateLimitError) as e:
                c.chat.completions.create(model="m", messages=long, max_tokens=2)
            assert e.value.body["code"] == "queue_full"  # type: ignore[index]
            stream.close()  # the client goes away mid-stream
            assert srv.pipeline.wait_idle(30), "the disconnected request's worker is still running"
            assert srv.pool.wait_all_free(30), "the disconnected request kept its engine"
            r = c.chat.completions.create(model="m", messages=long, max_tokens=2, temperature=0)
            assert r.choices[0].finish_reason == "length"
    finally:
        store.close()


def test_langchain_chat_openai(smol, home):
    from langchain_openai import ChatOpenAI

    store = Store(home)
    try:
        with api_server(store, [smol]) as srv:
            llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                             max_tokens=8, max_retries=0)
            msgs = [("system", "Answer in a few words."), ("human", "What is the capital of France?")]
            whole = llm.invoke(msgs).content
            streamed = "".join(ch.content for ch in llm.stream(msgs))
            direct = _client(srv).chat.completions.create(
                model="smollm2", max_tokens=8, temperature=0,
                messages=[{"role": "system", "content": "Answer in a few words."},
                          {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content
            assert whole == streamed == direct and whole
    finally:
        store.close()


def test_docs_agents_snippets_run(smol, home, capsys):
    """Every Python snippet of docs/agents.md runs against a real server (only the URL replaced)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(snippets) >= 2
    store = Store(home)
    try:
        printed: dict[str, str] = {}
        with api_server(store, [smol]) as srv:
            for code in snippets:
                exec(compile(code.replace("http://127.0.0.1:8765", srv.url), "docs/agents.md", "exec"), {})
                printed[code] = capsys.readouterr().out
        # the outputs the page shows are what its snippets printed (tests/test_docs.py's rule)
        from tests.test_docs import assert_output_shown, python_blocks

        runnable = python_blocks("docs/agents.md")
        assert set(runnable) <= set(printed), "a runnable block the regex did not find"
        for i, code in enumerate(runnable):
            assert_output_shown("docs/agents.md", i, printed[code])
        lines = "".join(printed.values()).splitlines()
        assert lines[1] == "cached tokens: 0"
        assert lines[0] and lines[0] == lines[2]  # streamed == not streamed
        assert lines[3]
        assert lines[4].startswith("tool_calls [('lookup'"), lines[4]  # the tools snippet: a parsed call
    finally:
        store.close()


def test_streamed_logprobs_and_strict_bodies(tiny_llama, home):
    """Streamed chunks carry the same tokens and log-probabilities as the whole answer; a JSON body over
    the limit is a 413 and a body that stops arriving is a 408, both in OpenAI's shape."""
    import socket
    from urllib.parse import urlsplit

    from graftmem.server import Limits

    store = Store(home)
    try:
        with api_server(store, [tiny_llama], learn=False, limits=Limits(max_body_bytes=4096, body_timeout=1.0)) as srv:
            c = _client(srv)
            whole = _ask(c, MESSAGES[-1:])
            assert whole.choices[0].logprobs.content  # tokens to compare
            chunks = list(c.chat.completions.create(model="m", messages=MESSAGES[-1:], max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=2, stream=True))
            streamed = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                        for ch in chunks if ch.choices and ch.choices[0].logprobs
                        for t in ch.choices[0].logprobs.content]
            assert streamed == _fingerprint(whole)[1]
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
                whole.choices[0].message.content
            with pytest.raises(openai.APIStatusError) as e:
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 5000}])
            assert e.value.status_code == 413 and e.value.body["code"] == "body_too_large"  # type: ignore[index]
            u = urlsplit(srv.url)
            with socket.create_connection((u.hostname, u.port), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"messages\"")  # ...and nothing more
                t0 = time.monotonic()
                reply = b""
                while chunk := s.recv(4096):  # the server closes the connection after its answer
                    reply += chunk
                assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply
                assert time.monotonic() - t0 < 8
    finally:
        store.close()


def test_auto_blocks_are_evicted_lru_leaf_first_and_user_blocks_never(smol, home):
    def convo(topic: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"You answer questions about {topic}."},
                {"role": "user", "content": f"Tell me about {topic}."},
                {"role": "assistant", "content": "Gladly."},
                {"role": "user", "content": "Go on."}]

    with Memory(engine=smol, home=home) as m:
        manual = m.learn("You answer questions about apples.", chat=True, name="user-learned")
        with api_server(m.store, [smol], min_prefix_tokens=8, sightings=1, max_auto_bytes=None) as srv:
            c = _client(srv)
            # segments: [system] [user, header] [assistant, user, header] [the header's last token], never learned
            _ask(c, convo("apples"), max_tokens=1)   # chained on the user's block: 2 auto blocks
            _ask(c, convo("pears"), max_tokens=1)    # a chain of its own: 3 auto blocks
            assert srv.pipeline.wait_idle()  # stored after the answer
            auto = {b.id: b for b in m.store.list(kind="auto")}
            assert len(auto) == 5
            apples_leaf = next(b for b in auto.values() if b.parent in auto and auto[b.parent].parent == manual.id)
            assert "Gladly." in apples_leaf.text
            _ask(c, convo("pears"), max_tokens=1)    # pears used again: apples is the least recently used
            cache = srv.cache
            cache.max_auto_bytes = sum(b.state_size for b in auto.values()) - 1
            assert cache.evict() == [apples_leaf.id]
            cache.max_auto_bytes = 0
            cache.evict()
            assert [b.id for b in m.store.list()] == [manual.id]
            assert _ask(c, convo("apples"), max_tokens=1).usage.prompt_tokens_details.cached_tokens == manual.n_tokens


def test_routed_recall_grafts_the_chosen_block_exactly(smol, home):
    """`"graftmem": {"recall": true}`: the router picks the manual for the last user message, it is put
    before the messages and grafted; the answer equals the same prompt served cold, byte for byte."""
    with Memory(engine=smol, home=home) as m:
        manual = m.learn("Refunds: customers get their money back within 14 days with the receipt.", chat=True,
                         name="refunds", when_to_use="questions about refunds, returns and money back")
        m.learn("Shipping: parcels leave the warehouse every Monday.", chat=True, name="shipping",
                when_to_use="questions about shipping, parcels and delivery days")
        with api_server(m.store, [smol], learn=False, router=lambda: m.router) as srv:
            c = _client(srv)
            ask = [{"role": "user", "content": "Can I get my money back for a return?"}]
            warm = _ask(c, ask, extra_body={"graftmem": {"recall": True, "min_score": 0.1}})
            receipt = warm.model_extra["graftmem"]
            assert receipt["recall"]["block_id"] == manual.id and receipt["block_id"] == manual.id
            assert warm.usage.prompt_tokens_details.cached_tokens == manual.n_tokens
            cold = _ask(c, ask, extra_body={"graftmem": {"recall": True, "min_score": 0.1, "cache": False}})
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            assert _fingerprint(warm) == _fingerprint(cold)
            # the same prompt written out by hand (the manual as the system turn) is the same computation
            by_hand = _ask(c, [{"role": "system", "content": manual.text[len("<|im_start|>system\n"):-len("<|im_end|>\n")]},
                               *ask], cache=False)
            assert _fingerprint(by_hand) == _fingerprint(cold)
            none = _ask(c, ask, extra_body={"graftmem": {"recall": True, "min_score": 1.49}})
            assert none.model_extra["graftmem"]["recall"]["block_id"] is None
            assert none.usage.prompt_tokens_details.cached_tokens == 0


def test_memory_rest_endpoints_give_what_memory_gives(tiny_llama, home, capsys):
    """learn / list / get / search / recall / delete over HTTP; the recall through the server is the
    recall of Memory (same block, same answer, same first-step logits hash)."""
    with Memory(engine=tiny_llama, home=home) as m:
        with api_server(m.store, [tiny_llama], learn=False, router=lambda: m.router) as srv:
            u = srv.url + "/v1/memory"
            r = httpx.post(u + "/learn", json={"text": "Refunds take 14 days and need the receipt.", "chat": True,
                                                "name": "refunds", "when_to_use": "refunds and money back"},
                           timeout=60)
            assert r.status_code == 200 and r.json()["new"] is True
            bid = r.json()["block"]["id"]
            httpx.post(u + "/learn", json={"text": "Parcels ship on Mondays.", "chat": True, "name": "shipping",
                                           "when_to_use": "shipping and delivery"}, timeout=60)
            listed = httpx.get(u + "/blocks").json()["blocks"]
            assert {b["name"] for b in listed} == {"refunds", "shipping"}
            assert httpx.get(f"{u}/blocks/{bid[:10]}").json()["id"] == bid
            assert httpx.get(f"{u}/blocks/{'f' * 12}").status_code == 404
            task = "How long does a refund take?"
            hits = httpx.post(u + "/search", json={"query": task, "top_k": 2}, timeout=60).json()["hits"]
            assert hits[0]["block_id"] == bid
            via = httpx.post(u + "/recall", json={"task": task, "max_tokens": 6, "min_score": 0.1}, timeout=60).json()
            direct = m.recall(task, max_tokens=6, min_score=0.1)
            assert via["block"]["id"] == direct.block.id == bid and via["text"] == direct.text and direct.text
            assert via["receipt"]["first_logits_sha256"] == direct.receipt.first_logits_sha256
            # the CLI as a client of the running server: same hits, same answer, no model loaded
            from graftmem.cli import main

            capsys.readouterr()
            assert main(["--url", srv.url, "--json", "search", task, "--top-k", "2"]) == 0
            assert json.loads(capsys.readouterr().out)[0]["block_id"] == bid
            assert main(["--url", srv.url, "--json", "recall", task, "--max-tokens", "6", "--min-score", "0.1"]) == 0
            assert json.loads(capsys.readouterr().out)["text"] == direct.text
            assert main(["--url", srv.url + "/nope", "search", task]) == 2
            assert httpx.post(u + "/learn", json={"text": ""}).json()["error"]["param"] == "text"
            assert httpx.delete(f"{u}/blocks/{bid}").json()["deleted"] == [bid]
            assert httpx.post(u + "/search", json={"query": task}, timeout=60).json()["hits"][0]["block_id"] != bid
