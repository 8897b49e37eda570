"""A non-streamed answer is sent before the request stores the prefix it learned: the client's wait does
not include writing blocks (the engine is freed after, so the next request still sees them)."""

from __future__ import annotations

import time

import openai

from graftmem.server import api_server
from graftmem.store.local import Store

from .conftest import long_text


def test_answer_comes_before_the_prefix_is_stored(smol, tmp_path, monkeypatch):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], min_prefix_tokens=16, sightings=1) as srv:
            cache = srv.cache
            real = cache.store_captured
            timeline = []

            def slow_store(*a, **kw):  # the real store, made slow enough to see who waits for it
                time.sleep(2.0)
                timeline.append(("stored", time.monotonic()))
                return real(*a, **kw)

            monkeypatch.setattr(cache, "store_captured", slow_store)
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "system", "content": long_text(40, seed=9)}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Thanks"}]
            c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
            timeline.append(("answered", time.monotonic()))
            second = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
            assert [t[0] for t in timeline][:2] == ["answered", "stored"]
            assert second.usage.prompt_tokens_details.cached_tokens > 16  # it waited for the engine: stored
    finally:
        store.close()


def test_closing_waits_for_what_requests_learn(smol, tmp_path, monkeypatch):
    """Graceful shutdown covers the learning after the answer: a server closed right after answering
    has stored the prefix when close() returns."""
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], min_prefix_tokens=16, sightings=1) as srv:
            real = srv.cache.store_captured

            def slow_store(*a, **kw):
                time.sleep(1.5)
                return real(*a, **kw)

            monkeypatch.setattr(srv.cache, "store_captured", slow_store)
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "system", "content": long_text(40, seed=10)}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Thanks"}]
            c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
            assert store.list(kind="auto") == []  # answered, not stored yet
        assert store.list(kind="auto"), "close() returned before the request stored what it learned"
    finally:
        store.close()
