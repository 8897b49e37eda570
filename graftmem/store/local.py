"""The local block store: block files in a directory, an index, a lock (paths from `.home`).

Durability rules (the opposite of each LMCache failure): block files are written to a temp file,
fsync'ed, renamed into place and the directory fsync'ed; the index is a transactional SQLite database;
the files are the truth and the index is reconciled with them whenever the store opens, so a process
killed between the rename and the index insert, or between a delete's unlink and the row removal,
leaves nothing inconsistent after the next open. Every state read checks its digest before the bytes can
reach llama.cpp (BLAKE3 on a file version's first read in a process, then the xxh3-128 of the verified
bytes: `read_block_file`).

Provenance (docs/security.md) is local knowledge and lives in the index, never in a block file: a
block written by [`Store.put()`][graftmem.Store.put] is ``local``; an admitted foreign block carries what its admission
proved (``rederived``, ``signed:<key>``) or ``unverified``. A new block's row is inserted in the same
SQLite transaction that renames its file into place, so a file without a row can only come from a
process killed between the rename and the commit, a copy by hand or an older graftmem: reconcile indexes
such files as ``unverified`` (and rows that predate the provenance column are migrated as
``unverified`` too), because nothing this store witnessed vouches for their state. ``learn`` of the
same text replaces such a block with its own prefill; ``Memory.rederive`` upgrades it.

A store opens whatever is in its directory: reconcile opens regular files only (``O_NONBLOCK |
O_NOFOLLOW`` then ``fstat``), moves everything under ``blocks/`` it cannot read into ``quarantine/``
with a log line and keeps going; a home it cannot write opens read-only (an in-memory copy of the
index) where reading works and every mutation raises `StoreReadOnly`.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import io
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, Sequence

from ..core.blocks import (PROVENANCE_LOCAL, PROVENANCE_UNVERIFIED, Block, Fingerprint, StoreStats,
                           provenance_is_trusted)
from ..core.errors import (BlockCorrupted, BlockNotFound, ConfigError, StoreError, StoreFull, StoreLocked,
                           StoreReadOnly)
from ..core.identity import check_block_id, incompatibility, salts_of
from .home import BLOCK_SUFFIX, Home
from .sqlite import connect, marks, transaction
from ..core.format import (HEADER, TRAILER_LEN, check_algorithm, parse_header, parse_manifest, state_hasher,
                           write_block)

__all__ = ["Store", "default_home", "read_block_file", "atomic_file", "open_regular", "TEMP_MAX_AGE"]

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
    manifest TEXT NOT NULL,
    provenance TEXT NOT NULL DEFAULT 'unverified',
    labels_trusted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS blocks_kind ON blocks(kind);
"""
#: columns added after the first release, with the value rows written before them get
_MIGRATIONS = (("provenance", "TEXT NOT NULL DEFAULT 'unverified'"),
               ("labels_trusted", "INTEGER NOT NULL DEFAULT 0"))
_COLUMNS = ("id, name, kind, n_tokens, state_size, file_size, created_at, fp_digest, manifest, provenance, "
            "labels_trusted")
