"""Tenants isolated by key (issue 24): tenant B never gets ``cached_tokens > 0`` or a receipt for a prefix
only tenant A sent, never reads, lists or deletes A's automatic blocks, cannot evict them; the tenant
comes from the key (hashed at rest), never from the request. A block A learns is A's (B never lists,
reads, searches, recalls, routes to or deletes it) unless A shares it; the operator's blocks are shared;
REST scopes (``user_id`` ...) narrow what a tenant sees, inside that tenant only.

All of it is the server's plumbing (keys, stores, receipts, routes, eviction shares), which holds on any
model: the engine is the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: real tokenizer and
chat template), ~1/100th of SmolLM2's prefill; routing is MiniLM's, whatever the model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from graftmem import ConfigError, Memory
from graftmem.cli import main
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


def test_two_tenants_with_one_key_are_refused_at_start(tmp_path, capsys):
    """Two tenants with the same key hash used to start silently: every request with the key was the
    second tenant's, and the first could never log in. Refused at start, naming both tenants, not the key."""
    same = hash_key("one-key-for-two-tenants")
    bad = tmp_path / "keys.txt"
    bad.write_text(f"alice {hash_key(KEYS['alice'])}\ncarol {same}\nbob {same}\n")
    with pytest.raises(ConfigError, match="'carol' and 'bob' have the same API key") as err:
        ApiKeys.load(bad)
    assert same[7:] not in str(err.value) and "one-key" not in str(err.value)
    with pytest.raises(ConfigError, match="'carol' and 'bob'"):  # built in code, not from a file
        ApiKeys((("carol", bytes.fromhex(same[7:])), ("bob", bytes.fromhex(same[7:]))))
    assert main(["serve", "--blocks-only", "--home", str(tmp_path / "home"), "--api-key-file", str(bad)]) == 2
    out = capsys.readouterr()
    assert "'carol' and 'bob' have the same API key" in out.err and same[7:] not in out.err + out.out


def test_tenant_b_never_reaches_tenant_a_s_prefixes_or_blocks(tiny_llama, key_file, tmp_path):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny_llama], api_key=ApiKeys.load(key_file), min_prefix_tokens=16, sightings=1) as srv:
            url = srv.url
            assert httpx.get(url + "/v1/models").status_code == 401
            assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
            assert _chat(url, KEYS["alice"])[0] == 0
            assert srv.pipeline.wait_idle()
            n_a, rec_a = _chat(url, KEYS["alice"])  # A's own prefix, learned by its first request
            assert n_a > 0 and rec_a["source"] in ("ram", "store")
            assert srv.pipeline.wait_idle()
            mine = {b.id for b in store.list(kind=AUTO_KIND)}
            size = max(b.state_size for b in store.list(kind=AUTO_KIND))
            srv.cache.max_auto_bytes = 2 * 3 * size  # two tenants: room for about 3 prefixes each
            assert mine and all(b.metadata.get("tenant") == "alice" for b in store.list(kind=AUTO_KIND))
            # B sends A's prompt right after A (A's cells are still in the engine): cold, no receipt of A's
            n_b, rec_b = _chat(url, KEYS["bob"])
            assert n_b == 0 and rec_b["block_id"] is None and rec_b["source"] is None
            assert srv.pipeline.wait_idle()
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
                assert srv.pipeline.wait_idle()
            left = {b.id for b in store.list(kind=AUTO_KIND)}
            assert mine <= left, "B evicted A's blocks"
            assert len(left - mine) < 6  # B's own were evicted to stay in its share
            ha = {"Authorization": f"Bearer {KEYS['alice']}"}
            assert a_id in {e["id"] for e in httpx.get(url + "/v1/blocks", headers=ha).json()["blocks"]}
            n, rec = _chat(url, KEYS["alice"])  # A still gets its own prefix, from the store
            assert n > 0 and rec["source"] == "store" and rec["block_id"] in mine
    finally:
        store.close()


