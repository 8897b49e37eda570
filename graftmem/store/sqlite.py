"""One way to open and write graftmem's SQLite files: the store index, the scope index, the fleet
cache's index and the page index.

Why one place: each file was opened with its own copy of connect + WAL + schema, and written with its
own copy of ``BEGIN IMMEDIATE`` / ``COMMIT`` / ``ROLLBACK``. One copy let a failed ``ROLLBACK`` replace
the real error: when ``COMMIT`` fails on a full disk, SQLite may already have rolled the transaction
back, and the ``ROLLBACK`` that follows raises "cannot rollback - no transaction is active", which
turned a `StoreFull` (free space and retry) into a generic `StoreError` (issue 24). `transaction()`
never lets its own cleanup mask the cause.

Connections are opened in autocommit mode (``isolation_level=None``: the transactions are explicit),
usable from any thread (callers hold their own lock), with ``timeout`` as SQLite's busy timeout for
other processes' write locks.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["connect", "marks", "transaction"]


def connect(path: Path | str, *, timeout: float, read_only: bool = False,
            setup: Optional[Callable[[sqlite3.Connection], object]] = None) -> sqlite3.Connection:
    """Open ``path``: read-only (``mode=ro``: nothing written, no WAL switch), else in WAL mode (readers
    never wait for a writer) followed by ``setup(db)``, the caller's schema and migrations. The
    connection is closed again if any of that fails."""
    if read_only:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout, check_same_thread=False,
                               isolation_level=None)
    db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        if setup is not None:
            setup(db)
    except BaseException:
        db.close()
        raise
    return db


def marks(n: int) -> str:
    """SQL placeholders for ``n`` values of an ``IN (...)`` list; an empty list gives ``NULL``, which
    matches nothing (``IN ()`` is a syntax error in SQLite). Shared by the local and the fleet index."""
    return ",".join("?" * n) or "NULL"


@contextlib.contextmanager
def transaction(db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[sqlite3.Connection]:
    """``begin`` (default: take the write lock now, so a later write cannot fail on another writer),
    run the block, ``COMMIT``; on any exception, inside the block or from ``COMMIT`` itself, roll back
    and re-raise that exception: a failed ``ROLLBACK`` (nothing left to roll back) is ignored."""
    db.execute(begin)
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise
