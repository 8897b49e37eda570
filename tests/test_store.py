"""Integrity, identity and durability: corrupt, truncated and foreign blocks are refused with their
own errors; the store keeps working; concurrent writers and kill -9 leave it consistent.

All of it is store plumbing that holds on any model: it runs on the tiny random-weight Llama 3.1 of
tests/tiny.py (`tiny_llama` / `tiny_mem`, also in the child processes), whose prefills cost ~1/100th of
SmolLM2's. The "another model" is still a real other model (Gemma 3 270M)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from graftmem import (BlockCorrupted, BlockNotFound, EngineConfig, IncompatibleBlock, Memory,
                      StoreFull)
from graftmem.store.local import Store

from .conftest import flip_bit as _flip
from .conftest import long_text
from .tiny import tiny_path

#: The tiny Llama 3.1 for a child process or a second engine: one thread, as `tiny_llama` has it.
TINY = str(tiny_path("llama31"))


@pytest.fixture
def mem(tiny_llama, tmp_path) -> Memory:
    """A Memory over the tiny Llama 3.1 and a fresh store (conftest's `tiny_mem`, under this file's name)."""
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        yield m

TEXT = "Shipping rule: parcels over 2 kg go by ground, others by air. Always print the label first."



def _still_works(mem: Memory) -> None:
    other = mem.learn("A different manual about returns: keep the receipt.")
    assert mem.ask(other.id, "\nQ: keep what?\nA:", max_tokens=3).receipt.exact


def test_flipped_state_byte_is_refused_then_store_works(mem):
    block = mem.learn(TEXT)
    path = mem.store.path_of(block.id)
    _flip(path, path.stat().st_size - 32 - 1000)  # inside the state bytes
    with pytest.raises(BlockCorrupted) as ei:
        mem.ask(block.id, "\nQ:")
    err = ei.value
    assert str(path) in str(err) and err.expected == block.state_digest and err.actual != err.expected
    _still_works(mem)


def test_flipped_manifest_byte_is_refused(mem):
    block = mem.learn(TEXT)
    path = mem.store.path_of(block.id)
    _flip(path, 100)  # inside the manifest JSON
    with pytest.raises(BlockCorrupted, match="digest mismatch"):
        mem.ask(block.id, "\nQ:")
    _still_works(mem)


def test_truncated_file_is_refused(mem):
    block = mem.learn(TEXT)
    path = mem.store.path_of(block.id)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises(BlockCorrupted, match="truncated"):
        mem.ask(block.id, "\nQ:")
    _still_works(mem)


def test_block_from_another_model_is_refused(tiny_llama, gemma, tmp_path):
    home = tmp_path / "shared"
    with Memory(engine=gemma, home=home) as g:
        block = g.learn(TEXT)
    with Memory(engine=tiny_llama, home=home) as s:
        with pytest.raises(IncompatibleBlock) as ei:
            s.ask(block.id, "\nQ:")
        assert "model_sha256" in ei.value.fields
        assert "model_sha256" in str(ei.value)
        _still_works(s)


def test_block_from_another_n_ctx_is_refused(tiny_llama, tmp_path):
    home = tmp_path / "shared"
    with Memory(engine=tiny_llama, home=home) as s:
        block = s.learn(TEXT)
    with Memory(TINY, home=home, config=EngineConfig(n_ctx=4096, n_threads=1, probe=False)) as other:
        with pytest.raises(IncompatibleBlock) as ei:
            other.ask(block.id, "\nQ:")
        assert set(ei.value.fields) == {"n_ctx"}
        assert ei.value.fields["n_ctx"] == (8192, 4096)
        assert "n_ctx=8192" in str(ei.value)


def test_same_text_twice_is_one_block(mem):
    a = mem.learn(TEXT, name="one")
    b = mem.learn(TEXT, name="two")
    assert a.id == b.id and len(mem.get_all()) == 1


def test_index_survives_restart_and_reconciles_with_files(tiny_llama, tmp_path):
    home = tmp_path / "s"
    with Memory(engine=tiny_llama, home=home) as m:
        ids = {m.learn(TEXT).id, m.learn(TEXT + " Twice.").id}
    # a file without an index row (killed between rename and insert) and a row without a file
    import sqlite3

    db = sqlite3.connect(home / "index.sqlite")
    gone = sorted(ids)[0]
    db.execute("DELETE FROM blocks WHERE id=?", (gone,))
    db.commit(); db.close()
    with Memory(engine=tiny_llama, home=home) as m:
        assert {b.id for b in m.get_all()} == ids  # re-indexed from the file
        m.store.path_of(gone).unlink()
    with Memory(engine=tiny_llama, home=home) as m:
        assert {b.id for b in m.get_all()} == ids - {gone}
        with pytest.raises(BlockNotFound):
            m.get(gone)


def test_id_prefix_and_missing_block(mem):
    block = mem.learn(TEXT)
    assert mem.get(block.id[:8]).id == block.id
    with pytest.raises(BlockNotFound):
        mem.get("ffff0000")


_CHILD = r"""
import sys, json
from graftmem import Memory, EngineConfig
home, tag, n, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with Memory(model, home=home, config=EngineConfig(n_threads=1, probe=False)) as m:
    for i in range(n):
        m.learn(f"Manual {tag}-{i}: step one, step two, step three." if i else "Common shared manual.")