def _tokens_seen(text: str) -> dict[str, float]:
    """The token counters of a /metrics answer (not the request counts: reading /metrics is a request)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("graftmem_prompt_tokens", "graftmem_cached_tokens", "graftmem_created_tokens",
                            "graftmem_generated_tokens", "graftmem_auto_block_bytes")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _same_but_id(a: httpx.Response, b: httpx.Response, ida: str, idb: str) -> None:
    """Status and body byte-identical once each block's id (whole, 12- and 8-character forms) is masked."""
    def mask(r: httpx.Response, bid: str) -> bytes:
        body = r.content
        for form in (bid, bid[:12], bid[:8]):
            body = body.replace(form.encode(), b"<id>")
        return body
    assert (a.status_code, mask(a, ida)) == (b.status_code, mask(b, idb)), (a.text, b.text)


def test_a_block_another_tenant_shared_is_no_oracle_on_a_prompt(tiny_llama, tmp_path):
    """Issue 37: B shares blocks holding guesses of A's system message. A's prompt cache used to graft the
    right guess and hang A's learned chain on it; B then read the hit off the global /metrics (+cached
    tokens on each of A's calls), /v1/info's block count, and the DELETE of its block ("has 1 chained
    child block(s)"). Now A's prompt cache never matches another tenant's shared block, /metrics and
    /v1/info show B only its own, and B's DELETE answers are the same whether A matched or not, and
    whether another tenant chained on its block by naming it or not."""
    keys = tmp_path / "keys.txt"
    three = {**KEYS, "carol": "carol-key-5555555555"}
    keys.write_text("".join(f"{n} {hash_key(k)}\n" for n, k in three.items()))
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny_llama], api_key=ApiKeys.load(keys), min_prefix_tokens=16, sightings=1) as srv:
            url = srv.url
            hb = {"Authorization": f"Bearer {KEYS['bob']}"}
            hc = {"Authorization": f"Bearer {three['carol']}"}
            # the text of A's first segment (its system turn as the server cuts it): what B would guess
            _chat(url, three["carol"])
            assert srv.pipeline.wait_idle() and srv.cache.flush(60)
            root = next(b for b in store.list(kind=AUTO_KIND) if b.parent is None and b.metadata["tenant"] == "carol")
            guesses = {}
            for name, text in (("right", root.text), ("wrong", root.text.replace("7311", "7312")),
                               ("hooked", root.text.replace("7311", "1234"))):
                r = httpx.post(url + "/v1/memory/learn", headers=hb, timeout=120,
                               json={"text": text, "name": name, "shared": True})
                assert r.status_code == 200, r.text
                guesses[name] = r.json()["block"]["id"]
            assert store.get(guesses["right"]).tokens == root.tokens  # the guess is exactly A's first segment
            # C names B's "hooked" block as the parent of its own (an explicit choice, which A never made)
            r = httpx.post(url + "/v1/memory/learn", headers=hc, timeout=120,
                           json={"text": " Carol's note.", "parent": guesses["hooked"]})
            assert r.status_code == 200 and r.json()["block"]["parent"] == guesses["hooked"]
            carols = r.json()["block"]["id"]

            def bobs_view():
                return (_tokens_seen(httpx.get(url + "/metrics", headers=hb).text),
                        httpx.get(url + "/v1/info", headers=hb).json(),
                        httpx.get(url + "/v1/blocks", headers=hb).json()["blocks"],
                        httpx.get(url + "/v1/memory/blocks", headers=hb).json()["blocks"])
            before = bobs_view()
            got = []
            for _ in range(2):  # A's first call learns its own prefix, the second grafts it
                got.append(_chat(url, KEYS["alice"]))
                assert srv.pipeline.wait_idle() and srv.cache.flush(60)
            # B's side: nothing it can read moved with A's calls
            assert bobs_view() == before
            answers = {n: httpx.delete(url + f"/v1/memory/blocks/{bid}", headers=hb) for n, bid in guesses.items()}
            assert answers["right"].status_code == 200 and answers["right"].json() == {"deleted": [guesses["right"]]}
            for n in ("wrong", "hooked"):
                _same_but_id(answers["right"], answers[n], guesses["right"], guesses[n])
            # the chain C hung on B's block went with it, unnamed; C's other blocks did not
            assert not store.contains(carols) and store.contains(root.id)
            # A's side: cold first (B's right guess not grafted), then its own prefix, chained on nothing of B's
            (n1, rec1), (n2, rec2) = got
            assert n1 == 0 and rec1["block_id"] is None
            alices = {b.id for b in store.list(kind=AUTO_KIND) if b.metadata.get("tenant") == "alice"}
            assert n2 > 0 and rec2["source"] in ("ram", "store") and rec2["block_id"] in alices | {None}
            assert all(store.get(b).parent is None or store.get(b).parent in alices for b in alices)
            # "not yours" and "not there" answer byte for byte alike (but the id), whole id, prefix, cascade
            ha = sorted(alices)[0]
            missing = "0" * 63 + "1"
            for path in ("/v1/memory/blocks/{}", "/v1/memory/blocks/{}?cascade=true", "/v1/blocks/{}",
                         "/v1/blocks/{}/manifest"):
                for method in ("GET", "DELETE") if path.startswith("/v1/memory") else ("GET",):
                    _same_but_id(httpx.request(method, url + path.format(ha), headers=hb),
                                 httpx.request(method, url + path.format(missing), headers=hb), ha, missing)
            _same_but_id(httpx.delete(url + f"/v1/memory/blocks/{ha[:8]}", headers=hb),
                         httpx.delete(url + f"/v1/memory/blocks/{missing[:8]}", headers=hb), ha, missing)
            assert store.contains(ha)
    finally:
        store.close()


