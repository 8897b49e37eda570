"""The local block store: block files in a directory, an index, a lock (paths from :mod:`.home`).

Durability rules (the opposite of each LMCache failure): block files are written to a temp file,
fsync'ed, renamed into place and the directory fsync'ed; the index is a transactional SQLite database;
the files are the truth and the index is reconciled with them whenever the store opens, so a process
killed between the rename and the index insert, or between a delete's unlink and the row removal,
leaves nothing inconsistent after the next open. Every state read checks the BLAKE3 digest before the
bytes can reach llama.cpp.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

from ..core.blocks import Block, Fingerprint, StoreStats
from ..core.errors import (BlockCorrupted, BlockNotFound, ConfigError, IncompatibleBlock, StoreError,
                      StoreFull, StoreLocked)
from .home import BLOCK_SUFFIX, Home
from ..core.format import HEADER, TRAILER_LEN, parse_header, parse_manifest, state_digest, write_block

__all__ = ["Store", "default_home", "read_block_file", "atomic_file"]

log = logging.getLogger("graftmem")
SUFFIX = BLOCK_SUFFIX

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    state_size INTEGER NOT NULL,
    file_size INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    fp_digest TEXT NOT NULL,
    manifest TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_kind ON blocks(kind);
"""


def default_home() -> Path:
    """``$GRAFTMEM_HOME`` or the platform's user data directory for graftmem."""
    env = os.environ.get("GRAFTMEM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("graftmem"))


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path, tmp: Optional[Path] = None) -> Iterator[BinaryIO]:
    """A new file for ``path``, all or nothing: written to ``tmp`` (default: a hidden name beside it),
    fsync'ed, renamed over ``path``, its directory fsync'ed. On any error the temp file is removed and
    ``path`` still holds its old content (or nothing); the error propagates for the caller to name."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def incompatibility(block: Block, fingerprint: Fingerprint) -> IncompatibleBlock | None:
    """An :class:`IncompatibleBlock` naming every differing identity field, or None."""
    diff = block.fingerprint.diff(fingerprint)
    if not diff:
        return None
    parts = ", ".join(f"{k}={a!r} (this engine has {b!r})" for k, (a, b) in diff.items())
    return IncompatibleBlock(f"block {block.short_id} was made with {parts}; it cannot be grafted "
                             f"into this engine: learn it again here", fields=diff)


def _read_head(f: BinaryIO, where: str, expect_id: str) -> tuple[Block, int, int]:
    """The manifest of an open block file and where its state lies (offset, length), with header,
    trailer and padding checked and the manifest's id and size matched against the file."""
    size = os.fstat(f.fileno()).st_size
    _, soff, slen = parse_header(f.read(HEADER.size), where=where, file_size=size)
    f.seek(0)
    prefix = f.read(soff)
    f.seek(soff + slen)
    trailer = f.read(TRAILER_LEN)
    block = parse_manifest(prefix, trailer, where=where)
    if block.id != expect_id or block.state_size != slen:
        raise BlockCorrupted(f"{where}: manifest id/size do not match the file", path=where)
    return block, soff, slen


