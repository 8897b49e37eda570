"""A store that opens whatever is in it: junk entries under ``blocks/`` (FIFO, dangling symlink, a
symlink out of the store, a directory named ``<id>.gmb``), temp files of reused pids or odd names, a
read-only home, a full disk at every boundary of a write (the block file, the rename, SQLite's commit).

The read-only and disk-full tests mount a real tmpfs (root only); elsewhere they are skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from graftmem import Memory, StoreError, StoreFull
from graftmem.cli import main
from graftmem.core.errors import StoreReadOnly
from graftmem.store import Store

from .conftest import long_text, no_hang
from .test_bundle import QUERY


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_junk_entries_are_quarantined_and_the_store_keeps_working(mem, tmp_path, caplog, capsys):
    root = mem.learn(long_text(30, seed=21), name="root")
    child = mem.learn(" and one more rule.", name="child", parent=root.id)
    home = mem.store.home
    blocks = home / "blocks"
    junk = {}
    for what in ("fifo", "dangling", "outside", "dir", "garbage"):
        bid = uuid.uuid4().hex * 2
        d = blocks / bid[:2]
        d.mkdir(exist_ok=True)
        p = d / f"{bid}.gmb"
        if what == "fifo":
            os.mkfifo(p)
        elif what == "dangling":
            p.symlink_to(tmp_path / "nowhere.gmb")
        elif what == "outside":  # a VALID block file outside the store, linked in under its own name
            outside = tmp_path / f"{root.id}.gmb"
            shutil.copyfile(mem.store.path_of(root.id), outside)
            p = d / f"{bid}.gmb"
            p.symlink_to(outside)
        elif what == "dir":
            p.mkdir()
        else:
            p.write_bytes(b"GRAFTMEM" + os.urandom(100))
        junk[what] = p
    (blocks / "zz.gmb").symlink_to(tmp_path)  # a link where a block directory would be
    caplog.set_level(logging.WARNING, logger="graftmem")
    with no_hang():
        store = Store(home)
        try:
            assert {b.id for b in store.list()} == {root.id, child.id}
        finally:
            store.close()
        assert main(["--home", str(home), "ls"]) == 0
        assert main(["--home", str(home), "show", child.id[:8]]) == 0
    out = capsys.readouterr().out
    assert root.id[:12] in out and "local" in out
    for what, p in junk.items():
        assert not os.path.lexists(p), f"{what} left in blocks/"
    assert len(list((home / "quarantine").iterdir())) == len(junk) + 1
    assert sum("quarantine" in r.getMessage() or "moved" in r.getMessage() for r in caplog.records) >= len(junk)
    # doctor (which reads every block file) reports a healthy store after the quarantine
    assert main(["--home", str(home), "--config", '{"probe": false}', "--json", "doctor"]) in (0, 1)
    assert '"unreadable_blocks": []' in capsys.readouterr().out
    # and the store still works: reopened, grafting and learning as before
    with Memory(engine=mem.engine, home=home) as m:
        m.ask(child.id, QUERY, max_tokens=1)
        m.learn(long_text(10, seed=22))


def test_a_block_file_replaced_by_a_fifo_or_link_is_refused_not_hung(mem, tmp_path):
    b = mem.learn(long_text(20, seed=23))
    path = mem.store.path_of(b.id)
    path.unlink()
    os.mkfifo(path)
    with no_hang():
        with pytest.raises(Exception) as info:  # the index still lists it; the read refuses it
            mem.ask(b.id, QUERY, max_tokens=1)
        assert "not a regular file" in str(info.value)
        with Memory(engine=mem.engine, home=mem.store.home) as m:  # reopen: quarantined, row dropped
            assert m.get_all() == []


def test_temp_files_are_cleaned_by_pid_and_by_age(mem):
    b = mem.learn(long_text(10, seed=24))
    d = mem.store.path_of(b.id).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 2 * 3600
    cases = {
        f".{b.id}.1.5.tmp": (old, False),             # pid 1 is alive (a reused pid): removed by age
        ".not-a-temp-name.tmp": (old, False),         # unparseable: removed by age
        ".fresh-unparseable.tmp": (None, True),       # unparseable but fresh: may be a live writer
        f".{b.id}.{dead.pid}.7.tmp": (None, False),   # a dead writer: removed at once
        f".{b.id}.1.9.tmp": (None, True),             # a live pid, fresh: kept
    }
    for name, (mtime, _) in cases.items():
        (d / name).write_bytes(b"partial")
        if mtime:
            os.utime(d / name, (mtime, mtime))
    Store(mem.store.home).close()
    for name, (_, kept) in cases.items():
        assert (d / name).exists() == kept, name


def test_a_read_only_home_opens_read_only(smol, tmp_path, capsys):
    mnt = tmp_path / "ro"
    with tmpfs(mnt, "64m"):
        home = mnt / "home"
        with Memory(engine=smol, home=home) as m:
            b = m.learn(long_text(30, seed=25), name="ro-block")
            expected = m.ask(b.id, QUERY, max_tokens=1).receipt.first_logits_sha256
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with Memory(engine=smol, home=home) as m:
            assert m.store.read_only
            assert [x.id for x in m.get_all()] == [b.id] and m.get(b.id).provenance == "local"
            assert m.ask(b.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == expected
            assert m.verify(b.id, samples=2, cross_process=False).ok  # not recorded: nothing to write
            assert m.rederive(b.id).ok
            with pytest.raises(StoreReadOnly, match="read-only"):
                m.learn("a new text to learn")
            with pytest.raises(StoreError):
                m.delete(b.id)
        assert main(["--home", str(home), "ls"]) == 0
        assert b.id[:12] in capsys.readouterr().out
        assert main(["--home", str(home), "show", b.id]) == 0


def _fill(mnt: Path, leave: int) -> Path:
    filler = mnt / "filler"
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def test_a_full_disk_at_any_boundary_is_store_full_and_leaves_no_block(smol, tmp_path):
    """Sweep the free space across the size of one block write (file, rename, SQLite commit) in
    page steps: every attempt either stores the block or raises StoreFull; after a StoreFull the
    block is nowhere (no row, no file), also after reopening, and the store still works."""
    with Memory(engine=smol, home=tmp_path / "src") as src:
        b = src.learn(long_text(12, seed=26), name="full")
        _, view = src.store.read_state(b.id, lambda n: memoryview(bytearray(n)))
        state = bytes(view)
    size = b.state_size + 8192
    mnt = tmp_path / "full"
    causes: set[str] = set()
    stored = 0
    with tmpfs(mnt, "16m"):
        home = mnt / "home"
        Store(home).close()
        for leave in range(max(0, size - 16384), size + 96 * 1024, 4096):
            filler = _fill(mnt, leave)
            store = Store(home)
            try:
                store.put(b, state)
                stored += 1
            except StoreFull as exc:
                causes.add(type(exc.__cause__).__name__)
            finally:
                store.close()
                filler.unlink()
            store = Store(home)
            try:
                present = store.contains(b.id)
                assert present == store.path_of(b.id).exists(), f"row and file disagree at {leave}"
                if present:
                    store.delete(b.id)
                assert not list((home / "blocks").rglob(".*.tmp")), "temp file left behind"
            finally:
                store.close()
        # learn through the API on a disk with no room: StoreFull, nothing left
        filler = _fill(mnt, 0)
        with Memory(engine=smol, home=home) as m:
            with pytest.raises(StoreFull, match="disk full"):
                m.learn(long_text(12, seed=26))
        filler.unlink()
        with Memory(engine=smol, home=home) as m:
            assert m.get_all() == []
            assert m.learn(long_text(12, seed=26)).id == b.id  # and it works again
    assert stored and causes, (stored, causes)
    # both boundaries were hit: the block file itself, and SQLite's commit after the file fitted
    assert causes == {"OSError", "OperationalError"}, causes


def test_sqlite_disk_full_is_store_full(tmp_path):
    """SQLite's own 'database or disk is full' maps to StoreFull (not a raw OperationalError)."""
    from graftmem.store.local import _sql_error

    err = _sql_error(sqlite3.OperationalError("database or disk is full"), tmp_path, "committing")
    assert isinstance(err, StoreFull)