# --------------------------------------------------------------------------- learned blocks and scopes
VAULT = "Alice's team notes: the vault combination is 5521."
SHARED = "Team handbook: the office wifi password is tulip-42."
OPERATOR = "Operator manual: the fire exit is behind the kitchen."
SCOPED = "Carol prefers green tea in the morning."


@pytest.fixture(scope="module")
def tenant_srv(tiny_llama, minilm, tmp_path_factory):
    """One server for the module: two tenants, a router, and one block the operator learned with the SDK
    into the home before serving (shared with every tenant)."""
    home = tmp_path_factory.mktemp("tenants-learned")
    keys = home / "keys.txt"
    keys.write_text("".join(f"{n} {hash_key(k)}\n" for n, k in KEYS.items()))
    with Memory(engine=tiny_llama, home=home / "home", embedder=minilm) as m:
        assert m.router is not None  # loaded first: every learn is routed
        op = m.learn(OPERATOR, name="fire exit", when_to_use="where is the fire exit, evacuation")
        with api_server(m.store, [tiny_llama], api_key=ApiKeys.load(keys), learn=False, router=lambda: m.router) as srv:
            yield srv, m, op


def _h(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def _rest(srv, who: str, method: str, path: str, **kw) -> httpx.Response:
    r = httpx.request(method, srv.url + path, headers=_h(who), timeout=120, **kw)
    assert r.status_code < 500, (method, path, r.status_code, r.text)
    return r


def _learn(srv, who: str, text: str, **fields) -> dict:
    r = _rest(srv, who, "POST", "/v1/memory/learn", json={"text": text, **fields})
    assert r.status_code == 200, r.text
    return r.json()["block"]


def _ids(srv, who: str, **scope) -> set[str]:
    r = _rest(srv, who, "GET", "/v1/memory/blocks", params=scope)
    assert r.status_code == 200, r.text
    return {b["id"] for b in r.json()["blocks"]}


def _search(srv, who: str, query: str, **scope) -> list[str]:
    r = _rest(srv, who, "POST", "/v1/memory/search", json={"query": query, "top_k": 10, **scope})
    assert r.status_code == 200, r.text
    return [h["block_id"] for h in r.json()["hits"]]


def _recalled(srv, who: str, task: str, **scope):
    r = _rest(srv, who, "POST", "/v1/memory/recall",
              json={"task": task, "max_tokens": 1, "min_score": -1.0, **scope})
    assert r.status_code == 200, r.text
    return r.json()["receipt"]["block_id"]


def test_a_learned_block_is_its_tenant_s_unless_shared(tenant_srv):
    srv, m, op = tenant_srv
    vault = _learn(srv, "alice", VAULT, name="vault", when_to_use="vault combination, safe code")
    assert vault["shared"] is False
    a = vault["id"]
    assert a in _ids(srv, "alice") and a not in _ids(srv, "bob")
    assert a in _search(srv, "alice", "What is the vault combination?")
    assert a not in _search(srv, "bob", "What is the vault combination?")
    assert _recalled(srv, "bob", "What is the vault combination?") != a
    for method, path in (("GET", f"/v1/memory/blocks/{a}"), ("GET", f"/v1/memory/blocks/{a[:10]}"),
                         ("DELETE", f"/v1/memory/blocks/{a}"), ("GET", f"/v1/blocks/{a}"),
                         ("GET", f"/v1/blocks/{a}/manifest")):
        assert _rest(srv, "bob", method, path).status_code == 404, (method, path)
    assert _rest(srv, "bob", "POST", "/v1/memory/ask", json={"id": a, "question": "code?", "max_tokens": 1}
                 ).status_code == 404
    assert a not in {e["id"] for e in _rest(srv, "bob", "GET", "/v1/blocks").json()["blocks"]}
    # B chaining on A's block, or claiming a tenant in its metadata: refused
    assert _rest(srv, "bob", "POST", "/v1/memory/learn", json={"text": "More.", "parent": a}).status_code == 404
    r = _rest(srv, "bob", "POST", "/v1/memory/learn", json={"text": "Mine.", "metadata": {"tenant": "alice"}})
    assert r.status_code == 400 and "reserved" in r.text
    # routed recall on the chat route: B is never routed to A's block
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS["bob"], max_retries=0, timeout=120)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is the vault combination?"}],
                                  max_tokens=1, extra_body={"graftmem": {"recall": True, "min_score": -1.0}})
    assert r.model_extra["graftmem"]["recall"]["block_id"] != a
    # B learning the same text gets its own block: no "not new", no shared id (an oracle for A's text)
    mine = _learn(srv, "bob", VAULT)
    assert mine["id"] != a
    assert _rest(srv, "alice", "GET", f"/v1/memory/blocks/{mine['id']}").status_code == 404
    assert _rest(srv, "alice", "GET", f"/v1/memory/blocks/{a}").status_code == 200


