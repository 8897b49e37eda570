"""Every malformed field of the red-team list (issue 24) is a 4xx in the route's error shape, never a 500:
the HTTP routes run the SDK's own argument checks (`graftmem.memory.validate`) before any work.

All of it is plumbing (argument checks, the store's writes), which holds on any model: the engine is the tiny
random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: real tokenizer and chat template), ~1/100th of
SmolLM2's prefill; its blocks are ~45x smaller, so the full-disk sweep below takes fewer steps."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from graftmem import Memory
from graftmem.core.identity import block_id_for
from graftmem.server import api_server

SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def srv(tiny_llama, minilm, tmp_path_factory):
    home = tmp_path_factory.mktemp("malformed")
    with Memory(engine=tiny_llama, home=home / "store", embedder=minilm) as m:
        block = m.learn("Refunds: the refund code is 4417.", chat=True, name="refunds",
                        when_to_use="refund codes")
        with api_server(m.store, [tiny_llama], learn=False, router=lambda: m.router) as s:
            s.block = block  # type: ignore[attr-defined]
            yield s


def _post(srv, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: lone surrogates pass
    return httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=120)


CHAT = {"model": "m", "max_tokens": 1}
CASES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"hi {SURROGATE}"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": SURROGATE},
                                                    {"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": [1]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "stream_options": "yes"}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}],
                              "graftmem": {"allow_unverified": "yes"}}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}),
    ("/v1/completions", {**CHAT, "prompt": f"hi {SURROGATE}"}),
    ("/v1/memory/learn", {"text": f"a {SURROGATE}"}),
    ("/v1/memory/learn", {"text": "a manual", "name": 5}),
    ("/v1/memory/learn", {"text": "a manual", "kind": ""}),
    ("/v1/memory/learn", {"text": "a manual", "chat": "yes"}),
    ("/v1/memory/learn", {"text": "a manual", "metadata": [1]}),
    ("/v1/memory/learn", {"name": "no text"}),
    ("/v1/memory/search", {"query": SURROGATE}),
    ("/v1/memory/search", {"query": "refund", "top_k": True}),
    ("/v1/memory/recall", {"task": f"refund {SURROGATE}"}),
    ("/v1/memory/recall", {"task": "refund", "min_score": float("nan")}),
    ("/v1/memory/recall", {"task": "refund", "min_score": "high"}),
    ("/v1/memory/recall", {"task": "refund", "max_tokens": 10 ** 9}),
    ("/v1/memory/ask", {"id": "ffff", "question": SURROGATE}),
    ("/v1/memory/ask", {"question": "what?"}),
    ("/v1/memory/ask", {"id": "ffff", "question": "what?", "raw": "no"}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _) in enumerate(CASES)])
def test_malformed_field_is_a_400_in_the_routes_shape(srv, path, body):
    r = _post(srv, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err, dict) and err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/memory/learn",
                                  "/v1/memory/recall"])
def test_deeply_nested_json_is_a_400(srv, path):
    raw = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_leftover_temp_file_does_not_fail_the_next_learn(tiny_llama, tmp_path):
    """A write that failed once left its temp file; its name (pid, thread) comes back with the next
    writer on a reused thread, which failed with "File exists" (a 500 through the server)."""
    text = "A manual that is learned again after a failed write."
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        tokens = tiny_llama.tokenize(text)
        bid = block_id_for(m.fingerprint, tokens)
        path = m.store.path_of(bid)
        path.parent.mkdir(parents=True, exist_ok=True)
        left = path.parent / f".{bid}.{os.getpid()}.{threading.get_ident()}.tmp"
        left.write_bytes(b"half a block")
        block = m.learn(text)
        assert block.id == bid and m.get(bid).provenance == "local" and not left.exists()


def test_a_full_disk_at_the_scope_write_leaves_no_block(tiny_llama, tmp_path):
    """learn with a scope is all or nothing: the free space is swept across the block write and the scope
    index's writes; every attempt either stores the block with its scope or raises StoreError and leaves
    no block (it used to raise StoreError "cannot rollback" with the block stored, 2 of 25 levels)."""
    from graftmem import StoreError
    from graftmem.store.local import Store

    from .conftest import long_text
    from .test_trust_store import _fill, tmpfs

    text = long_text(12, seed=27)
    with Memory(engine=tiny_llama, home=tmp_path / "src") as src:
        size = src.learn(text).state_size + 8192
    mnt = tmp_path / "full"
    outcomes = {"stored": 0, "refused": 0}
    with tmpfs(mnt, "16m"):
        home = mnt / "home"
        Store(home).close()
        # what one learn with a scope takes at its peak here (the block, SQLite's journals of the index
        # and the scope index): the sweep goes from well below it to above it, so both outcomes occur
        free = lambda: os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize  # noqa: E731
        with Memory(engine=tiny_llama, home=home) as m:
            before = free()
            m.learn(text, user_id="u1")
            need = before - free()
            m.reset()
        for leave in range(max(0, min(size, need) - 4096), max(size, need) + 64 * 1024, 4096):
            filler = _fill(mnt, leave)
            try:
                with Memory(engine=tiny_llama, home=home) as m:
                    try:
                        b = m.learn(text, user_id="u1")
                    except StoreError:
                        outcomes["refused"] += 1
                    else:
                        outcomes["stored"] += 1
                        assert [x.id for x in m.get_all(user_id="u1")] == [b.id]
            finally:
                filler.unlink()
            with Memory(engine=tiny_llama, home=home) as m:
                owned = {x.id for x in m.get_all(user_id="u1")}
                assert {x.id for x in m.get_all()} == owned, f"a block stored without its scope at {leave}"
                m.reset()
    assert outcomes["stored"] and outcomes["refused"], outcomes
