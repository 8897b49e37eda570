"""Trust by default: no forged KV state and no spoofed label enters a store unnoticed.

The poisoning suite (docs/security.md has the table): three attacks, each a self-consistent block
(valid header, trailer, state digest and content id, as an attacker would write it), each carried
three ways (bundle import, pull from a server, push to a server):

* **forged state**: id and text of REAL tokens, the state of a DIFFERENT text of the same length;
* **spoofed label**: the refund manual's tokens and state under the text/name "weather report";
* **wrong position**: a root block that claims to start at position 7.

Under the default policy each is refused and the store is left as it was; opting out of the
re-derivation lands a forged state ``unverified``, which is never grafted without consent, never
routed, and replaced by ``learn`` of the real text with this engine's own state.

Every check is of bytes, digests, tokens, signatures or the equality of two real computations, which
hold on any model: the stores are built on the tiny random-weight Llama 3.1 of tests/tiny.py
(`tiny_llama`, a real llama.cpp engine with the real Llama 3 tokenizer), whose prefills (each default
import re-derives) cost ~1/100th of SmolLM2's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graftmem import BlockCorrupted, BundleRejected, Memory, UntrustedBundle, logits_sha256
from graftmem.core.blocks import Block
from graftmem.core.errors import BlockRejected, UnverifiedBlock
from graftmem.core.format import encode_prefix, trailer_digest, write_block
from graftmem.share.trust import SigningKey, TrustPolicy
from graftmem.store import Store

from .conftest import long_text
from .test_bundle import QUERY, forge, read_members, rebuild, state_of

TOKEN = "push-token-for-trust-tests"
REFUND = long_text(60, seed=11)


def rewrite(store: Store, block_id: str, **update) -> None:
    """Rewrite a block's manifest fields in place, self-consistently (same id, same state)."""
    old, view = store.read_state(block_id, lambda n: memoryview(bytearray(n)))
    block = old.model_copy(update=update)
    state = bytes(view)
    store.delete(block_id)
    path = store.path_of(block_id)
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        write_block(f, block, state)
    store.reconcile()


@pytest.fixture(scope="module")
def attacks(tiny_llama, tmp_path_factory):
    """One forger store and one exported bundle per attack; the real texts to compare with."""
    root = tmp_path_factory.mktemp("attacks")
    out: dict = {}
    # forged state: A's id/text/tokens, B's state (B = A with one word changed: same token count)
    with Memory(engine=tiny_llama, home=root / "forged") as f:
        text_a = long_text(40, seed=5)
        text_b = text_a.replace("agent", "robot", 1)
        a, b = f.learn(text_a, name="a"), f.learn(text_b, name="b")
        assert a.n_tokens == b.n_tokens
        _, state_b = f.store.read_state(b.id, lambda n: memoryview(bytearray(n)))
        forge(f.store, a.id, state=bytes(state_b))
        f.delete(b.id)
        f.export(root / "forged.gmbundle")
        out["forged"] = {"home": f.store.home, "bundle": root / "forged.gmbundle", "id": a.id,
                         "text": text_a, "match": "not what its .* tokens produce", "exc": BlockCorrupted}
    # spoofed label: the refund manual's tokens and state, text and name of a weather report
    with Memory(engine=tiny_llama, home=root / "label") as f:
        r = f.learn(REFUND, name="refunds")
        rewrite(f.store, r.id, text="Weather report: sunny all week, light wind from the west.",
                name="weather report", metadata={"when_to_use": "questions about the weather"})
        f.export(root / "label.gmbundle")
        out["label"] = {"home": f.store.home, "bundle": root / "label.gmbundle", "id": r.id,
                        "match": "does not tokenize to its", "exc": BundleRejected}
    # wrong position: a root that claims to start at 7 (the id does not cover pos_start)
    with Memory(engine=tiny_llama, home=root / "pos") as f:
        r = f.learn(long_text(30, seed=12), name="positioned")
        rewrite(f.store, r.id, pos_start=7)
        f.export(root / "pos.gmbundle")
        out["pos"] = {"home": f.store.home, "bundle": root / "pos.gmbundle", "id": r.id,
                      "match": "start at position 7", "exc": BundleRejected}
    yield out


@pytest.fixture
def mem(tiny_llama, tmp_path) -> Memory:
    """The receiving store, on the same tiny engine as the attackers' (conftest's `tiny_mem`, renamed)."""
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        yield m


def carry(how: str, attack: dict, mem: Memory, engine, tmp_path: Path, **kw):
    """Bring the attack's block to ``mem`` by ``how`` (import / pull / push), with the policy ``kw``."""
    if how == "import":
        return mem.import_bundle(attack["bundle"], **kw)
    with Memory(engine=engine, home=attack["home"]) as forger:
        if how == "pull":
            with forger.serve() as srv:
                return mem.pull(srv.url, **kw)
        with mem.serve(push_token=TOKEN, **kw) as srv:
            return forger.push(srv.url, token=TOKEN)