def test_an_explicitly_shared_block_and_the_operator_s_are_seen_by_both(tenant_srv):
    srv, m, op = tenant_srv
    shared = _learn(srv, "alice", SHARED, name="wifi", when_to_use="office wifi password", shared=True)
    s = shared["id"]
    assert shared["shared"] is True
    for who in ("alice", "bob"):
        assert {s, op.id} <= _ids(srv, who)
        assert s in _search(srv, who, "What is the office wifi password?")
        assert _rest(srv, who, "GET", f"/v1/memory/blocks/{s}").status_code == 200
        assert op.id in {e["id"] for e in _rest(srv, who, "GET", "/v1/blocks").json()["blocks"]}
    assert _recalled(srv, "bob", "What is the office wifi password?") == s
    # B learning the shared text again (shared) gets it, without relabelling it for everyone
    again = _learn(srv, "bob", SHARED, when_to_use="anything at all", shared=True)
    assert again["id"] == s and again["when_to_use"] == "office wifi password"
    # seen, not B's to delete: only the tenant that shared it (or the operator) deletes it
    for bid in (s, op.id):
        assert _rest(srv, "bob", "DELETE", f"/v1/memory/blocks/{bid}").status_code == 403
    assert _rest(srv, "alice", "DELETE", f"/v1/memory/blocks/{op.id}").status_code == 403
    assert _rest(srv, "alice", "DELETE", f"/v1/memory/blocks/{s}").json()["deleted"] == [s]
    assert m.get(op.id).id == op.id


