"""A block's identity made and checked in one place (`graftmem.core.identity`, issue 38): every kind of
block a store holds leaves it and arrives elsewhere by every way out and in, grafts exactly on arrival,
and a forged or relabelled one is still refused.

The source store is what a user has after `graftmem serve`: blocks the operator learned with the SDK (a
manual, a chat turn, a child chained on it, one whose prefill ends with a one-token call, the page of a
document), then a served tenant's automatic prefixes (a root and a chained child), two stored Responses
turns (the second continues the first) and a tenant's `POST /v1/memory/learn`. Before issue 38 the
export of such a store stopped at the first salted block ("not the content address ... forged or
damaged", exit 2) while `graftmem verify` said OK, and a stored response could not be re-derived (its
answer's cells were computed one token at a time).

Plumbing that holds on any model: the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`,
a real llama.cpp engine with a real tokenizer and chat template); "exact" is graft == fresh prefill by
SHA-256 of the first-step logits (`Memory.verify`), and the arrival's graft equals the source's fresh.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from graftmem import BlockCorrupted, FleetStore, Memory
from graftmem.core.format import HEADER, parse_header, parse_manifest, write_block
from graftmem.core.identity import SALTS_KEY, block_id_for, content_id, id_problem, salts_of
from graftmem.server import api_server
from graftmem.server.tenants import ApiKeys, hash_key
from graftmem.share.manifest import MANIFEST_NAME
from graftmem.store.local import Store
from graftmem.testing import HashEmbedder

from .conftest import long_text
from .seaweed import bucket_url, seaweed  # noqa: F401 (fixtures)
from .tiny import tiny_path

ALICE = "sk-alice-identity-key"
PUSH = "push-token-identity"
TINY_CLI = ["--model", str(tiny_path("llama31")), "--config", '{"probe": false, "n_threads": 1}']
#: every kind of block the source store must hold (the matrix's rows)
KINDS = ("learned", "chat", "child", "one_token", "page", "auto", "auto_child", "response", "response_child",
         "tenant_learned")


# ----------------------------------------------------------------------------------------- helpers
def one_token_text(engine) -> str:
    """A text whose prefill ends with a one-token call (n_tokens % n_batch == 1): its block's id is salted
    with the thread count."""
    words = long_text(700, seed=25).split()
    nb = engine.config.n_batch
    for k in range(nb // 2, len(words)):
        for tail in ("", " so", " so on"):
            text = " ".join(words[:k]) + tail
            if len(engine.tokenize(text, add_special=True)) % nb == 1:
                return text
    raise AssertionError("no text of n_batch + 1 tokens found")


def kinds_of(store: Store, learned: dict[str, str]) -> dict[str, str]:
    """One block of each matrix row (the served ones found by what they record; a chain of automatic
    blocks may have several children)."""
    out = dict(learned)
    for b in store.list():
        m = b.metadata
        if b.kind == "page":
            out["page"] = b.id
        elif b.kind == "auto" and "response" in m:
            out["response_child" if m["response"].get("previous_response_id") else "response"] = b.id
        elif b.kind == "auto":
            out["auto_child" if b.parent else "auto"] = b.id
        elif m.get("tenant") == "alice":
            out["tenant_learned"] = b.id
    assert set(out) == set(KINDS), sorted(out)
    return out


def exact_on_arrival(mem: Memory, source: dict, ids=None) -> None:
    """Every block grafts exactly in ``mem`` (graft == fresh, by logits SHA-256) and its graft equals the
    fresh prefill computed in the source store on the same queries."""
    for bid in source["all"]:
        if ids is not None and bid not in ids:
            continue
        rep = mem.verify(bid, samples=2, cross_process=False, record=False)
        assert rep.ok, (mem.get(bid).name, rep)
        assert [r.graft_sha256 for r in rep.rows] == source["fresh"][bid], mem.get(bid).name


def assert_salted(source: dict) -> None:
    """The blocks that carry salts record them (the rows before issue 38 refused on their way out)."""
    store = Store(source["home"])
    try:
        got = {row: store.get(bid).metadata.get(SALTS_KEY) for row, bid in source["ids"].items()}
    finally:
        store.close()
    assert got["tenant_learned"] == ["tenant"] and got["auto"] == ["tenant"]
    assert got["response"] == ["tenant", "response", "one_token_threads"]
    assert got["one_token"] == ["one_token_threads"] and got["learned"] is None


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def source(tiny_llama, tmp_path_factory):
    """The served source store (see the module doc), its server still answering (for pulls)."""
    root = tmp_path_factory.mktemp("identity")
    home = root / "home"
    with Memory(engine=tiny_llama, home=home, embedder=HashEmbedder()) as m:
        learned = m.learn(long_text(60, seed=21), name="learned")
        ids = {"learned": learned.id,
               "chat": m.learn("Always answer in one short sentence.", chat=True, name="chat").id,
               "child": m.learn(" A note chained after the manual.", parent=learned.id, name="child").id,
               "one_token": m.learn(one_token_text(tiny_llama), name="one-token").id}
        m.learn_document(long_text(200, seed=22), name="doc", progress=False)
    keys = root / "keys"
    keys.write_text(f"alice {hash_key(ALICE)}\n")
    with api_server(Store(home), [tiny_llama], api_key=ApiKeys.load(keys), min_prefix_tokens=16) as srv:
        h = {"Authorization": f"Bearer {ALICE}"}
        msgs = [{"role": "system", "content": long_text(60, seed=23)}]
        for q in ("What is one?", "What is two?", "What is three?"):  # a growing conversation: a chain
            msgs.append({"role": "user", "content": q})
            r = httpx.post(srv.url + "/v1/chat/completions", headers=h, timeout=120,
                           json={"model": "m", "messages": msgs, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
        prev = None
        for text in ("Hello there.", "And again?"):
            r = httpx.post(srv.url + "/v1/responses", headers=h, timeout=120, json={
                "model": "m", "input": text, "max_output_tokens": 4, "temperature": 0,
                **({"previous_response_id": prev} if prev else {})})
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
        r = httpx.post(srv.url + "/v1/memory/learn", headers=h, timeout=120, json={"text": long_text(40, seed=24)})
        assert r.status_code == 200, r.text
        assert srv.pipeline.wait_idle() and srv.cache.flush(60)
        st = Store(home)
        ids = kinds_of(st, ids)
        every = sorted(b.id for b in st.list())
        st.close()
        with Memory(engine=tiny_llama, home=home) as m:
            fresh = {bid: [r.fresh_sha256 for r in m.verify(bid, samples=2, cross_process=False, record=False).rows]
                     for bid in every}
        yield {"home": home, "srv": srv, "ids": ids, "all": every, "fresh": fresh, "root": root}


@pytest.fixture(scope="module")
def bundle(source) -> Path:
    """The whole source store exported with the CLI, as a user would (before issue 38: exit 2)."""
    from graftmem.cli import main

    path = source["root"] / "all.gmbundle"
    assert main(["--home", str(source["home"]), *TINY_CLI, "export", str(path)]) == 0
    return path


# ------------------------------------------------------------------------------------- the ways
def test_a_served_store_exports_and_imports_re_derived_and_every_block_grafts_exactly(source, bundle, tiny_llama,
                                                                                      tmp_path):
    """The held-out check of issue 38: chat prefixes, stored responses and a tenant's learn export, and
    import with the default re-derivation into another home: every block, all exact."""
    assert_salted(source)
    with Memory(engine=tiny_llama, home=tmp_path / "b") as b:
        rep = b.import_bundle(bundle)
        assert sorted(rep.added) == source["all"]
        assert {x.provenance for x in b.get_all()} == {"rederived"}
        exact_on_arrival(b, source)
        # the tenant's blocks stay the tenant's where they land: the owner is part of their id
        assert b.get(source["ids"]["tenant_learned"]).metadata["tenant"] == "alice"


def test_imported_unchecked_then_verify_rederive_proves_every_block(source, bundle, tiny_llama, tmp_path):
    from graftmem.cli import main

    home = tmp_path / "b"
    with Memory(engine=tiny_llama, home=home) as b:
        assert sorted(b.import_bundle(bundle, rederive=False).added) == source["all"]
        assert {x.provenance for x in b.get_all()} == {"unverified"}
    # the CLI's `verify --rederive` on the salted, one-token, chained response: it replays its calls
    assert main(["--home", str(home), *TINY_CLI, "verify", source["ids"]["response_child"], "--rederive",
                 "--samples", "1"]) == 0
    with Memory(engine=tiny_llama, home=home) as b:
        for bid in source["all"]:
            assert b.rederive(bid).ok, b.get(bid).name
        assert {x.provenance for x in b.get_all()} == {"rederived"}
        exact_on_arrival(b, source)


def test_pulled_from_the_server_with_the_tenant_s_key_every_block_grafts_exactly(source, tiny_llama, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "b") as b:
        rep = b.pull(source["srv"].url, api_key=ALICE)
        assert sorted(rep.added) == source["all"]  # alice's own and the operator's
        assert {x.provenance for x in b.get_all()} == {"rederived"}
        exact_on_arrival(b, source)


def test_pushed_to_a_server_every_block_lands_re_derived_and_grafts_exactly(source, tiny_llama, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=PUSH) as srv, \
            Memory(engine=tiny_llama, home=source["home"]) as a:
        rep = a.push(srv.url, token=PUSH)
        assert sorted(rep.added) == source["all"]
        assert {x.provenance for x in hub.get_all()} == {"rederived"}
        exact_on_arrival(hub, source)


def test_a_fleet_worker_lists_exports_and_grafts_the_served_blocks(source, tiny_llama, bucket_url, tmp_path):
    """Uploaded into a bucket: a worker with an empty cache builds its index from the markers (each
    id checked), exports the store as a bundle, and another home imports it re-derived."""
    src = Store(source["home"])
    fleet = FleetStore(bucket_url, cache_dir=tmp_path / "c0", poll_interval=0)
    try:
        assert sorted(fleet.upload_store(src)) == source["all"]
    finally:
        src.close()
        fleet.close()
    with Memory(engine=tiny_llama, store=FleetStore(bucket_url, cache_dir=tmp_path / "c1", poll_interval=0)) as w:
        assert sorted(b.id for b in w.get_all()) == source["all"]
        w.export(tmp_path / "fleet.gmbundle")
    with Memory(engine=tiny_llama, home=tmp_path / "b") as b:
        assert sorted(b.import_bundle(tmp_path / "fleet.gmbundle").added) == source["all"]
        exact_on_arrival(b, source, ids={source["ids"][k] for k in ("response_child", "tenant_learned", "one_token")})


# ------------------------------------------------------------------------------------- forgeries
def _members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]  # type: ignore[union-attr]


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _relabel(data: bytes, change) -> bytes:
    """The block file ``data`` with its manifest changed by ``change(dict)`` and rewritten as an attacker
    would: header, trailer and digests all consistent, the id kept."""
    mlen, soff, slen = parse_header(data[:HEADER.size], where="x", file_size=len(data))
    block = parse_manifest(data[:soff], data[soff + slen:], where="x")
    fields = json.loads(block.model_dump_json())
    change(fields)
    out = io.BytesIO()
    write_block(out, type(block).model_validate(fields), data[soff:soff + slen])
    return out.getvalue()


def _meta(key, value):
    def change(f):
        if value is None:
            f["metadata"].pop(key, None)
        else:
            f["metadata"][key] = value
    return change


def _both(*changes):
    def change(f):
        for c in changes:
            c(f)
    return change


FORGERIES = {
    # row whose block is forged -> (how, what the refusal says)
    "tenant relabelled": ("tenant_learned", _meta("tenant", "bob"), "not the content address"),
    "owner and record dropped (made shared)": ("tenant_learned", _both(_meta("tenant", None), _meta(SALTS_KEY, None)),
                                               "not the content address"),
    "owner dropped, record kept": ("auto", _meta("tenant", None), "does not hold the value"),
    "owner left out of the record": ("tenant_learned", _meta(SALTS_KEY, []), "not salted with it"),
    "record dropped, tenant relabelled": ("auto", _both(_meta(SALTS_KEY, None), _meta("tenant", "bob")),
                                          "not the content address"),
    "response relabelled": ("response", lambda f: f["metadata"]["response"].update(id="resp_someone_else"),
                            "not the content address"),
    "thread count relabelled": ("one_token", lambda f: f["metadata"]["one_token_calls"].update(threads=2),
                                "not the content address"),
    "tokens changed": ("auto", lambda f: f["tokens"].__setitem__(-1, f["tokens"][-1] ^ 1), "not the content address"),
    "parent changed": ("auto_child", None, "not the content address"),
    "a salt this graftmem does not know": ("tenant_learned", _meta(SALTS_KEY, ["tenant", "region"]),
                                           "does not know"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_or_relabelled_block_is_refused(source, bundle, tiny_llama, tmp_path, forgery):
    row, change, says = FORGERIES[forgery]
    bid = source["ids"][row]
    members = _members(bundle)
    man = json.loads(dict(members)[MANIFEST_NAME])
    entry = next(e for e in man["blocks"] if e["id"] == bid)
    if change is None:  # another parent: another block of the store, one that precedes it in the bundle
        other = source["ids"]["learned"]

        def change(f):
            f["parent"] = other
        entry["parent"] = other
    out = []
    for name, data in members:
        if name == f"blocks/{bid}.gmb":
            data = _relabel(data, change)
            entry["file_size"], entry["manifest_digest"] = len(data), "blake3:" + data[-32:].hex()
        out.append((name, data))
    out = [(n, json.dumps(man).encode() if n == MANIFEST_NAME else d) for n, d in out]
    path = tmp_path / "forged.gmbundle"
    path.write_bytes(_tar(out))
    with Memory(engine=tiny_llama, home=tmp_path / "b") as b:
        with pytest.raises(BlockCorrupted, match=says):
            b.import_bundle(path, rederive=False)  # refused by its id alone, before any prefill
        assert b.get_all() == []


# ------------------------------------------------------------------------------------- the ids
def _old_id(fp, tokens, parent, tenant=None, response=None, threads=None) -> str:
    """The ids as the four makers computed them before `graftmem.core.identity` (a copy, to pin them)."""
    if tenant is not None:
        parent = f"{parent or ''}|tenant:{hashlib.sha256(tenant.encode('utf-8')).hexdigest()}"
    if response is not None:
        parent = f"{parent or ''}|response:{response}"
    if threads is not None:
        parent = f"{parent or ''}|one-token-threads={threads}"
    h = hashlib.sha256()
    h.update(fp.digest().encode())
    h.update(b"\0" + (parent or "").encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def test_ids_are_made_as_before_and_blocks_without_the_salt_record_still_check(source):
    store = Store(source["home"])
    try:
        blocks = [store.get(bid) for bid in source["all"]]
    finally:
        store.close()
    for b in blocks:
        s = salts_of(b)
        assert b.id == content_id(b) == _old_id(b.fingerprint, b.tokens, b.parent, s.tenant, s.response,
                                                s.one_token_threads), b.name
        # a block written before the record (graftmem 0.2.0): checked from the fields it holds
        legacy = b.model_copy(update={"metadata": {k: v for k, v in b.metadata.items() if k != SALTS_KEY}})
        assert id_problem(legacy) is None, b.name
    # pages never salted their thread count: an old page with one-token calls still checks, a new one
    # records that it has no salt, and one that claims the salt is refused
    page = next(b for b in blocks if b.kind == "page")
    calls = {"one_token_calls": {"threads": 1, "from": 0}}
    assert id_problem(page.model_copy(update={"metadata": {**page.metadata, **calls}})) is None
    assert id_problem(page.model_copy(update={"metadata": {**page.metadata, **calls, SALTS_KEY: []}})) is None
    assert "not the content address" in id_problem(page.model_copy(update={"metadata": {
        **page.metadata, **calls, SALTS_KEY: ["one_token_threads"]}}))
    assert block_id_for(page.fingerprint, page.tokens) == page.id


def test_an_owner_named_through_the_sdk_is_in_the_id_and_salts_are_graftmem_s_to_write(source, tiny_mem):
    """The operator naming a tenant in ``metadata`` makes that tenant's block, salted like the server's (an
    owner outside the id would be refused on the way out); the salt record is never the caller's to set,
    on the SDK or on REST, and a manifest rewrite cannot change a block's salts."""
    from graftmem import ConfigError

    text = long_text(30, seed=26)
    b = tiny_mem.learn(text, metadata={"tenant": "carol"})
    assert b.metadata[SALTS_KEY] == ["tenant"] and b.id != tiny_mem.learn(text).id
    assert b.id == _old_id(b.fingerprint, b.tokens, None, "carol") and id_problem(b) is None
    with pytest.raises(ConfigError, match="reserved"):
        tiny_mem.learn("Anything.", metadata={SALTS_KEY: []})
    with pytest.raises(ConfigError, match="salts"):
        tiny_mem.store.set_manifest(b.model_copy(update={"metadata": {**b.metadata, "tenant": "dave"}}))
    r = httpx.post(source["srv"].url + "/v1/memory/learn", headers={"Authorization": f"Bearer {ALICE}"},
                   timeout=60, json={"text": "Mine.", "metadata": {SALTS_KEY: ["tenant"]}})
    assert r.status_code == 400 and SALTS_KEY in r.text


def test_a_file_with_a_forged_id_dropped_into_a_store_is_set_aside(source, bundle, tmp_path):
    bid = source["ids"]["tenant_learned"]
    data = _relabel(dict(_members(bundle))[f"blocks/{bid}.gmb"], _meta("tenant", "bob"))
    store = Store(tmp_path / "s")
    try:
        path = store.path_of(bid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        assert store.reconcile()["set_aside"] == 1 and not store.contains(bid)
    finally:
        store.close()