def read_block_file(path: Path, buffer: Callable[[int], memoryview], *, expect_id: str,
                    fingerprint: Optional[Fingerprint] = None,
                    timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
    """Read the state of the block file at ``path`` into ``buffer(n)`` and check it (see
    :meth:`Store.read_state`); also for files not in a store yet, such as a staged import.

    The first read of a file version in this process checks the state's BLAKE3 digest and remembers
    the xxh3-128 of the checked bytes; later reads of the same version (same inode, size, mtime and
    ctime) check that xxh3-128 while reading instead (:mod:`graftmem.store.verified`, docs/format.md:
    what each digest defends against). Either way a changed byte is refused before it is returned.
    ``timings``, if given, gets ``read_ms`` and ``check_ms`` added (accumulated over chained reads).
    """
    from . import verified  # local import: keeps this change inside the reader

    where = str(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        block, soff, slen = _read_head(f, where, expect_id)
        if fingerprint is not None:
            err = incompatibility(block, fingerprint)
            if err is not None:
                raise err
        key = verified.file_version(f.fileno(), block.state_digest)
        known = verified.recall(key)
        view = buffer(slen)
        t1 = time.perf_counter()
        f.seek(soff)
        if known is not None:  # this version passed BLAKE3 before: xxh3-128 while reading
            got, seen = verified.read_hashed(f, view)
        else:
            got = 0
            while got < slen:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        if got < slen:
            raise BlockCorrupted(f"{where}: truncated state ({got} of {slen} bytes)", path=where)
    t2 = time.perf_counter()
    if known is not None:
        if seen != known:
            verified.forget(key)
            raise BlockCorrupted(f"{where}: state changed since it was verified: xxh3-128 expected "
                                 f"{known.hex()}, actual {seen.hex()}", path=where,
                                 expected=known.hex(), actual=seen.hex())
    else:
        actual = state_digest(view)
        if actual != block.state_digest:
            raise BlockCorrupted(f"{where}: state digest mismatch: expected {block.state_digest}, "
                                 f"actual {actual}", path=where, expected=block.state_digest, actual=actual)
        verified.remember(key, verified.checksum(view))
    if timings is not None:
        t3 = time.perf_counter()
        timings["read_ms"] = timings.get("read_ms", 0.0) + (t2 - t1) * 1e3
        timings["check_ms"] = timings.get("check_ms", 0.0) + ((t1 - t0) + (t3 - t2)) * 1e3
    return block, view


class Store:
    """A directory of block files plus a SQLite index, safe for several threads and processes."""

    def __init__(self, home: str | os.PathLike[str] | None = None, *, lock_timeout: float = 30.0) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.layout = Home(self.home)  #: every path under the home
        self.lock_timeout = lock_timeout
        try:
            self.layout.blocks.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store at {self.home}: {exc}") from exc
        self._tlock = threading.RLock()
        self._lock_depth = 0
        self._db = sqlite3.connect(self.layout.index, timeout=lock_timeout,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self.reconcile()

    def close(self) -> None:
        with self._tlock:
            self._db.close()

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive inter-process lock for mutations (flock on ``home/lock``).

        Re-entrant within a thread: flock locks belong to an open file description, so a nested
        call opening a second descriptor would wait on itself; nested calls reuse the held lock."""
        with self._tlock:
            if self._lock_depth:
                self._lock_depth += 1
                try:
                    yield
                finally:
                    self._lock_depth -= 1
                return
            fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                deadline = time.monotonic() + self.lock_timeout
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise StoreLocked(f"the store at {self.home} stayed locked by another "
                                              f"process for {self.lock_timeout:.0f} s; retry later") from None
                        time.sleep(0.02)
                self._lock_depth = 1
                yield
            finally:
                self._lock_depth = 0
                os.close(fd)  # closing the descriptor releases the flock

    # ------------------------------------------------------------------ paths
    def path_of(self, block_id: str) -> Path:
        return self.layout.block(block_id)

    def _files(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for sub in self.layout.blocks.iterdir():
            if sub.is_dir():
                for p in sub.iterdir():
                    if p.suffix == SUFFIX and not p.name.startswith("."):
                        out[p.stem] = p
        return out

    # ------------------------------------------------------------------ index
    def _insert(self, block: Block, file_size: int) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO blocks VALUES (?,?,?,?,?,?,?,?,?)",
            (block.id, block.name, block.kind, block.n_tokens, block.state_size, file_size,
             block.created_at.isoformat(), block.fingerprint.digest(), block.model_dump_json()))

    def reconcile(self) -> dict[str, int]:
        """Make the index agree with the files: add unindexed files, drop rows without a file,
        remove temp files left by dead writers. Runs on every open; cheap (one directory walk)."""
        added = dropped = cleaned = 0
        with self.lock():
            for sub in self.layout.blocks.iterdir():
                if not sub.is_dir():
                    continue
                for p in sub.glob(".*.tmp"):
                    try:
                        pid = int(p.name.split(".")[2])
                    except (IndexError, ValueError):
                        pid = -1
                    if not pid_alive(pid):
                        p.unlink(missing_ok=True)
                        cleaned += 1
            files = self._files()
            rows = {r[0] for r in self._db.execute("SELECT id FROM blocks")}
            for bid in rows - files.keys():
                self._db.execute("DELETE FROM blocks WHERE id=?", (bid,))
                dropped += 1
            for bid in files.keys() - rows:
                try:
                    block = self.read_manifest(files[bid])
                except BlockCorrupted as exc:
                    log.warning("not indexing corrupt block file: %s", exc)
                    continue
                self._insert(block, files[bid].stat().st_size)
                added += 1
        if added or dropped or cleaned:
            log.info("store %s reconciled: %d added, %d dropped, %d temp files removed",
                     self.home, added, dropped, cleaned)
        return {"added": added, "dropped": dropped, "temp_removed": cleaned}

    def resolve(self, block_id: str) -> str:
        """Full id for an id or a unique prefix of at least 4 hex characters."""
        if not block_id or any(c not in "0123456789abcdef" for c in block_id):
            raise BlockNotFound(f"{block_id!r} is not a block id (lowercase hex)")
        if len(block_id) == 64:
            return block_id
        if len(block_id) < 4:
            raise ConfigError(f"block id prefix {block_id!r} is too short: give at least 4 characters")
        with self._tlock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM blocks WHERE id >= ? AND id < ? LIMIT 2", (block_id, block_id + "g"))]
        if not ids:
            raise BlockNotFound(f"no block {block_id!r} in the store at {self.home}")
        if len(ids) > 1:
            raise ConfigError(f"block id prefix {block_id!r} is ambiguous: give more characters")
        return ids[0]

    def get(self, block_id: str) -> Block:
        bid = self.resolve(block_id)
        with self._tlock:
            row = self._db.execute("SELECT manifest FROM blocks WHERE id=?", (bid,)).fetchone()
        if row is None:
            raise BlockNotFound(f"no block {block_id!r} in the store at {self.home}")
        return Block.model_validate_json(row[0])

    def contains(self, block_id: str) -> bool:
        with self._tlock:
            return self._db.execute("SELECT 1 FROM blocks WHERE id=?", (block_id,)).fetchone() is not None

    def list(self, *, kind: str | None = None) -> list[Block]:
        q = "SELECT manifest FROM blocks" + (" WHERE kind=?" if kind else "") + " ORDER BY created_at, id"
        with self._tlock:
            rows = self._db.execute(q, (kind,) if kind else ()).fetchall()
        return [Block.model_validate_json(r[0]) for r in rows]

    def stats(self) -> StoreStats:
        """Counts and sizes from the index (no file is opened)."""
        with self._tlock:
            n, toks, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_tokens),0), COALESCE(SUM(file_size),0) FROM blocks").fetchone()
            kinds = dict(self._db.execute("SELECT kind, COUNT(*) FROM blocks GROUP BY kind").fetchall())
        return StoreStats(home=str(self.home), blocks=int(n), tokens=int(toks), bytes_on_disk=int(size),
                          bytes_per_token=size / toks if toks else 0.0, kinds={str(k): int(v) for k, v in kinds.items()})

    def data_version(self) -> int:
        """A number that changes whenever *another* connection (process) commits to the index.

        SQLite's ``PRAGMA data_version``: one cheap query that lets a cache built from the index (the
        router) tell whether it must look again. This connection's own writes do not change it.
        """
        with self._tlock:
            return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def routing_rows(self, *, exclude_kind: str) -> list[tuple[str, str, str, str | None]]:
        """``(id, name, fingerprint digest, metadata.when_to_use)`` of every block not of ``exclude_kind``,
        read from the index without parsing manifests (the router syncs from this on every change)."""
        with self._tlock:
            return self._db.execute(
                "SELECT id, name, fp_digest, json_extract(manifest, '$.metadata.when_to_use') FROM blocks "
                "WHERE kind != ?", (exclude_kind,)).fetchall()

    # ------------------------------------------------------------------ write / delete
    def put(self, block: Block, state: memoryview | bytes) -> Block:
        """Store a block atomically; a block already present (same content id) is returned as is."""
        if block.state_size != len(state):
            raise ConfigError(f"block says {block.state_size} state bytes, got {len(state)}")
        with self.lock():
            if self.path_of(block.id).exists() and self.contains(block.id):
                return self.get(block.id)
            if block.parent is not None and not self.contains(block.parent):
                raise BlockNotFound(f"block {block.short_id} is chained on {block.parent[:12]}, which "
                                    f"is not in the store at {self.home} (deleted meanwhile?)")
            self._write(block, state)
        return block

    def _write(self, block: Block, state: memoryview | bytes) -> None:
        """Write the block file (temp, fsync, rename over any old file, fsync dir) and index it.
        The caller holds the lock. At every instant the final path holds a whole old or new file."""
        path = self.path_of(block.id)
        path.parent.mkdir(exist_ok=True)
        # temp name: reconcile() parses the writer's pid from it to clean up after killed writers
        tmp = path.parent / f".{block.id}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with atomic_file(path, tmp) as f:
                size = write_block(f, block, state)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"disk full while writing block {block.short_id} to {self.home}; "
                                "nothing was written: free space and learn again") from exc
            raise StoreError(f"cannot write block {block.short_id} to {path}: {exc}") from exc
        self._insert(block, size)

    def children(self, block_id: str) -> list[str]:
        """Ids of the blocks chained directly on ``block_id`` (their manifest's ``parent``)."""
        with self._tlock:
            return [r[0] for r in self._db.execute(
                "SELECT id FROM blocks WHERE json_extract(manifest, '$.parent') = ? ORDER BY id", (block_id,))]

    def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        """Delete a block; return the ids deleted. A block that other blocks are chained on is
        refused (their states are rebuilt from its bytes) unless ``cascade=True``, which deletes
        every descendant first, deepest first, under one lock."""
        bid = self.resolve(block_id)
        with self.lock():
            order: list[str] = []
            todo = [bid]
            while todo:
                cur = todo.pop()
                order.append(cur)
                todo.extend(self.children(cur))
            if len(order) > 1 and not cascade:
                kids = self.children(bid)
                raise ConfigError(
                    f"block {bid[:12]} has {len(kids)} chained child block(s) "
                    f"({', '.join(k[:12] for k in kids)}) whose states are rebuilt from its bytes; "
                    f"delete them first or pass cascade=True to delete all {len(order) - 1} descendants")
            for cur in reversed(order):  # children before parents: a kill leaves no orphan
                self.path_of(cur).unlink(missing_ok=True)
                self._db.execute("DELETE FROM blocks WHERE id=?", (cur,))
            return list(reversed(order))

    def adopt(self, files: list[tuple[Block, Path]]) -> list[str]:
        """Move already verified, fsync'ed block files (staged on this filesystem) into the store,
        all or none, under one lock; return the ids added. Blocks already present are skipped (their
        staged copy stays where it is). The renames are made durable with one fsync per directory and
        the index rows are inserted in one transaction. If anything fails, the files moved so far are
        removed again, so the store is left as it was. Used by bundle import and pull, which verify
        before calling."""
        moved: list[tuple[Block, Path]] = []
        with self.lock():
            try:
                for block, src in files:
                    dst = self.path_of(block.id)
                    if dst.exists() and self.contains(block.id):
                        continue
                    dst.parent.mkdir(exist_ok=True)
                    os.replace(src, dst)
                    moved.append((block, dst))
                dirs = list({dst.parent for _, dst in moved})
                if len(dirs) > 1:  # concurrent fsyncs share journal commits
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(max_workers=min(16, len(dirs))) as pool:
                        list(pool.map(fsync_path, dirs))
                else:
                    for d in dirs:
                        fsync_path(d)
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for block, dst in moved:
                        self._insert(block, dst.stat().st_size)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except BaseException:
                for _, dst in moved:
                    dst.unlink(missing_ok=True)
                raise
        return [b.id for b, _ in moved]

    def set_manifest(self, block: Block) -> None:
        """Rewrite a block's manifest (e.g. its verification record). The state bytes are read back,
        their digest re-checked, and the new file replaces the old one with one atomic rename, so a
        kill at any point leaves either the old or the new block, never none."""
        with self.lock():
            old, state = self.read_state(block.id, lambda n: memoryview(bytearray(n)))
            if old.state_digest != block.state_digest or old.id != block.id:
                raise ConfigError("set_manifest may not change a block's id or state")
            self._write(block, state)

    # ------------------------------------------------------------------ read
    def read_manifest(self, path: Path) -> Block:
        """The manifest of a block file, with header, trailer and padding checked."""
        with open(path, "rb") as f:
            return _read_head(f, str(path), path.stem)[0]

    def read_state(self, block_id: str, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """Read a block's state into ``buffer(n)`` and check it; raise before anything is returned.

        Checks, in order: header and size (truncation), trailer over header+manifest, manifest id,
        fingerprint (if given), then the BLAKE3 digest of the state bytes (or, for a file version
        already verified in this process, the xxh3-128 of the verified bytes: :func:`read_block_file`).
        ``timings`` (optional) gets ``read_ms`` / ``check_ms`` added.
        """
        bid = self.resolve(block_id)
        path = self.path_of(bid)
        try:
            return read_block_file(path, buffer, expect_id=bid, fingerprint=fingerprint, timings=timings)
        except FileNotFoundError as exc:
            raise BlockNotFound(f"block {bid[:12]} is indexed but its file {path} is missing; "
                                "run `graftmem doctor` to reconcile") from exc