@pytest.mark.parametrize("how", ["import", "pull", "push"])
@pytest.mark.parametrize("attack", ["forged", "label", "pos"])
def test_poisoned_block_is_refused_by_default(attacks, attack, how, mem, tiny_llama, tmp_path):
    a = attacks[attack]
    before = state_of(mem)
    with pytest.raises(a["exc"], match=a["match"]):
        carry(how, a, mem, tiny_llama, tmp_path)
    assert state_of(mem) == before, f"a refused {how} changed the store"
    assert not mem.store.contains(a["id"])


@pytest.mark.parametrize("how", ["import", "pull", "push"])
@pytest.mark.parametrize("attack", ["label", "pos"])
def test_spoofed_labels_are_refused_even_without_rederive(attacks, attack, how, mem, tiny_llama, tmp_path):
    """Binding labels to content costs a tokenization, not a prefill: it is never opted out of."""
    a = attacks[attack]
    with pytest.raises(a["exc"], match=a["match"]):
        carry(how, a, mem, tiny_llama, tmp_path, rederive=False)
    assert mem.get_all() == []


@pytest.mark.parametrize("how", ["import", "pull", "push"])
def test_forged_state_without_rederive_lands_unverified_and_is_never_grafted(attacks, how, mem, tiny_llama,
                                                                             tmp_path):
    a = attacks["forged"]
    rep = carry(how, a, mem, tiny_llama, tmp_path, rederive=False)
    assert rep.added == [a["id"]]
    b = mem.get(a["id"])
    assert b.provenance == "unverified" and not b.trusted and b.labels_trusted is False
    with pytest.raises(UnverifiedBlock, match="allow_unverified"):
        mem.ask(a["id"], QUERY, max_tokens=1)
    assert mem.store.routing_rows(exclude_kinds=("page",)) == []  # never steers routing
    with pytest.raises(UnverifiedBlock):  # nor serves as the parent of a new chain
        mem.learn(" and then", parent=a["id"])
    r = mem.ask(a["id"], QUERY, max_tokens=1, allow_unverified=True)  # consent: grafted, receipt says so
    assert r.receipt.provenance == "unverified"


def _fresh_sha(eng, text: str) -> str:
    with eng.session():
        eng.prefill(eng.tokenize(text))
        eng.prefill(eng.tokenize(QUERY, add_special=False))
        return logits_sha256(eng.logits())


def test_learn_of_the_real_text_after_a_forged_import_yields_the_real_state(attacks, mem, tiny_llama):
    a = attacks["forged"]
    mem.import_bundle(a["bundle"], rederive=False)
    forged_sha = mem.ask(a["id"], QUERY, max_tokens=1, allow_unverified=True).receipt.first_logits_sha256
    fresh = _fresh_sha(tiny_llama, a["text"])
    assert forged_sha != fresh  # the poison is real: it answers from another text's state
    b = mem.learn(a["text"], name="mine")
    assert b.id == a["id"] and b.provenance == "local"  # same content address, own state
    r = mem.ask(a["id"], QUERY, max_tokens=1)
    assert r.receipt.first_logits_sha256 == fresh and r.receipt.provenance == "local"
    assert mem.rederive(a["id"]).ok


def test_rederive_upgrades_an_unverified_block_that_proves_equal(source_bundle, mem):
    mem.import_bundle(source_bundle["bundle"], rederive=False)
    bid = source_bundle["b1"]
    assert mem.get(bid).provenance == "unverified"
    assert mem.rederive(bid).ok
    assert mem.get(bid).provenance == "rederived"
    mem.ask(bid, QUERY, max_tokens=1)  # no consent needed any more
    # importing again with the default policy re-derives the rest; present blocks are not re-fetched
    rep = mem.import_bundle(source_bundle["bundle"])
    assert {mem.get(b).provenance for b in rep.added + rep.present} == {"rederived"}


@pytest.fixture(scope="module")
def source_bundle(tiny_llama, tmp_path_factory):
    """An honest store with a root and a chained child, exported plain and signed."""
    home = tmp_path_factory.mktemp("honest")
    key = SigningKey.generate()
    with Memory(engine=tiny_llama, home=home / "store") as m:
        b1 = m.learn(REFUND, name="refunds", when_to_use="refund questions")
        child = m.learn(" Exchanges follow the same rule.", name="exchanges", parent=b1.id)
        m.export(home / "plain.gmbundle")
        m.export(home / "signed.gmbundle", sign_key=key)
        receipt = m.ask(child.id, QUERY, max_tokens=1).receipt
    yield {"bundle": home / "plain.gmbundle", "signed": home / "signed.gmbundle", "key": key, "b1": b1.id,
           "child": child.id, "receipt": receipt}