def test_rest_scopes_are_honoured_within_a_tenant(tenant_srv):
    srv, m, op = tenant_srv
    s = _learn(srv, "alice", SCOPED, user_id="carol", when_to_use="drink preferences, tea or coffee")["id"]
    shared = _learn(srv, "alice", "Dave likes black coffee.", user_id="dave", shared=True)["id"]
    assert s in _ids(srv, "alice", user_id="carol") and s not in _ids(srv, "alice", user_id="erin")
    assert _ids(srv, "alice", user_id="dave") == {shared}
    assert s in _search(srv, "alice", "What tea does Carol drink?", user_id="carol")
    assert s not in _search(srv, "alice", "What tea does Carol drink?", user_id="erin")
    assert _recalled(srv, "alice", "What tea does Carol drink?", user_id="erin") != s
    assert _rest(srv, "alice", "GET", f"/v1/memory/blocks/{s}", params={"user_id": "erin"}).status_code == 404
    assert _rest(srv, "alice", "POST", "/v1/memory/ask", json={"id": s, "question": "tea?", "max_tokens": 1,
                                                               "user_id": "erin"}).status_code == 404
    assert _rest(srv, "alice", "DELETE", f"/v1/memory/blocks/{s}", params={"user_id": "erin"}).status_code == 404
    # scopes live inside a tenant: B's "dave" is not A's, even for a block both see (shared)
    assert shared in _ids(srv, "bob") and _ids(srv, "bob", user_id="dave") == set()
    assert _search(srv, "bob", "What does Dave drink?", user_id="dave") == []
    assert _ids(srv, "bob", user_id="carol") == set()
    for method, path in (("GET", f"/v1/memory/blocks/{s}"), ("DELETE", f"/v1/memory/blocks/{s}")):
        assert _rest(srv, "bob", method, path, params={"user_id": "carol"}).status_code == 404
    assert _rest(srv, "alice", "GET", "/v1/memory/blocks", params={"user_id": ""}).status_code == 400
    assert _rest(srv, "alice", "POST", "/v1/memory/search", json={"query": "tea", "user_id": 5}).status_code == 400
    # A deletes in the scope: the block and its scope rows go
    assert _rest(srv, "alice", "DELETE", f"/v1/memory/blocks/{s}", params={"user_id": "carol"}).json()["deleted"] == [s]
    assert _ids(srv, "alice", user_id="carol") == set()


def test_without_keys_learned_blocks_stay_shared_and_scopes_work(tiny_llama, tmp_path):
    """No key file: one local trust domain, as before tenants (every learn shared, deletable by anyone)."""
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny_llama], learn=False) as srv:
            r = httpx.post(srv.url + "/v1/memory/learn", json={"text": SCOPED, "user_id": "carol"}, timeout=120)
            b = r.json()["block"]
            assert r.status_code == 200 and b["shared"] is True and "tenant" not in store.get(b["id"]).metadata
            listed = lambda **q: {x["id"] for x in httpx.get(srv.url + "/v1/memory/blocks", params=q).json()["blocks"]}  # noqa: E731
            assert b["id"] in listed() and b["id"] in listed(user_id="carol") and b["id"] not in listed(user_id="erin")
            assert httpx.get(srv.url + f"/v1/memory/blocks/{b['id']}").status_code == 200
            assert httpx.delete(srv.url + f"/v1/memory/blocks/{b['id']}").json()["deleted"] == [b["id"]]
    finally:
        store.close()
