"""A request's prefix keys are computed once (`Job.keys`, `Job.shared_keys`) and handed to every part of the
prefix cache that needs them: the lookup, the learn decision, the writer's queue and the stored blocks'
index. Before, the same SHA-256 over every token of the prompt ran up to five times per request (the
lookup and the learn decision each hashed the shared keys again, `store_later` and `store_captured` each
hashed the tenant's again), on the event loop's engine thread and the writer's."""

from __future__ import annotations

import sys

import httpx

from graftmem.server import ApiKeys, api_server, generate, hash_key, prefix
from graftmem.store.local import Store

from .conftest import long_text

KEY = "alice-key-0123456789"
PROMPT = [{"role": "system", "content": "You are Alice's assistant. " + long_text(40, seed=3)},
          {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
          {"role": "user", "content": "What is two plus two?"}]


def _from_refresh() -> bool:
    """Whether the hashing was asked by the cache's index rebuild (keys of stored chains, not a request's)."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if f.f_code.co_name == "refresh":
            return True
        f = f.f_back
    return False


def test_a_request_hashes_its_prompt_once_per_key_space(tiny_llama, tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice {hash_key(KEY)}\n")
    calls: list[tuple[object, int]] = []
    real = prefix.key_states

    def spy(segments, tenant=None, **kw):
        if not _from_refresh():
            calls.append((tenant, len(segments)))
        return real(segments, tenant, **kw)

    monkeypatch.setattr(prefix, "key_states", spy)
    monkeypatch.setattr(generate, "key_states", spy)
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny_llama], api_key=ApiKeys.load(keys), min_prefix_tokens=16, sightings=1) as srv:
            for turn in range(2):  # cold (its prefix learned and written), then grafted
                calls.clear()
                r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                               json={"model": "m", "messages": PROMPT, "max_tokens": 1, "temperature": 0}, timeout=120)
                assert r.status_code == 200, r.text[:300]
                assert srv.pipeline.wait_idle()  # the writer has stored what the request learned
                n = {c[1] for c in calls}
                assert len(n) == 1 and n.pop() > 1, calls  # every hashing was of the whole prompt's segments
                assert sorted(calls, key=str) == sorted([("alice", calls[0][1]), (None, calls[0][1])], key=str), \
                    (turn, calls)
            assert store.list(kind="auto")  # the first request did learn (the writer used the request's keys)
    finally:
        store.close()
