"""Tenants isolated by key (issue 24): tenant B never gets ``cached_tokens > 0`` or a receipt for a prefix
only tenant A sent, never reads, lists or deletes A's automatic blocks, cannot evict them; the tenant
comes from the key (hashed at rest), never from the request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from graftmem.server import AUTO_KIND, RECEIPT_HEADER, ApiKeys, api_server, hash_key
from graftmem.store.local import Store

from .conftest import long_text

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
SECRET = [{"role": "system", "content": "You are Alice's assistant. Her door code is 7311. " + long_text(50, seed=3)},
          {"role": "user", "content": "What is the code?"}]


@pytest.fixture
def key_file(tmp_path):
    p = tmp_path / "keys.txt"
    p.write_text("# tenants\n" + "".join(f"{n} {hash_key(k)}\n" for n, k in KEYS.items()))
    return p


def _chat(url: str, key: str, messages=SECRET, **extra):
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    raw = c.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=1, temperature=0,
                                                      extra_body=extra or None)
    r = raw.parse()
    return r.usage.prompt_tokens_details.cached_tokens, json.loads(raw.headers[RECEIPT_HEADER])


def _other(i: int):
    return [{"role": "system", "content": f"Bob's notes number {i}. " + long_text(60, seed=100 + i)},
            {"role": "user", "content": "Hi"}]


def test_the_key_file_is_hashed_and_checked(key_file, tmp_path):
    keys = ApiKeys.load(key_file)
    assert keys.tenant(KEYS["alice"]) == (True, "alice") and keys.tenant(KEYS["bob"]) == (True, "bob")
    assert keys.tenant("alice-key-012345678") == (False, None) and keys.tenant("") == (False, None)
    assert KEYS["alice"] not in key_file.read_text()  # hashed at rest
    bad = tmp_path / "bad.txt"
    for text in ("alice alice-key-0123456789\n", f"alice {hash_key('x')}\nalice {hash_key('y')}\n", "# none\n"):
        bad.write_text(text)
        with pytest.raises(Exception, match="expected|twice|no key"):
            ApiKeys.load(bad)


def test_tenant_b_never_reaches_tenant_a_s_prefixes_or_blocks(smol, key_file, tmp_path):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], api_key=ApiKeys.load(key_file), min_prefix_tokens=16, sightings=1) as srv:
            url = srv.url
            assert httpx.get(url + "/v1/models").status_code == 401
            assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
            assert _chat(url, KEYS["alice"])[0] == 0
            assert srv.openai.wait_idle()
            n_a, rec_a = _chat(url, KEYS["alice"])  # A's own prefix, learned by its first request
            assert n_a > 0 and rec_a["source"] in ("ram", "store")
            assert srv.openai.wait_idle()
            mine = {b.id for b in store.list(kind=AUTO_KIND)}
            size = max(b.state_size for b in store.list(kind=AUTO_KIND))
            srv.cache.max_auto_bytes = 2 * 3 * size  # two tenants: room for about 3 prefixes each
            assert mine and all(b.metadata.get("tenant") == "alice" for b in store.list(kind=AUTO_KIND))
            # B sends A's prompt right after A (A's cells are still in the engine): cold, no receipt of A's
            n_b, rec_b = _chat(url, KEYS["bob"])
            assert n_b == 0 and rec_b["block_id"] is None and rec_b["source"] is None
            assert srv.openai.wait_idle()
            bobs = {b.id for b in store.list(kind=AUTO_KIND)} - mine
            assert bobs and not bobs & mine  # B learned its own copy, under other ids
            hb = {"Authorization": f"Bearer {KEYS['bob']}"}
            listed = {e["id"] for e in httpx.get(url + "/v1/blocks", headers=hb).json()["blocks"]}
            assert not listed & mine and bobs <= listed
            rest = {b["id"] for b in httpx.get(url + "/v1/memory/blocks", headers=hb).json()["blocks"]}
            assert not rest & mine
            a_id = sorted(mine)[0]
            for method, path in (("GET", f"/v1/blocks/{a_id}"), ("GET", f"/v1/blocks/{a_id}/manifest"),
                                 ("GET", f"/v1/memory/blocks/{a_id}"), ("GET", f"/v1/memory/blocks/{a_id[:8]}"),
                                 ("DELETE", f"/v1/memory/blocks/{a_id}")):
                r = httpx.request(method, url + path, headers=hb)
                assert r.status_code == 404, (method, path, r.status_code, r.text)
            r = httpx.post(url + "/v1/memory/ask", headers=hb, json={"id": a_id, "question": "code?", "max_tokens": 1})
            assert r.status_code == 404
            # B fills its share: only B's blocks are evicted
            for i in range(6):
                _chat(url, KEYS["bob"], _other(i))
                assert srv.openai.wait_idle()
            left = {b.id for b in store.list(kind=AUTO_KIND)}
            assert mine <= left, "B evicted A's blocks"
            assert len(left - mine) < 6  # B's own were evicted to stay in its share
            ha = {"Authorization": f"Bearer {KEYS['alice']}"}
            assert a_id in {e["id"] for e in httpx.get(url + "/v1/blocks", headers=ha).json()["blocks"]}
            n, rec = _chat(url, KEYS["alice"])  # A still gets its own prefix, from the store
            assert n > 0 and rec["source"] == "store" and rec["block_id"] in mine
    finally:
        store.close()