print("done")
"""


def test_two_processes_learning_into_one_store(tmp_path):
    home = tmp_path / "concurrent"
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(home), tag, "4", TINY],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for tag in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    store = Store(home)
    try:
        blocks = store.list()
        assert len(blocks) == 7  # 3 + 3 distinct, plus the common one stored once
        for b in blocks:
            store.read_state(b.id, lambda n: memoryview(bytearray(n)))  # every digest checks
        assert not list(home.glob("blocks/*/.*.tmp"))
    finally:
        store.close()


_KILL_CHILD = r"""
import sys
from graftmem import Memory, EngineConfig
home, model = sys.argv[1], sys.argv[2]
with Memory(model, home=home, config=EngineConfig(n_threads=1, probe=False)) as m:
    i = 0
    while True:
        b = m.learn(f"Entry {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
        print("learned", b.id, flush=True)  # committed: the parent kills only after this
        i += 1
"""


@pytest.mark.parametrize("delay", [0.3, 0.9, 1.7])
def test_kill_minus_9_mid_write_leaves_store_consistent(tmp_path, delay):
    home = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(home), TINY], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()  # one block committed before the kill, so the kill lands in
    assert line[:1] == ["learned"], line  # a later prefill or write, never before any write
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    store = Store(home)  # reconciles on open
    try:
        blocks = store.list()
        files = sorted(home.glob("blocks/*/*.gmb"))
        assert len(files) == len(blocks) >= 1
        assert line[1] in {b.id for b in blocks}  # what was reported learned survived the kill
        for b in blocks:
            store.read_state(b.id, lambda n: memoryview(bytearray(n)))
        assert not list(home.glob("blocks/*/.*.tmp"))  # the dead writer's temp file was removed
    finally:
        store.close()


def test_full_disk_raises_store_full_and_loses_nothing(mem, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with Memory(engine=mem.engine, home=mnt / "store") as m:
            small = m.learn("Tiny manual.")
            with pytest.raises(StoreFull):
                m.learn(long_text(4800))  # ~5,300 tokens of 512 B: ~2.7 MB of state does not fit in 2 MB
            assert [b.id for b in m.get_all()] == [small.id]
            assert not list((mnt / "store").glob("blocks/*/.*.tmp"))
            assert m.ask(small.id, " Q:", max_tokens=2).receipt.exact
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_one_sqlite_transaction_rolls_back_and_never_masks_the_error(tmp_path):
    """graftmem.store.sqlite.transaction: an error in the block rolls the writes back; when nothing is
    left to roll back (a COMMIT that failed on a full disk has rolled back already), the error raised
    is still the cause, not "cannot rollback - no transaction is active"."""
    import sqlite3

    from graftmem.store.sqlite import connect, transaction

    class Cause(Exception):
        pass

    db = connect(tmp_path / "t.sqlite", timeout=5, setup=lambda d: d.execute("CREATE TABLE IF NOT EXISTS t (x)"))
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        with pytest.raises(Cause):
            with transaction(db):
                db.execute("INSERT INTO t VALUES (1)")
                raise Cause
        assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)  # rolled back
        with pytest.raises(Cause):
            with transaction(db):
                db.execute("INSERT INTO t VALUES (2)")
                db.execute("COMMIT")  # the transaction is over, as after a COMMIT that failed
                raise Cause
        with pytest.raises(sqlite3.OperationalError, match="cannot rollback"):
            db.execute("ROLLBACK")  # what transaction() had to keep from replacing the cause
        with transaction(db):
            db.execute("INSERT INTO t VALUES (3)")
        assert [r[0] for r in db.execute("SELECT x FROM t ORDER BY x")] == [2, 3]
    finally:
        db.close()
    ro = connect(tmp_path / "t.sqlite", timeout=5, read_only=True)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro.execute("INSERT INTO t VALUES (4)")
    finally:
        ro.close()
