"""A block nothing here vouches for is never grafted without consent, whatever the door.

The attack (issue 24, red team): a block whose provenance is ``unverified`` (imported with
``--no-rederive``, pulled unchecked, a file dropped into the store) may hold the KV state of another
text than its own. ``Memory.ask`` refused it; the server's prefix cache, its warm start, REST
``recall`` and the OpenAI routes grafted it, and ``recall_stream`` streamed its answer before refusing.

Here every door is tried with such a block prefixing the prompt: chat, completions, the warm start, the
prefix index lookup, the in-RAM reuse after a consented request, REST ``recall`` / ``ask``,
``Memory.recall``, ``recall_stream``, and the pager's ``recall_document`` (a page imported unchecked). Without consent nothing of it is grafted (the request is served
cold, or refused where the verb is "answer from THIS block"); with consent it is, and the receipt names
its provenance. A block is marked ``unverified`` the way the store does it for an unchecked arrival
(`Store.set_provenance`): the gate looks at provenance, not at the bytes, so a faithful state marked
unverified is as refused as a forged one (the forged-state path itself is tests/test_trust.py's).

The gate is server and store plumbing and holds on any model: every test runs the tiny random-weight
Llama 3.1 of tests/tiny.py (`tiny_llama`, a real llama.cpp engine with the real tokenizer and template),
whose prefills cost ~1/100th of SmolLM2's. Routing is MiniLM's, as before.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from graftmem import Memory, UnverifiedBlock
from graftmem.core.blocks import PROVENANCE_UNVERIFIED
from graftmem.server import AUTO_KIND, RECEIPT_HEADER, api_server
from graftmem.server.chat import chunk_prompt

from .conftest import long_text

SYSTEM = "You are the support agent of a shop. The refund code is 4417. " + long_text(60, seed=43)
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the refund code?"}]
PROMPT = "Notes of the support team.\n" + long_text(260, seed=78) + "\nQuestion: what is the code?\nAnswer:"
CONSENT = {"graftmem": {"allow_unverified": True}}
MANUAL = "Refunds: the refund code is 4417; customers get their money back within 14 days."
TASK = "What is the refund code for money back?"


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(c: openai.OpenAI, extra: dict | None = None):
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=CHAT, max_tokens=2,
                                                      temperature=0, extra_body=extra or {})
    return raw.parse(), json.loads(raw.headers[RECEIPT_HEADER])


def _complete(c: openai.OpenAI, extra: dict | None = None):
    r = c.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra or {})
    return r, r.model_extra["graftmem"]


def _wait_autos(store, n_min: int) -> list:
    deadline = time.monotonic() + 120  # the answer is sent before the request stores its prefix
    while len(autos := store.list(kind=AUTO_KIND)) < n_min and time.monotonic() < deadline:
        time.sleep(0.05)
    return autos


def test_unverified_prefix_is_not_grafted_by_the_server_without_consent(tiny_llama, tmp_path):
    """chat, completions, the warm start, the prefix lookup and the engine's kept cells."""
    with Memory(engine=tiny_llama, home=tmp_path / "home") as m:
        store = m.store
        with api_server(store, [tiny_llama], min_prefix_tokens=16, sightings=1) as srv:
            c = _client(srv)
            _chat(c)
            _complete(c)
            assert srv.pipeline.wait_idle()
        autos = _wait_autos(store, 2)
        assert len(autos) >= 2
        for b in autos:  # what an unchecked import of the same blocks would have left
            store.set_provenance(b.id, PROVENANCE_UNVERIFIED)

        with api_server(store, [tiny_llama], min_prefix_tokens=16, sightings=1) as srv:
            assert srv.warm == []  # the warm start grafts nothing unverified
            segs, _ = chunk_prompt(tiny_llama, PROMPT)
            assert srv.cache.lookup(segs) is None  # the index lookup skips it
            assert srv.cache.lookup(segs, allow_unverified=True) is not None  # with consent: found
            c = _client(srv)
            r, rec = _chat(c)
            assert r.usage.prompt_tokens_details.cached_tokens == 0 and rec["block_id"] is None
            r, rec = _complete(c)
            assert r.usage.prompt_tokens_details.cached_tokens == 0 and rec["block_id"] is None
            # consent: grafted, and the receipt says from what
            r, rec = _chat(c, CONSENT)
            assert r.usage.prompt_tokens_details.cached_tokens > 0
            assert rec["block_id"] and rec["provenance"] == PROVENANCE_UNVERIFIED
            # the cells that request left in the engine hold the unverified state: not reused without consent
            r, rec = _chat(c)
            assert r.usage.prompt_tokens_details.cached_tokens == 0 and rec["block_id"] is None
            r, rec = _complete(c, CONSENT)
            assert r.usage.prompt_tokens_details.cached_tokens > 0 and rec["provenance"] == PROVENANCE_UNVERIFIED
            assert srv.pipeline.wait_idle()
        # nothing learned on top of an unverified state (its chain would carry the forged cells)
        assert all(b.provenance == PROVENANCE_UNVERIFIED for b in store.list(kind=AUTO_KIND))

        # the operator's consent at start-up: the warm start grafts it, and the receipt says so
        with api_server(store, [tiny_llama], min_prefix_tokens=16, sightings=1, allow_unverified=True) as srv:
            assert srv.warm and all(w["provenance"] == PROVENANCE_UNVERIFIED for w in srv.warm)
            r, rec = _chat(_client(srv))
            assert r.usage.prompt_tokens_details.cached_tokens > 0 and rec["provenance"] == PROVENANCE_UNVERIFIED