#: A temp file older than this is removed whatever pid its name carries (a pid can be reused) and
#: whether or not its name parses; a block write takes seconds, not an hour.
TEMP_MAX_AGE = 3600.0
_BLOCK_NAME = re.compile(r"([0-9a-f]{64})\.gmb")
_SQLITE_FULL = 13
_SQLITE_CORRUPT = 11
_SQLITE_IOERR = 10
_SQLITE_NOTADB = 26
_READONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def default_home() -> Path:
    """``$GRAFTMEM_HOME`` or the platform's user data directory for graftmem."""
    env = os.environ.get("GRAFTMEM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("graftmem"))


def checked_id(block_id: object) -> bool:
    """Whether ``block_id`` is a whole block id (True) or a usable prefix of one (False); anything else
    is refused: not hex, too long (`BlockNotFound`), not a str or under 4 characters (`ConfigError`)."""
    if not isinstance(block_id, str):
        raise ConfigError(f"a block id is a str of lowercase hex, got {type(block_id).__name__}")
    if not block_id or any(c not in "0123456789abcdef" for c in block_id):
        raise BlockNotFound(f"{block_id[:80]!r} is not a block id (lowercase hex)")
    if len(block_id) > 64:
        raise BlockNotFound(f"{block_id[:80]!r} is longer than a block id (64 hex characters)")
    if len(block_id) < 4:
        raise ConfigError(f"block id prefix {block_id!r} is too short: give at least 4 characters")
    return len(block_id) == 64


def deletion_order(bid: str, children: Callable[[str], list[str]], *, cascade: bool) -> list[str]:
    """``bid`` and every block chained on it, parents first (delete in reverse: a kill leaves no
    orphan). Without ``cascade``, a block with children is refused: their states are rebuilt from its
    bytes. Shared by the local and the fleet store."""
    order: list[str] = []
    todo = [bid]
    while todo:
        cur = todo.pop()
        order.append(cur)
        todo.extend(children(cur))
    if len(order) > 1 and not cascade:
        kids = children(bid)
        raise ConfigError(
            f"block {bid[:12]} has {len(kids)} chained child block(s) "
            f"({', '.join(k[:12] for k in kids)}) whose states are rebuilt from its bytes; "
            f"delete them first or pass cascade=True to delete all {len(order) - 1} descendants")
    return order


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_new(tmp: Path) -> BinaryIO:
    """Create ``tmp`` (a writer's temp file, named for its process and thread) for writing. A file of that
    name is a leftover of a write of this same process and thread that failed and could not clean up
    (the thread id is reused by a later thread): it is removed and the name taken, rather than failing
    every later write of that block with "File exists"."""
    try:
        return open(tmp, "xb")
    except FileExistsError:
        log.warning("removing a temp file left by a failed write: %s", tmp.name)
        tmp.unlink(missing_ok=True)
        return open(tmp, "xb")


@contextlib.contextmanager
def atomic_file(path: Path, tmp: Optional[Path] = None) -> Iterator[BinaryIO]:
    """A new file for ``path``, all or nothing: written to ``tmp`` (default: a hidden name beside it),
    fsync'ed, renamed over ``path``, its directory fsync'ed. On any error the temp file is removed and
    ``path`` still holds its old content (or nothing); the error propagates for the caller to name."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open_new(tmp) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pid_alive(pid: int) -> bool:
    if pid <= 0:  # 0 and -1 would address process groups, not a writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_regular(path: Path) -> io.FileIO:
    """Open ``path`` for reading only if it is a regular file: ``O_NONBLOCK`` (a FIFO cannot hang the
    open), ``O_NOFOLLOW`` (a symlink is refused, whatever it points at), then ``fstat`` + ``S_ISREG``
    on the open descriptor (no race between the check and the read). Anything else is
    [`BlockCorrupted`][graftmem.BlockCorrupted]; a missing file is ``FileNotFoundError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            raise BlockCorrupted(f"{path}: not a regular file (a link, directory or device); refusing "
                                 "to read it", path=str(path)) from exc
        raise BlockCorrupted(f"{path}: cannot be opened: {exc}", path=str(path)) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BlockCorrupted(f"{path}: not a regular file (a FIFO, socket, device or directory); "
                                 "refusing to read it", path=str(path))
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _sql_error(exc: sqlite3.Error, home: Path, doing: str) -> StoreError:
    """Our error for a SQLite failure: a full disk (SQLITE_FULL) is [`StoreFull`][graftmem.StoreFull]."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code == _SQLITE_FULL or "full" in str(exc).lower():
        return StoreFull(f"disk full while {doing} in {home}; nothing was written: free space and retry")
    if "readonly" in str(exc).lower() or "read-only" in str(exc).lower():
        return StoreReadOnly(f"the index of {home} is read-only ({exc}) while {doing}")
    return StoreError(f"the index of {home} failed while {doing}: {exc}")


def _disk_full(path: Path, slack: int = 256 << 10) -> bool:
    """Whether the file system holding ``path`` has (almost) no space left for this user."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < slack


def _os_error(exc: OSError, home: Path, doing: str) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"disk full while {doing} in {home}; nothing was written: free space and retry")
    if exc.errno == errno.EROFS:
        return StoreReadOnly(f"{home} is on a read-only file system ({doing})")
    return StoreError(f"{doing} in {home} failed: {exc}")


def block_from_row(manifest: str, provenance: str, labels_trusted: int) -> Block:
    """A block from an index row: its manifest (JSON) with the provenance and label trust the index
    records beside it (never in the file). Shared by the local and the fleet index."""
    return Block.model_validate_json(manifest).model_copy(
        update={"provenance": provenance, "labels_trusted": bool(labels_trusted)})


