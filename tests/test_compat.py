"""Blocks and bundles written before the layered layout are read by it, byte for byte.

Each ``tests/data/compat-*`` directory holds a root block, a chained (delta) child and a bundle of
both, written by the flat layout (the commit is named in its ``old_blocks.json``) with SmolLM2 at
n_ctx=512, on one kind of CPU (``cpu_features``; scripts/compat_fixtures.py writes a set for another
machine with the old code). Everywhere: the old files parse and check, a store adopts them, and a
bundle made on another CPU is refused by name (the fingerprint's ``cpu_features``) or kept apart on
request. On a machine of a set's kind: the same texts learned now give the same block ids and state
bytes, and the old chain grafts byte-exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from graftmem import IncompatibleBlock, Memory, logits_sha256
from graftmem.store import Store, read_block_file

DATA = Path(__file__).parent / "data"
SETS = {p.parent.name: (p.parent, json.loads(p.read_text())) for p in sorted(DATA.glob("compat-*/old_blocks.json"))}


def _state(path: Path, bid: str) -> bytes:
    _, view = read_block_file(path, lambda n: memoryview(bytearray(n)), expect_id=bid)
    return bytes(view)


@pytest.fixture(scope="module")
def engine():
    """SmolLM2 with the engine config the fixtures were written with (the same in every set)."""
    from graftmem import Engine

    configs = {json.dumps(meta["config"], sort_keys=True) for _, meta in SETS.values()}
    assert len(configs) == 1, configs
    with Engine("smollm2", {**json.loads(configs.pop()), "probe": False}) as eng:
        yield eng


@pytest.fixture()
def small(engine, tmp_path):
    """A Memory on a fresh home over that engine."""
    with Memory(engine=engine, home=tmp_path / "h") as m:
        yield m


def _here(engine) -> tuple[Path, dict] | None:
    """The fixture set written on a CPU like this one, if any."""
    cpu = engine.fingerprint.cpu_features
    return next((s for s in SETS.values() if s[1]["cpu_features"] == cpu), None)


def test_there_are_sets_for_two_kinds_of_cpu():
    assert len({meta["cpu_features"] for _, meta in SETS.values()}) >= 2, sorted(SETS)


@pytest.mark.parametrize("name", sorted(SETS))
def test_old_block_files_parse_and_check(name):
    """The header, manifest and digests of the old files are read by the new reader (no engine needed)."""
    data, meta = SETS[name]
    for key in ("root", "child"):
        bid = meta[key]
        assert len(_state(data / f"{bid}.gmb", bid)) > 0


@pytest.mark.parametrize("name", sorted(SETS))
def test_old_bundle_is_imported_here_or_refused_by_name(small, name):
    """A bundle from this kind of CPU imports; one from another is refused naming ``cpu_features``
    (nothing imported), and kept apart when asked."""
    data, meta = SETS[name]
    ids = sorted([meta["root"], meta["child"]])
    if meta["cpu_features"] == small.engine.fingerprint.cpu_features:
        assert sorted(small.import_bundle(data / "old.gmbundle").added) == ids
        return
    with pytest.raises(IncompatibleBlock) as e:
        small.import_bundle(data / "old.gmbundle")
    assert "cpu_features" in e.value.fields and "cpu_features" in str(e.value)
    assert small.get_all() == []
    assert sorted(small.import_bundle(data / "old.gmbundle", incompatible="keep-apart").kept_apart) == ids
    assert small.get_all() == []  # kept apart: never grafted here


@pytest.mark.parametrize("name", sorted(SETS))
def test_old_block_file_dropped_into_a_store_is_adopted(tmp_path, name):
    """A block file copied by hand into ``blocks/<id[:2]>/`` (the store layout) is indexed on open."""
    data, meta = SETS[name]
    other = tmp_path / "copy"
    for key in ("root", "child"):
        bid = meta[key]
        (other / "blocks" / bid[:2]).mkdir(parents=True, exist_ok=True)
        shutil.copy(data / f"{bid}.gmb", other / "blocks" / bid[:2] / f"{bid}.gmb")
    store = Store(other)
    try:
        assert {b.id for b in store.list()} == {meta["root"], meta["child"]}
        assert store.get(meta["child"]).parent == meta["root"]
    finally:
        store.close()


def test_old_blocks_are_learned_again_and_graft_exactly_here(small):
    """On a CPU a set was written on: the same texts give the same ids and state bytes, and the old
    chain grafts byte-exactly against a fresh sequential prefill."""
    here = _here(small.engine)
    if here is None:
        pytest.skip(f"no fixture set was written on this kind of CPU ({small.engine.fingerprint.cpu_features}); "
                    "add one with scripts/compat_fixtures.py (the other tests here ran)")
    data, meta = here
    small.import_bundle(data / "old.gmbundle")
    root = small.learn(meta["root_text"], name="new-root")
    child = small.learn(meta["child_text"], name="new-child", parent=root.id)
    assert (root.id, child.id) == (meta["root"], meta["child"])
    assert root.state_digest == meta["root_state_digest"]
    assert child.full_state_digest == meta["child_full_state_digest"]
    assert _state(small.store.path_of(root.id), root.id) == _state(data / f"{root.id}.gmb", root.id)
    eng = small.engine
    q = eng.tokenize(" Next:", add_special=False)
    with eng.session():
        eng.prefill(eng.tokenize(meta["root_text"]))
        eng.prefill(eng.tokenize(meta["child_text"], add_special=False))
        eng.prefill(q)
        fresh = logits_sha256(eng.logits())
    r = small.ask(child.id, " Next:", max_tokens=1)
    assert r.receipt.first_logits_sha256 == fresh
