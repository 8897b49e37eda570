"""``POST /v1/embeddings`` with the real ``openai`` client (only ``base_url`` changed): the router's
embedder's vectors, batched, in both encodings the client uses."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from graftmem.memory.router import Router
from graftmem.server import Limits, api_server
from graftmem.store.local import Store


def test_embeddings_are_the_routers_vectors(smol, minilm, tmp_path):
    store = Store(tmp_path / "home")
    texts = ["How do I reset my password?", "The cat sat on the mat.", "Resetting a password: open settings."]
    with api_server(store, [smol], router=lambda: Router(minilm, store)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        batched = c.embeddings.create(model="any", input=texts)  # the client asks for base64 by default
        floats = c.embeddings.create(model="any", input=texts, encoding_format="float")
        one = c.embeddings.create(model="any", input=texts[0])
        assert [d.index for d in batched.data] == [0, 1, 2]
        got = np.array([d.embedding for d in batched.data], dtype=np.float32)
        assert got.shape == (3, minilm.dim)
        assert np.array_equal(got, np.array([d.embedding for d in floats.data], dtype=np.float32))
        # a text's vector does not depend on its batch-mates (a vector store embeds documents in batches
        # and queries alone)
        assert np.array_equal(got[0], np.array(one.data[0].embedding, dtype=np.float32))
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        want = np.concatenate([minilm.embed_batch([t]) for t in texts])
        assert np.allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-6)
        sims = got @ got.T
        assert sims[0, 2] > sims[0, 1]  # the two texts about passwords are the nearest pair
        assert batched.model == minilm.model_id
        assert batched.usage.prompt_tokens == minilm.count_tokens(texts) > 0
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input=[])
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input=[[1, 2, 3]])
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input="x", dimensions=8)


def test_a_server_without_a_router_says_so(smol, tmp_path):
    with api_server(Store(tmp_path / "home"), [smol]) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            c.embeddings.create(model="any", input="hello")
        assert exc.value.code == "embeddings_unavailable"


class _HeldEmbedder:
    """The packaged MiniLM, counting the texts it embeds; its first text waits (bounded) until the test
    lets it go, so the test can act while an embeddings request provably holds its engine."""

    def __init__(self, inner) -> None:
        self.inner, self.model_id = inner, inner.model_id
        self.texts = 0
        self.entered, self.release = threading.Event(), threading.Event()

    def embed_batch(self, texts):
        self.texts += len(texts)
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return self.inner.embed_batch(texts)

    def count_tokens(self, texts):
        return self.inner.count_tokens(texts)


def _post_raw(url: str, body: dict) -> socket.socket:
    host, port = url[len("http://"):].split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


def test_embeddings_are_bounded_per_request(smol, minilm, tmp_path):
    """Too many texts, or too many characters in all, is a 400 naming ``input`` and the limit, before
    anything is embedded."""
    store = Store(tmp_path / "home")
    held = _HeldEmbedder(minilm)
    held.entered.set()  # nothing to hold here
    limits = Limits(max_embedding_inputs=3, max_embedding_chars=100)
    try:
        with api_server(store, [smol], router=lambda: Router(held, store), limits=limits) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            for texts, limit in ((["a", "b", "c", "d"], "1 to 3"), (["x" * 60, "y" * 60], "100 characters")):
                with pytest.raises(openai.BadRequestError) as exc:
                    c.embeddings.create(model="any", input=texts)
                assert exc.value.param == "input" and limit in exc.value.message, exc.value.message
            assert held.texts == 0
            assert len(c.embeddings.create(model="any", input=["a", "b", "c"]).data) == 3  # at the limit
    finally:
        store.close()


def test_embeddings_wait_in_the_engines_queue_and_stop_when_the_client_leaves(smol, minilm, tmp_path):
    """An embeddings request holds an engine as a chat request does: with the one engine busy embedding
    and no room to wait, a chat request and a second embeddings request get 429. A client that leaves
    mid-request stops the work at its next text (it used to embed all of them for nobody). Fails so with
    the embedding run beside the pool (``anyio.to_thread``) and without the ``cancel`` check."""
    store = Store(tmp_path / "home")
    held = _HeldEmbedder(minilm)
    n = 400
    try:
        with api_server(store, [smol], router=lambda: Router(held, store), max_queue=0, learn=False) as srv:
            s = _post_raw(srv.url, {"model": "any", "input": [f"text number {i}" for i in range(n)]})
            try:
                assert held.entered.wait(120), "the embeddings request never started"
                assert srv.pool.in_use == 1  # it holds the engine
                busy = httpx.post(srv.url + "/v1/embeddings", json={"model": "any", "input": "hi"}, timeout=30)
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full", busy.text
                chat = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
                    "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
                assert chat.status_code == 429
            finally:
                s.close()  # the client leaves while its first text is held
            deadline = time.monotonic() + 30
            while srv.runner.connection_counts()["open"] and time.monotonic() < deadline:  # the server saw it
                time.sleep(0.01)
            held.release.set()
            deadline = time.monotonic() + 60
            while srv.pool.in_use and time.monotonic() < deadline:  # bounded wait for the engine back
                time.sleep(0.02)
            assert srv.pool.in_use == 0
            assert held.texts < n, "the request embedded every text for a client that had left"
            r = httpx.post(srv.url + "/v1/embeddings", json={"model": "any", "input": "hi"}, timeout=60)
            assert r.status_code == 200  # the engine serves the next client
    finally:
        store.close()


class _TwiceHeldEmbedder(_HeldEmbedder):
    """Holds its first text until ``release`` and its last (the ``n``-th) until ``finish``; ``passed_last``
    says whether the last text has been embedded."""

    def __init__(self, inner, n: int) -> None:
        super().__init__(inner)
        self.n, self.finish, self.passed_last = n, threading.Event(), False

    def embed_batch(self, texts):
        out = super().embed_batch(texts)
        if self.texts == self.n:
            self.finish.wait(30)
            self.passed_last = True
        return out


def test_a_chat_turn_waits_for_one_slice_of_an_embeddings_request_not_all_of_it(smol, minilm, tmp_path):
    """Embeddings are background work in slices (`EMBED_SLICE_CHARS`): a chat request that arrives while
    a long embeddings request holds the one engine gets it after that request's current slice, before its
    last text. Fails with the whole request on the engine at once (or without the requests-first
    release): the chat answer then comes only after the last text (``passed_last``)."""
    from graftmem.server import embeddings

    store = Store(tmp_path / "home")
    texts = [f"text {i} " + "lorem ipsum " * 80 for i in range(64)]  # ~62 k characters
    assert sum(map(len, texts)) > 2 * embeddings.EMBED_SLICE_CHARS  # several slices
    held = _TwiceHeldEmbedder(minilm, len(texts))
    try:
        with api_server(store, [smol], router=lambda: Router(held, store), learn=False) as srv:
            got: dict = {}
            emb = threading.Thread(target=lambda: got.setdefault("emb", httpx.post(
                srv.url + "/v1/embeddings", json={"model": "any", "input": texts}, timeout=120)))
            emb.start()
            assert held.entered.wait(120), ("the embeddings request never started", got)
            chat = threading.Thread(target=lambda: got.setdefault("chat", httpx.post(
                srv.url + "/v1/chat/completions", timeout=120, json={
                    "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})))
            chat.start()
            deadline = time.monotonic() + 30
            while srv.pool.waiting == 0 and time.monotonic() < deadline:  # the chat request queued
                time.sleep(0.01)
            assert srv.pool.waiting == 1
            held.release.set()
            chat.join(120)
            assert got["chat"].status_code == 200, got["chat"].text
            assert not held.passed_last, "the chat turn waited for the whole embeddings request"
            held.finish.set()
            emb.join(120)
            r = got["emb"]
            assert r.status_code == 200 and len(r.json()["data"]) == len(texts), r.text[:300]
            assert held.texts == len(texts)
    finally:
        held.release.set()
        held.finish.set()
        store.close()


def test_background_work_takes_its_share_of_an_engine_while_requests_come_in(smol):
    """The pool's rule, on its own event loop, no clock waited on: background work (embeddings) gets a
    free engine at once while no request came, but after a request took one it waits until its last
    slice's time, scaled to ``background_share``, has passed; a request meanwhile gets the free engine
    at once. Fails with background work handed every engine no request waits for (the engines' whole
    time went to an embeddings flood between an agent's turns: 8 agents' p95 TTFT 2.5x)."""
    import asyncio

    from graftmem.server.pool import EnginePool

    async def scenario() -> None:
        pool = EnginePool([smol], background_share=0.25)
        first = await pool.acquire(background=True)  # nothing else asked: at once
        pool.background_done(1.0)  # a 1 s slice: with a share of 0.25, requests get the next 3 s
        pool.release(first)
        assert pool.background_allowed(0.0)  # nobody else asked since its slice: still allowed
        chat = await pool.acquire()  # a request takes the engine
        bg = asyncio.ensure_future(pool.acquire(background=True, admitted=True))
        await asyncio.sleep(0)
        pool.release(chat)
        await asyncio.sleep(0)
        assert not bg.done(), "background work took the engine right after a request"
        assert not pool.background_allowed(time.monotonic())
        again = await asyncio.wait_for(pool.acquire(), 5)  # the next request is not held up by it
        pool.release(again)
        pool._bg_next = 0.0  # its share's time has passed
        pool._wake_background()
        engine = await asyncio.wait_for(bg, 5)
        assert engine is smol
        pool.release(engine)
        pool.close()

    asyncio.run(scenario())


def test_preload_router_loads_it_before_the_first_request(smol, minilm, tmp_path):
    """Issue 37: the router's first load (torch and the embedder: seconds of CPU and of the GIL) happened
    inside the first request that routed or embedded, an embeddings flood's first, and stalled the honest
    agents beside it. ``preload_router`` loads it while the server starts; without it, on first use."""
    store = Store(tmp_path / "home")
    loads: list[str] = []

    def factory() -> Router:
        loads.append("router")
        return Router(minilm, store)

    with api_server(store, [smol], router=factory, preload_router=True) as srv:
        assert loads == ["router"]  # before any request
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert len(c.embeddings.create(model="any", input="hi").data) == 1
        assert loads == ["router"]  # and only once
    loads.clear()
    with api_server(store, [smol], router=factory) as srv:
        assert loads == []  # lazy by default: a server that never routes never pays for it
        openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0).embeddings.create(model="any", input="hi")
        assert loads == ["router"]