@pytest.fixture
def poisoned(tiny_llama, minilm, tmp_path):
    """A Memory whose routed manual is unverified (its router indexed it before it was marked)."""
    with Memory(engine=tiny_llama, home=tmp_path / "home", embedder=minilm) as m:
        assert m.router is not None  # loaded first, so that learn() indexes the block
        block = m.learn(MANUAL, chat=True, name="refunds", when_to_use="refund codes, money back, returns")
        m.store.set_provenance(block.id, PROVENANCE_UNVERIFIED)
        yield m, block


def test_memory_recall_refuses_before_grafting(poisoned):
    m, block = poisoned
    with pytest.raises(UnverifiedBlock):
        m.recall(TASK, max_tokens=4, min_score=0.1)
    pieces: list[str] = []
    with pytest.raises(UnverifiedBlock):
        with m.recall_stream(TASK, max_tokens=4, min_score=0.1) as s:
            for p in s:
                pieces.append(p)
    assert pieces == []  # nothing streamed before the refusal
    r = m.recall(TASK, max_tokens=4, min_score=0.1, allow_unverified=True)
    assert r.block is not None and r.block.id == block.id and r.receipt.provenance == PROVENANCE_UNVERIFIED
    with m.recall_stream(TASK, max_tokens=4, min_score=0.1, allow_unverified=True) as s:
        assert "".join(s) == s.result.text == r.text and r.text  # a text to compare
    assert s.result.receipt.provenance == PROVENANCE_UNVERIFIED


def test_rest_recall_and_ask_refuse_without_consent(poisoned, tiny_llama):
    m, block = poisoned
    with api_server(m.store, [tiny_llama], learn=False, router=lambda: m.router) as srv:
        for path, body in (("/v1/memory/recall", {"task": TASK, "max_tokens": 2, "min_score": 0.1}),
                           ("/v1/memory/ask", {"id": block.id, "question": TASK, "max_tokens": 2})):
            r = httpx.post(srv.url + path, json=body, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["code"] == "UnverifiedBlock", (path, r.text)
            r = httpx.post(srv.url + path, json={**body, "allow_unverified": True}, timeout=120)
            assert r.status_code == 200, r.text
            receipt = r.json()["receipt"]
            assert receipt["block_id"] == block.id and receipt["provenance"] == PROVENANCE_UNVERIFIED
        # routed recall through the chat route: the same rule
        c = _client(srv)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": TASK}], max_tokens=2,
                                      extra_body={"graftmem": {"recall": True, "min_score": 0.1}})
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": TASK}], max_tokens=2,
                                      extra_body={"graftmem": {"recall": True, "min_score": 0.1,
                                                               "allow_unverified": True}})
        assert r.model_extra["graftmem"]["recall"]["block_id"] == block.id
        assert r.model_extra["graftmem"]["provenance"] == PROVENANCE_UNVERIFIED


DOC = ("The lighthouse keeper's log. " + long_text(40, seed=91) +
       " The spare lamp oil is stored in the blue shed behind the chapel. " + long_text(40, seed=92))
DOC_TASK = "Where is the spare lamp oil stored?"


def test_recall_document_refuses_an_unverified_page_before_grafting(tiny_llama, minilm, tmp_path, monkeypatch):
    """The pager's door: a page imported unchecked may hold another text's state, so it is refused before
    a byte of it reaches llama.cpp (nothing restored, nothing prefilled, nothing decoded); with consent
    it is grafted and the receipt names its provenance."""
    with Memory(engine=tiny_llama, home=tmp_path / "home", embedder=minilm) as m:
        m.learn_document(DOC, document="log", window=256, overlap=32, progress=False)
        pages = {b.id for b in m.get_all(kind="page")}
        assert pages
        for bid in pages:
            m.store.set_provenance(bid, PROVENANCE_UNVERIFIED)
        calls: list[str] = []
        for name in ("session", "restore", "prefill", "logits"):  # every way into llama.cpp's context
            real = getattr(tiny_llama, name)
            monkeypatch.setattr(tiny_llama, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
        with pytest.raises(UnverifiedBlock, match="unverified"):
            m.recall_document(DOC_TASK, document="log", max_tokens=2, min_score=0.0)
        assert calls == []  # refused before the graft: nothing of the page reached the engine
        ans = m.recall_document(DOC_TASK, document="log", max_tokens=2, min_score=0.0, allow_unverified=True)
        assert {"session", "restore", "prefill", "logits"} <= set(calls)
        assert ans.recall.block is not None and ans.recall.block.id in pages
        assert ans.recall.receipt.provenance == PROVENANCE_UNVERIFIED
        # a trusted page: grafted without consent, stamped local
        m.store.set_provenance(ans.recall.block.id, "local")
        again = m.recall_document(DOC_TASK, document="log", max_tokens=2, min_score=0.0)
        assert again.recall.receipt.provenance == "local" and again.text == ans.text and ans.text