def test_default_import_rederives_a_chain_and_keeps_foreign_labels_out_of_routing(source_bundle, mem):
    rep = mem.import_bundle(source_bundle["bundle"])
    assert sorted(rep.added) == sorted([source_bundle["b1"], source_bundle["child"]])
    for bid in rep.added:
        b = mem.get(bid)
        assert b.provenance == "rederived" and b.labels_trusted is False
    assert mem.store.routing_rows(exclude_kinds=("page",)) == []  # labels no signature covers: not embedded
    r = mem.ask(source_bundle["child"], QUERY, max_tokens=1)  # the chain grafts exactly as at the source
    assert r.receipt.first_logits_sha256 == source_bundle["receipt"].first_logits_sha256
    assert r.receipt.provenance == "rederived"
    # labels given here make them this store's own: routed from then on
    b = mem.learn(REFUND, name="refunds here", when_to_use="refunds and returns")
    assert b.labels_trusted and b.provenance == "rederived" and b.name == "refunds here"
    assert [row[0] for row in mem.store.routing_rows(exclude_kinds=("page",))] == [source_bundle["b1"]]


def test_trusted_signature_lands_signed_without_a_prefill(source_bundle, mem):
    key = source_bundle["key"]
    pol = TrustPolicy().trust(key.public_key)
    rep = mem.import_bundle(source_bundle["signed"], policy=pol)
    assert rep.signer_trusted
    for bid in rep.added:
        b = mem.get(bid)
        assert b.provenance == f"signed:{key.public_key.key_id}" and b.labels_trusted
    assert len(mem.store.routing_rows(exclude_kinds=("page",))) == 2
    # a signature by a key the policy does not list vouches for nothing: re-derived as unsigned
    with Memory(engine=mem.engine, home=mem.store.home.parent / "other") as o:
        rep = o.import_bundle(source_bundle["signed"])
        assert not rep.signer_trusted
        assert {o.get(b).provenance for b in rep.added} == {"rederived"}


def _block_member(members: list[tuple[str, bytes]], bid: str) -> int:
    return next(i for i, (n, _) in enumerate(members) if n == f"blocks/{bid}.gmb")


def _rewrite_member(raw: bytes, **update) -> bytes:
    """A block file with manifest fields changed and header + trailer recomputed (self-consistent)."""
    from graftmem.core.format import HEADER, parse_header

    mlen, soff, slen = parse_header(raw[:HEADER.size], where="x", file_size=len(raw))
    block = Block.model_validate_json(raw[HEADER.size:HEADER.size + mlen])
    meta = update.pop("metadata", None)
    if meta is not None:
        update["metadata"] = {**block.metadata, **meta}
    new = block.model_copy(update=update)
    prefix = encode_prefix(new)
    state = raw[soff:soff + slen]
    return prefix + state + trailer_digest(prefix)


FIELD_CHANGES = {
    "text": {"text": "Weather report: sunny."},
    "name": {"name": "weather report"},
    "when_to_use": {"metadata": {"when_to_use": "questions about the weather"}},
    "metadata": {"metadata": {"extra": 1}},
    "kind": {"kind": "skill"},
    "pos_start": {"pos_start": 3},
    "parent": {"parent": "ab" * 32},
}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
@pytest.mark.parametrize("fix_manifest", [False, True], ids=["digest-left", "digest-updated"])
def test_a_signature_covers_every_manifest_field(source_bundle, mem, tmp_path, field, fix_manifest):
    """Change one manifest field of a signed bundle's block (file made self-consistent again). Left as
    is, the bundle manifest's pinned ``manifest_digest`` (and file size) no longer match: refused.
    With the bundle manifest updated to match, the signature no longer verifies: refused."""
    key = source_bundle["key"]
    pol = TrustPolicy().trust(key.public_key)
    members = read_members(source_bundle["signed"])
    bid = source_bundle["child"] if field in ("pos_start", "parent") else source_bundle["b1"]
    i = _block_member(members, bid)
    raw = _rewrite_member(members[i][1], **json.loads(json.dumps(FIELD_CHANGES[field])))
    members[i] = (members[i][0], raw)
    if fix_manifest:
        man = json.loads(members[0][1])
        for e in man["blocks"]:
            if e["id"] == bid:
                e["file_size"] = len(raw)
                e["manifest_digest"] = "blake3:" + raw[-32:].hex()
                e["name"] = FIELD_CHANGES[field].get("name", e["name"])
                e["kind"] = FIELD_CHANGES[field].get("kind", e["kind"])
        members[0] = (members[0][0], json.dumps(man, indent=1).encode())
    path = tmp_path / "tampered.gmbundle"
    path.write_bytes(rebuild(members))
    before = state_of(mem)
    with pytest.raises((BundleRejected, BlockRejected)) as info:
        mem.import_bundle(path, policy=pol)
    if fix_manifest:
        assert isinstance(info.value, UntrustedBundle), info.value
    assert state_of(mem) == before


def test_a_manifest_cannot_claim_a_provenance():
    with pytest.raises(ValueError, match="local knowledge"):
        Block.model_validate_json(json.dumps({"provenance": "local"}))
