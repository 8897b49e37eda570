"""`graftmem.store.BlockStore`: both stores implement every member, with the same signature.

``isinstance`` on a runtime-checkable protocol only checks that the names exist; a store whose
``read_state`` lost its ``timings`` keyword, or whose ``put`` defaults another provenance, would pass it
and fail in the layer above. So the signatures are compared parameter by parameter (name, kind,
default, annotation). The fleet store's instance attributes are checked in tests/test_fleet.py (it
needs a bucket)."""

from __future__ import annotations

import inspect

import pytest

from graftmem import BlockCorrupted, FleetStore, Store
from graftmem.store import BlockStore


def protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(BlockStore).items() if callable(v) and not n.startswith("_"))


def protocol_attributes() -> list[str]:
    return sorted(BlockStore.__annotations__)


def mismatches(cls: type) -> list[str]:
    """Where ``cls`` differs from the protocol: a missing member, or a method whose parameters differ."""
    bad = []
    for name in protocol_methods():
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            bad.append(f"{cls.__name__}.{name}: missing")
            continue
        want = list(inspect.signature(getattr(BlockStore, name)).parameters.values())
        have = list(inspect.signature(impl).parameters.values())
        strip = [(p.name, p.kind, p.default, str(p.annotation)) for p in want]
        got = [(p.name, p.kind, p.default, str(p.annotation)) for p in have]
        if strip != got:
            bad.append(f"{cls.__name__}.{name}{inspect.signature(impl)} != BlockStore.{name}"
                       f"{inspect.signature(getattr(BlockStore, name))}")
    return bad


def test_the_protocol_names_the_verbs_the_layers_above_use():
    # the verbs api/, cli/, server/, memory/ and share/ call on a store (a shrinking protocol would let a
    # store without them through)
    used = {"get", "contains", "list", "put", "delete", "read_state", "provenance", "set_provenance",
            "routing_rows", "stats", "data_version", "resolve", "children", "path_of", "set_manifest", "adopt",
            "reconcile", "close", "check_file", "prefetch", "get_vectors", "put_vectors", "put_file",
            "list_files", "get_file"}
    assert used <= set(protocol_methods())
    assert {"home", "layout", "read_only", "lock_timeout", "remote", "poll_interval"} <= set(protocol_attributes())


@pytest.mark.parametrize("cls", [Store, FleetStore])
def test_both_stores_implement_every_member_with_the_same_signature(cls):
    assert mismatches(cls) == []


def test_the_signature_check_sees_a_changed_parameter():
    """The checker itself: a store whose ``read_state`` lost ``timings`` or whose ``put`` defaults
    another provenance is reported, and so is a missing verb."""
    class Drifted(Store):
        def read_state(self, block_id, buffer, *, fingerprint=None):  # no timings
            raise AssertionError

        def put(self, block, state, *, replace=False, provenance="unverified", labels_trusted=True):
            raise AssertionError

    Drifted.check_file = None  # type: ignore[assignment]
    found = mismatches(Drifted)
    assert len(found) == 3, found
    assert any("read_state" in f for f in found) and any("put" in f for f in found)
    assert any("check_file: missing" in f for f in found)


def test_a_local_store_satisfies_the_protocol_and_answers_the_sharing_verbs(tmp_path, smol):
    store = Store(tmp_path / "home")
    try:
        assert isinstance(store, BlockStore)
        for name in protocol_attributes():
            assert hasattr(store, name), name
        assert store.remote is False and store.poll_interval == 0.0
        # nothing to share with other workers: answered, not missing
        assert store.prefetch(["ab" * 32]) == []
        assert store.get_vectors("space", ["x"]) == {}
        store.put_vectors("space", {"x": None})
        assert store.list_files("pages/") == []
        store.put_file("pages/a.sqlite", tmp_path / "nothing")
        assert store.get_file("pages/a.sqlite", tmp_path / "dest") is False and not (tmp_path / "dest").exists()
        # check_file: the manifest as the file holds it (what doctor asks), by id or prefix
        from graftmem import Memory

        with Memory(engine=smol, store=store) as mem:
            block = mem.learn("The capital of the test country is Testville.", name="capital")
        assert store.check_file(block.id[:8]).id == block.id
        path = store.path_of(block.id)
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0xFF  # inside the header/manifest: the trailer's check fails
        path.write_bytes(bytes(raw))
        with pytest.raises(BlockCorrupted):
            store.check_file(block.id)
    finally:
        store.close()


def test_upload_refuses_a_local_target(tmp_path, capsys):
    """``graftmem upload`` copies a local store into a bucket: a local target (``store.remote`` is
    False) is refused with the fix, and a source that is not a store is refused before anything opens."""
    from graftmem.cli import main

    Store(tmp_path / "src").close()
    assert main(["upload", str(tmp_path / "src"), "--home", str(tmp_path / "dst")]) == 2
    assert "give --store s3://bucket/prefix" in capsys.readouterr().err
    assert main(["upload", str(tmp_path / "nothing"), "--home", str(tmp_path / "dst")]) == 2
    assert "is not a graftmem store" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()