def check_head(read: Callable[[int, int], bytes], size: int, *, where: str,
               expect_id: str) -> tuple[Block, int, int]:
    """The manifest of a block file of ``size`` bytes and where its state lies (offset, length), with
    header, trailer and padding checked and the manifest's id and size matched against the file.
    ``read(offset, n)`` returns the file's bytes there (fewer at its end): a file on disk, or the
    parts of an object downloaded into memory (`graftmem.store.fleet`)."""
    _, soff, slen = parse_header(read(0, HEADER.size), where=where, file_size=size)
    block = parse_manifest(read(0, soff), read(soff + slen, TRAILER_LEN), where=where)
    if block.id != expect_id or block.state_size != slen:
        raise BlockCorrupted(f"{where}: manifest id/size do not match the file", path=where)
    return block, soff, slen


def _read_head(f: BinaryIO, where: str, expect_id: str) -> tuple[Block, int, int]:
    """`check_head` of an open block file."""
    def read(offset: int, n: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    return check_head(read, os.fstat(f.fileno()).st_size, where=where, expect_id=expect_id)


def read_block_file(path: Path, buffer: Callable[[int], memoryview], *, expect_id: str,
                    fingerprint: Optional[Fingerprint] = None,
                    timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
    """Read the state of the block file at ``path`` into ``buffer(n)`` and check it (see
    [`Store.read_state()`][graftmem.Store.read_state]); also for files not in a store yet, such as a staged import.

    The first read of a file version in this process checks the state's BLAKE3 digest and remembers
    the xxh3-128 of the checked bytes; later reads of the same version (same inode, size, mtime and
    ctime) check that xxh3-128 while reading instead (`graftmem.store.verified`, docs/format.md:
    what each digest defends against). Either way a changed byte is refused before it is returned.
    ``timings``, if given, gets ``read_ms`` and ``check_ms`` added (accumulated over chained reads).
    """
    from . import verified  # local import: keeps this change inside the reader

    where = str(path)
    t0 = time.perf_counter()
    with open_regular(path) as f:
        block, soff, slen = _read_head(f, where, expect_id)
        if fingerprint is not None:
            err = incompatibility(block, fingerprint)
            if err is not None:
                raise err
        check_algorithm(block.state_digest, where=where)
        key = verified.file_version(f.fileno(), block.state_digest)
        known = verified.recall(key)
        view = buffer(slen)
        t1 = time.perf_counter()
        f.seek(soff)
        # the chunked xxh3-128 while reading, on every core: checked now if this version passed
        # BLAKE3 before, else remembered once BLAKE3 has passed; a first read feeds BLAKE3 as the
        # chunks land (no second pass over the bytes)
        strong = None if known is not None else state_hasher(slen)
        got, seen = verified.read_hashed(f, view, strong)
        if got < slen:
            raise BlockCorrupted(f"{where}: truncated state ({got} of {slen} bytes)", path=where)
    t2 = time.perf_counter()
    if known is not None:
        if seen != known:
            verified.forget(key)
            raise BlockCorrupted(f"{where}: state changed since it was verified: xxh3-128 expected "
                                 f"{known.hex()}, actual {seen.hex()}", path=where,
                                 expected=known.hex(), actual=seen.hex())
    elif strong is not None:  # the first read of this version: BLAKE3, fed while reading
        actual = "blake3:" + strong.hexdigest()
        if actual != block.state_digest:
            raise BlockCorrupted(f"{where}: state digest mismatch: expected {block.state_digest}, "
                                 f"actual {actual}", path=where, expected=block.state_digest, actual=actual)
        verified.remember(key, seen)
    if timings is not None:
        t3 = time.perf_counter()
        timings["read_ms"] = timings.get("read_ms", 0.0) + (t2 - t1) * 1e3
        timings["check_ms"] = timings.get("check_ms", 0.0) + ((t1 - t0) + (t3 - t2)) * 1e3
    return block, view


class Store:
    """A directory of block files plus a SQLite index, safe for several threads and processes.

    A home that cannot be written (read-only mount, no permission) opens read-only: ``read_only`` is
    True, the index is an in-memory copy reconciled with the files, and mutations raise
    `StoreReadOnly`.
    """

    #: blocks live here only: no other worker shares them (see `graftmem.store.BlockStore`)
    remote = False
    #: other processes' changes are seen at once (SQLite's ``data_version``): nothing to poll
    poll_interval = 0.0

    def __init__(self, home: str | os.PathLike[str] | None = None, *, lock_timeout: float = 30.0) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.layout = Home(self.home)  #: every path under the home
        self.lock_timeout = lock_timeout
        self.read_only = False
        try:
            self.layout.blocks.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as exc:
            if exc.errno in _READONLY_ERRNOS and self.home.is_dir():
                self.read_only = True
            else:
                raise StoreError(f"cannot create the store at {self.home}: {exc}") from exc
        self._tlock = threading.RLock()
        self._lock_depth = 0
        self._index_set_aside = False
        self._full = False
        # under the store's flock: two processes opening a new store at once would race on creating
        # the index (SQLite answers the loser's switch to WAL "database is locked" without waiting)
        with self.lock():
            self._db = self._open_index()
        self.reconcile()

    def _open_index(self) -> sqlite3.Connection:
        def setup(db: sqlite3.Connection) -> None:
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            self._migrate(db)

        if not self.read_only:
            try:
                return connect(self.layout.index, timeout=self.lock_timeout, setup=setup)
            except sqlite3.DatabaseError as exc:
                code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF  # primary code of an extended one
                if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) and not self._index_set_aside:
                    # the files are the truth: set the damaged index aside and rebuild it from them
                    # (every block unverified: the provenance it recorded is lost with it)
                    self._set_index_aside(f"{exc}")
                    return self._open_index()
                err = _sql_error(exc, self.home, "opening the index")
                if code in (_SQLITE_IOERR, _SQLITE_FULL) and _disk_full(self.home):
                    # SQLite cannot even create its WAL index on a full disk: open read-only, so that
                    # reading still works; writes raise StoreFull (not a raw disk I/O error)
                    err = StoreFull(f"disk full: the index of {self.home} cannot be opened for writing")
                    self._full = True
                elif not isinstance(err, StoreReadOnly):
                    raise err from exc
                self.read_only = True
        log.warning("the store at %s is not writable%s: opened read-only (listing, reading, asking and "
                    "verifying work; learning and importing do not)", self.home,
                    " (disk full)" if self._full else "")
        db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        if self.layout.index.is_file():
            try:
                src = sqlite3.connect(f"file:{self.layout.index}?mode=ro&immutable=1", uri=True)
                try:
                    src.backup(db)
                finally:
                    src.close()
            except sqlite3.Error as exc:
                log.warning("cannot read the index of %s (%s); listing the block files instead", self.home, exc)
        db.executescript(_SCHEMA)
        self._migrate(db)
        return db

    def _set_index_aside(self, why: str) -> None:
        self._index_set_aside = True
        q = self.layout.quarantine
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}"
        q.mkdir(parents=True, exist_ok=True)
        for suffix in ("", "-wal", "-shm", "-journal"):
            src = self.layout.index.with_name(self.layout.index.name + suffix)
            if os.path.lexists(src):
                os.rename(src, q / f"{src.name}.{stamp}")
        log.warning("store %s: the index could not be read (%s); moved it to %s and rebuilt it from the "
                    "block files (every block now unverified: re-derive or learn them again)", self.home,
                    why, q)

    def _migrate(self, db: sqlite3.Connection) -> None:
        have = {r[1] for r in db.execute("PRAGMA table_info(blocks)")}
        for col, decl in _MIGRATIONS:
            if col not in have:
                db.execute(f"ALTER TABLE blocks ADD COLUMN {col} {decl}")
                log.info("index of %s migrated: column %s added (existing blocks: %s)", self.home, col,
                         decl.rsplit(" ", 1)[-1])

    def close(self) -> None:
        with self._tlock:
            self._db.close()

    def _writable(self, doing: str) -> None:
        if self._full:
            raise StoreFull(f"disk full: the store at {self.home} was opened read-only because its index "
                            f"could not be opened for writing (cannot {doing}); free space and reopen it")
        if self.read_only:
            raise StoreReadOnly(f"the store at {self.home} is read-only (cannot {doing}): open a writable "
                                "home, or copy it somewhere writable")

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive inter-process lock for mutations (flock on ``home/lock``).

        Re-entrant within a thread: flock locks belong to an open file description, so a nested
        call opening a second descriptor would wait on itself; nested calls reuse the held lock.
        A read-only store has nothing to serialize: the lock is a thread lock only."""
        with self._tlock:
            if self._lock_depth or self.read_only:
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

    def _quarantine(self, path: Path, why: str) -> None:
        """Move an unreadable entry out of ``blocks/`` (kept for inspection), with a log line."""
        if self.read_only:
            log.warning("store %s: ignoring %s (%s); read-only, left in place", self.home, path, why)
            return
        rel = path.relative_to(self.layout.blocks).as_posix().replace("/", "_")
        dst = self.layout.quarantine / f"{rel}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}"
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, dst)
        except OSError as exc:
            log.warning("store %s: cannot quarantine %s (%s): %s; ignoring it", self.home, path, why, exc)
            return
        log.warning("store %s: moved %s to %s: %s", self.home, path, dst, why)

    def _scan(self) -> tuple[dict[str, Path], int]:
        """The block files (regular files named ``<id>.gmb`` in ``blocks/<id[:2]>/``) and how many
        other entries were quarantined. Stale temp files are removed on the way."""
        out: dict[str, Path] = {}
        moved = 0
        try:
            top = list(os.scandir(self.layout.blocks))
        except OSError as exc:
            raise _os_error(exc, self.home, "listing blocks/") from exc
        for sub in top:
            if sub.is_symlink() or (not sub.is_dir(follow_symlinks=False) and sub.name.endswith(SUFFIX)):
                self._quarantine(Path(sub.path), "not a block directory (a link, or a block outside its "
                                                 "directory)")
                moved += 1
                continue
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError as exc:
                self._quarantine(Path(sub.path), f"cannot be listed: {exc}")
                moved += 1
                continue
            for e in entries:
                p = Path(e.path)
                if e.name.startswith("."):
                    if e.name.endswith(".tmp"):
                        moved += self._clean_temp(p, e)
                    continue
                if not e.name.endswith(SUFFIX):
                    continue
                m = _BLOCK_NAME.fullmatch(e.name)
                if m is None or m.group(1)[:2] != sub.name:
                    self._quarantine(p, "not named <id>.gmb in its blocks/<id[:2]> directory")
                    moved += 1
                elif not e.is_file(follow_symlinks=False):
                    self._quarantine(p, "not a regular file (a directory, link, FIFO or device)")
                    moved += 1
                else:
                    out[m.group(1)] = p
        return out, moved

    def _clean_temp(self, p: Path, e: os.DirEntry) -> int:
        """Remove a writer's temp file if its writer is dead (pid in the name), or by age when the pid
        may have been reused or the name does not parse; 1 if removed."""
        if self.read_only:
            return 0
        parts = e.name.split(".")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            pid = -1
        try:
            age = time.time() - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            age = 0.0
        stale = age > TEMP_MAX_AGE or (pid > 0 and pid != os.getpid() and not pid_alive(pid))
        if not stale:
            return 0
        try:
            if e.is_dir(follow_symlinks=False):
                self._quarantine(p, "a directory named like a temp file")
            else:
                p.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("store %s: cannot remove stale temp file %s: %s", self.home, p, exc)
            return 0
        return 1

    # ------------------------------------------------------------------ index
    def _insert(self, block: Block, file_size: int, provenance: str, labels_trusted: bool) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO blocks ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (block.id, block.name, block.kind, block.n_tokens, block.state_size, file_size,
             block.created_at.isoformat(), block.fingerprint.digest(), block.model_dump_json(),
             provenance, int(bool(labels_trusted))))

    @staticmethod
    def _row(manifest: str, provenance: str, labels_trusted: int) -> Block:
        return block_from_row(manifest, provenance, labels_trusted)

    def reconcile(self) -> dict[str, int]:
        """Make the index agree with the files: add unindexed files (as ``unverified``), drop rows
        without a file, remove temp files left by dead writers, quarantine what cannot be read. Runs
        on every open; cheap (one directory walk); never fails because of what is in ``blocks/``."""
        added = dropped = 0
        with self.lock():
            files, moved = self._scan()
            try:
                rows = {r[0] for r in self._db.execute("SELECT id FROM blocks")}
                for bid in rows - files.keys():
                    self._db.execute("DELETE FROM blocks WHERE id=?", (bid,))
                    dropped += 1
                for bid in sorted(files.keys() - rows):
                    try:
                        # a file dropped in the store is adopted only if its id is its content address
                        block = check_block_id(self.read_manifest(files[bid]), str(files[bid]))
                        size = files[bid].stat().st_size
                    except BlockCorrupted as exc:
                        self._quarantine(files[bid], f"unreadable block file: {exc}")
                        moved += 1
                        continue
                    except OSError as exc:  # vanished meanwhile, or unreadable
                        log.warning("store %s: skipping %s: %s", self.home, files[bid], exc)
                        continue
                    self._insert(block, size, PROVENANCE_UNVERIFIED, False)
                    added += 1
            except sqlite3.Error as exc:
                raise _sql_error(exc, self.home, "reconciling the index") from exc
        if added or dropped or moved:
            log.info("store %s reconciled: %d added (unverified), %d dropped, %d entries removed or "
                     "quarantined", self.home, added, dropped, moved)
        # temp files removed and entries quarantined are counted together ("set aside")
        return {"added": added, "dropped": dropped, "set_aside": moved}

    def resolve(self, block_id: str) -> str:
        """Full id for an id or a unique prefix of at least 4 hex characters."""
        if checked_id(block_id):
            return block_id
        with self._tlock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM blocks WHERE id >= ? AND id < ? LIMIT 2", (block_id, block_id + "g"))]
        if not ids:
            raise BlockNotFound(f"no block {block_id!r} in the store at {self.home}")
        if len(ids) > 1:
            raise ConfigError(f"block id prefix {block_id!r} is ambiguous: give more characters")
        return ids[0]

    def get(self, block_id: str) -> Block:
        """The block (its manifest from the index), with this store's ``provenance`` filled in."""
        bid = self.resolve(block_id)
        with self._tlock:
            row = self._db.execute("SELECT manifest, provenance, labels_trusted FROM blocks WHERE id=?",
                                   (bid,)).fetchone()
        if row is None:
            raise BlockNotFound(f"no block {block_id!r} in the store at {self.home}")
        return self._row(*row)

    def provenance(self, block_id: str) -> str:
        """This store's provenance of a block (see `Provenance`)."""
        return self.get(block_id).provenance or PROVENANCE_UNVERIFIED

    def set_provenance(self, block_id: str, provenance: str, *, labels_trusted: Optional[bool] = None) -> None:
        """Record what was proved about a block here (an index update; the file is untouched)."""
        self._writable("record a provenance")
        bid = self.resolve(block_id)
        with self.lock():
            try:
                if labels_trusted is None:
                    self._db.execute("UPDATE blocks SET provenance=? WHERE id=?", (provenance, bid))
                else:
                    self._db.execute("UPDATE blocks SET provenance=?, labels_trusted=? WHERE id=?",
                                     (provenance, int(labels_trusted), bid))
            except sqlite3.Error as exc:
                raise _sql_error(exc, self.home, f"recording block {bid[:12]}'s provenance") from exc

    def contains(self, block_id: str) -> bool:
        with self._tlock:
            return self._db.execute("SELECT 1 FROM blocks WHERE id=?", (block_id,)).fetchone() is not None

    def list(self, *, kind: str | None = None) -> list[Block]:
        q = ("SELECT manifest, provenance, labels_trusted FROM blocks" + (" WHERE kind=?" if kind else "")
             + " ORDER BY created_at, id")
        with self._tlock:
            rows = self._db.execute(q, (kind,) if kind else ()).fetchall()
        return [self._row(*r) for r in rows]

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

    def routing_rows(self, *, exclude_kinds: Sequence[str] = ()) -> builtins.list[tuple[str, str, str, str | None]]:
        """``(id, name, fingerprint digest, metadata.when_to_use)`` of every block not of ``exclude_kinds``
        that may steer routing: its provenance is not ``unverified`` and its labels were given here or
        signed by a trusted key (a foreign label could say "weather report" over the refund manual's
        tokens). Read from the index without parsing manifests (the router syncs from this)."""
        with self._tlock:
            return self._db.execute(
                "SELECT id, name, fp_digest, json_extract(manifest, '$.metadata.when_to_use') FROM blocks "
                f"WHERE kind NOT IN ({marks(len(exclude_kinds))}) AND provenance != ? "
                "AND labels_trusted = 1", (*exclude_kinds, PROVENANCE_UNVERIFIED)).fetchall()

    # ------------------------------------------------------------------ write / delete
    def put(self, block: Block, state: memoryview | bytes, *, replace: bool = False,
            provenance: str = PROVENANCE_LOCAL, labels_trusted: bool = True) -> Block:
        """Store a block atomically; a block already present (same content id) is returned as is,
        unless ``replace`` (used to overwrite an ``unverified`` block with this engine's own state).
        The returned block carries its provenance (``local`` for what was written here)."""
        if block.state_size != len(state):
            raise ConfigError(f"block says {block.state_size} state bytes, got {len(state)}")
        self._writable(f"write block {block.short_id}")
        if not replace and self.contains(block.id) and self.path_of(block.id).exists():
            return self.get(block.id)
        # the file first, outside the lock: its temp name is this thread's own, and the copy of the
        # state is the slow part (a paced writer, `graftmem.core.format.paced`, waits inside it; under
        # the lock it held up every reader of the index, a request's prefix lookup included)
        tmp, size = self._write_temp(block, state)
        try:
            with self.lock():
                if not replace and self.path_of(block.id).exists() and self.contains(block.id):
                    return self.get(block.id)
                if block.parent is not None and not self.contains(block.parent):
                    raise BlockNotFound(f"block {block.short_id} is chained on {block.parent[:12]}, which "
                                        f"is not in the store at {self.home} (deleted meanwhile?)")
                self._commit(block, tmp, size, provenance=provenance, labels_trusted=labels_trusted)
        finally:
            tmp.unlink(missing_ok=True)
        return block.model_copy(update={"provenance": provenance, "labels_trusted": labels_trusted})

    def _write(self, block: Block, state: memoryview | bytes, *, provenance: str, labels_trusted: bool) -> None:
        """Write the block file (temp, fsync) and commit it (`_commit`). The caller holds the lock."""
        tmp, size = self._write_temp(block, state)
        try:
            self._commit(block, tmp, size, provenance=provenance, labels_trusted=labels_trusted)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_temp(self, block: Block, state: memoryview | bytes) -> tuple[Path, int]:
        """The whole block file under a temp name of this process and thread, fsynced; its size. A
        failure removes it."""
        path = self.path_of(block.id)
        tmp = path.parent / f".{block.id}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open_new(tmp) as f:
                size = write_block(f, block, state)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, self.home, f"writing block {block.short_id}") from exc
        except BaseException:  # not only a disk error: never leave the temp file behind
            tmp.unlink(missing_ok=True)
            raise
        return tmp, size

    def _commit(self, block: Block, tmp: Path, size: int, *, provenance: str, labels_trusted: bool) -> None:
        """In ONE index transaction, insert the block's row, rename its temp file over any old file and
        fsync the directory; the commit comes last. A failure anywhere (the rename or SQLite's commit)
        removes what this call put in place, so a new block is never left behind as a file without a
        row (which would come back, unverified, on the next open). The caller holds the lock and
        removes the temp file afterwards."""
        path = self.path_of(block.id)
        doing = f"writing block {block.short_id}"
        existed = os.path.lexists(path)
        renamed = False
        try:
            try:
                with transaction(self._db):
                    self._insert(block, size, provenance, labels_trusted)
                    os.replace(tmp, path)
                    renamed = True
                    fsync_path(path.parent)
            except BaseException:
                if renamed and not existed:
                    path.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise _os_error(exc, self.home, doing) from exc
        except sqlite3.Error as exc:
            raise _sql_error(exc, self.home, doing) from exc

    def children(self, block_id: str) -> builtins.list[str]:
        """Ids of the blocks chained directly on ``block_id`` (their manifest's ``parent``)."""
        with self._tlock:
            return [r[0] for r in self._db.execute(
                "SELECT id FROM blocks WHERE json_extract(manifest, '$.parent') = ? ORDER BY id", (block_id,))]

    def delete(self, block_id: str, *, cascade: bool = False) -> builtins.list[str]:
        """Delete a block; return the ids deleted. A block that other blocks are chained on is
        refused (their states are rebuilt from its bytes) unless ``cascade=True``, which deletes
        every descendant first, deepest first, under one lock."""
        bid = self.resolve(block_id)
        self._writable(f"delete block {bid[:12]}")
        with self.lock():
            order = deletion_order(bid, self.children, cascade=cascade)
            try:
                for cur in reversed(order):  # children before parents: a kill leaves no orphan
                    self.path_of(cur).unlink(missing_ok=True)
                    self._db.execute("DELETE FROM blocks WHERE id=?", (cur,))
            except OSError as exc:
                raise _os_error(exc, self.home, f"deleting block {bid[:12]}") from exc
            except sqlite3.Error as exc:  # the file is gone: the next open drops the row
                raise _sql_error(exc, self.home, f"deleting block {bid[:12]}") from exc
            return list(reversed(order))

    def adopt(self, files: builtins.list[tuple[Block, Path]]) -> builtins.list[str]:
        """Move already verified, fsync'ed block files (staged on this filesystem) into the store,
        all or none, under one lock; return the ids added. Each block's ``provenance`` and
        ``labels_trusted`` (set by the admission) go into its row; missing means ``unverified``.
        Blocks already present are skipped (their staged copy stays where it is). The rows are
        inserted and the files renamed inside one index transaction, the directories fsync'ed, then
        the commit; if anything fails, the files moved so far are removed again and the transaction
        rolled back, so the store is left as it was. Used by bundle import and pull, which verify
        before calling."""
        self._writable("import blocks")
        moved: list[tuple[Block, Path]] = []
        replaced: set[str] = set()  # an unverified block overwritten by its proved copy: not undone
        with self.lock():
            try:
                with transaction(self._db):
                    for block, src in files:
                        dst = self.path_of(block.id)
                        if dst.exists() and self.contains(block.id):
                            # present: kept, unless it is unverified and this copy was proved here
                            if not (provenance_is_trusted(block.provenance)
                                    and self.provenance(block.id) == PROVENANCE_UNVERIFIED):
                                continue
                            replaced.add(block.id)
                        dst.parent.mkdir(exist_ok=True)
                        self._insert(block, os.stat(src).st_size, block.provenance or PROVENANCE_UNVERIFIED,
                                     bool(block.labels_trusted))
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
            except BaseException as exc:
                for b, dst in moved:
                    if b.id not in replaced:
                        dst.unlink(missing_ok=True)
                if isinstance(exc, sqlite3.Error):
                    raise _sql_error(exc, self.home, "importing blocks") from exc
                raise
        return [b.id for b, _ in moved]

    def set_manifest(self, block: Block) -> None:
        """Rewrite a block's manifest (e.g. its verification record). The state bytes are read back,
        their digest re-checked, and the new file replaces the old one with one atomic rename, so a
        kill at any point leaves either the old or the new block, never none. Provenance is kept."""
        self._writable(f"rewrite block {block.short_id}")
        with self.lock():
            old, state = self.read_state(block.id, lambda n: memoryview(bytearray(n)))
            if old.state_digest != block.state_digest or old.id != block.id or salts_of(old) != salts_of(block):
                raise ConfigError("set_manifest may not change a block's id, the salts of its id or its state")
            cur = self.get(block.id)
            labels = block.labels_trusted if block.labels_trusted is not None else cur.labels_trusted
            self._write(block, state, provenance=cur.provenance or PROVENANCE_UNVERIFIED,
                        labels_trusted=bool(labels))

    # ------------------------------------------------------------------ read
    def read_manifest(self, path: Path) -> Block:
        """The manifest of a block file, with header, trailer and padding checked (regular files only)."""
        with open_regular(path) as f:
            return _read_head(f, str(path), path.stem)[0]

    def check_file(self, block_id: str) -> Block:
        """The manifest as the block's file holds it, with header, trailer and padding checked (the
        state is not read): what ``graftmem doctor`` asks of every block."""
        return self.read_manifest(self.path_of(self.resolve(block_id)))

    def read_state(self, block_id: str, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """Read a block's state into ``buffer(n)`` and check it; raise before anything is returned.

        Checks, in order: header and size (truncation), trailer over header+manifest, manifest id,
        fingerprint (if given), then the BLAKE3 digest of the state bytes (or, for a file version
        already verified in this process, the xxh3-128 of the verified bytes: `read_block_file()`).
        ``timings`` (optional) gets ``read_ms`` / ``check_ms`` added. The returned block carries this
        store's provenance.
        """
        bid = self.resolve(block_id)
        path = self.path_of(bid)
        try:
            block, view = read_block_file(path, buffer, expect_id=bid, fingerprint=fingerprint, timings=timings)
        except FileNotFoundError as exc:
            raise BlockNotFound(f"block {bid[:12]} is indexed but its file {path} is missing; "
                                "run `graftmem doctor` to reconcile") from exc
        except OSError as exc:
            raise _os_error(exc, self.home, f"reading block {bid[:12]}") from exc
        with self._tlock:
            row = self._db.execute("SELECT provenance, labels_trusted FROM blocks WHERE id=?", (bid,)).fetchone()
        if row is not None:
            block = block.model_copy(update={"provenance": row[0], "labels_trusted": bool(row[1])})
        return block, view

    # ------------------------------------------------------------------ sharing (nothing to share)
    # The verbs a fleet store offers to share with its other workers (`graftmem.store.BlockStore`).
    # A local store has no other workers: every block is here already, and a file or a routing row
    # made here is seen by every process on this machine through the home itself.
    def prefetch(self, block_ids: builtins.list[str]) -> builtins.list[Future]:
        """Nothing to bring in: every block of a local store is on this machine."""
        return []

    def get_vectors(self, space: str, names: builtins.list[str]) -> dict[str, Any]:
        """No other worker embedded anything for this store: always empty."""
        return {}

    def put_vectors(self, space: str, rows: dict[str, Any]) -> None:
        """No other worker to share routing rows with (the router's own index file holds them)."""

    def put_file(self, name: str, path: Path) -> None:
        """No other worker to share a file with (the page index in the home holds its rows)."""

    def list_files(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """No files shared by other workers: always empty."""
        return []

    def get_file(self, name: str, dest: Path) -> bool:
        """No files shared by other workers: always False."""
        return False
