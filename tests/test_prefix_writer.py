"""The prompt cache's writer (`PrefixCache.store_later`) cuts, hashes and writes learned prefixes on its
own thread; it starts none of that while a request computes on an engine (`PrefixCache.computing`),
unless a request is waiting for room in its queue. On the tiny Llama 3.1: the states are real llama.cpp
captures, the store a real one; what is tested is the writer's scheduling."""

from __future__ import annotations

import threading

import pytest

from graftmem.server.prefix import MAX_PENDING_STORES, PrefixCache
from graftmem.store import Store


def _states(engine, n: int) -> list[tuple[list[list[int]], list[str], bytes]]:
    """``n`` one-segment prompts and the state after each (a real prefill and capture)."""
    out = []
    for i in range(n):
        text = f"Prompt {i}: the refund desk checks the order number, the date and the receipt."
        seg = engine.tokenize(text)
        engine.reset()
        engine.prefill(seg)
        out.append(([seg], [text], bytes(engine.capture())))
    engine.reset()
    return out


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "home")
    yield s
    s.close()


def test_the_writer_waits_while_a_request_computes_and_stores_after(tiny_llama, store):
    cache = PrefixCache(store, tiny_llama.fingerprint, min_tokens=1)
    cache.writer_max_wait = 120.0  # only the end of the computation may release it here
    (segs, texts, state), = _states(tiny_llama, 1)
    with cache.computing():
        cache.store_later(tiny_llama, segs, texts, 0, [state], None)
        # the write is held while the request computes (it would take milliseconds otherwise)
        assert cache.flush(timeout=2.0) is False
        assert len(store.list()) == 0 and cache.lookup(segs + [[1]]) is None
    assert cache.flush(timeout=120) is True
    assert cache.deferred_writes == 1
    (block,) = store.list()
    match = cache.lookup(segs + [[1]])
    assert block.tokens == segs[0] and match is not None and match.block.id == block.id


def test_a_request_waiting_for_room_in_the_queue_releases_the_writer(tiny_llama, store):
    cache = PrefixCache(store, tiny_llama.fingerprint, min_tokens=1)
    cache.writer_max_wait = 120.0
    prompts = _states(tiny_llama, MAX_PENDING_STORES + 2)
    with cache.computing():  # never released while the stores are handed over
        done = threading.Event()

        def hand_over() -> None:
            for segs, texts, state in prompts:
                cache.store_later(tiny_llama, segs, texts, 0, [state], None)
            done.set()

        t = threading.Thread(target=hand_over, daemon=True)
        t.start()
        # more prompts than the queue holds: the producer blocks on the full queue, which lets the
        # writer go on although a request is still computing (no deadlock, no 120 s wait)
        assert done.wait(timeout=60), "store_later stayed blocked on the full queue"
        t.join(timeout=60)
        # the producer got room when the writer took the next prompt, after storing the one before
        stored_while_computing = len(store.list())
    assert stored_while_computing >= 1
    assert cache.flush(timeout=120) is True
    assert sorted(b.tokens for b in store.list()) == sorted(p[0][0] for p in prompts)
