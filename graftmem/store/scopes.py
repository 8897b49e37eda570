"""Who a block belongs to, and what happened to it: the scope and history tables of a home.

A block is content-addressed: two users who learn the same text share one block (one prefill, one
file). Ownership is therefore a relation, not a field of the block: a row (block, user, agent, session)
per owner, so that ``get_all(user_id="alice")`` lists exactly what alice learned even when bob learned
the same text, and forgetting a block for alice leaves it to bob. The history is an append-only log of
what was done to each block (learned, learned again, labels changed, verified, deleted), the
``history()`` verb that agent developers know from mem0.

Kept in its own SQLite file (``scopes.sqlite``) beside the block index: the block index is rebuilt from
the block files when they disagree, and scopes are not in the block files (they are not content).

Scopes live inside a tenant (``graftmem serve --api-key-file``): each row records the tenant that
wrote it (``''``: the SDK, the CLI or a server without tenants, the operator's trust domain), so tenant
B's ``user_id="alice"`` is not tenant A's, whatever ids either passes. ``tenant=None`` on a read is the
operator's view: every tenant's rows.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from ..core.blocks import HistoryEvent, Scope
from ..core.errors import StoreError, StoreFull
from .home import Home
from .sqlite import connect, transaction

__all__ = ["ScopeIndex"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS scopes (
    block_id   TEXT NOT NULL,
    user_id    TEXT NOT NULL DEFAULT '',
    agent_id   TEXT NOT NULL DEFAULT '',
    session_id TEXT NOT NULL DEFAULT '',
    added_at   REAL NOT NULL,
    tenant     TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (block_id, user_id, agent_id, session_id, tenant)
);
CREATE INDEX IF NOT EXISTS scopes_user ON scopes(user_id);
CREATE TABLE IF NOT EXISTS history (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    block_id TEXT NOT NULL,
    event    TEXT NOT NULL,
    at       REAL NOT NULL,
    details  TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS history_block ON history(block_id);
"""


class ScopeIndex:
    """Scopes and history of the blocks of the home at ``root``; safe for threads and processes."""

    def __init__(self, root: Path, *, timeout: float = 30.0, read_only: bool = False) -> None:
        self.path = Home(root).scopes
        self._lock = threading.Lock()
        try:
            self._db = connect(self.path, timeout=timeout, read_only=read_only, setup=_setup)
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(scopes)")}
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the scope index {self.path}: {exc}") from exc
        #: a read-only index written before tenants has no tenant column: its rows are all the operator's
        self._tenant_col = "tenant" if "tenant" in cols or not cols else "''"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
        try:
            with self._lock:
                with transaction(self._db):  # a failed COMMIT (disk full) stays the error raised
                    self._db.executemany(sql, list(rows))
        except sqlite3.OperationalError as exc:
            if "full" in str(exc).lower():
                raise StoreFull(f"disk full while writing {self.path}: free space and retry") from exc
            raise StoreError(f"cannot write {self.path}: {exc}") from exc

    # ------------------------------------------------------------------ scopes
    def add(self, block_id: str, scope: Scope, tenant: Optional[str] = None) -> None:
        """Record that ``scope`` of ``tenant`` (None: the operator's) owns ``block_id`` (idempotent). An
        empty scope records nothing."""
        if scope.empty:
            return
        self._write("INSERT OR IGNORE INTO scopes (block_id, user_id, agent_id, session_id, added_at, tenant) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [(block_id, scope.user_id or "", scope.agent_id or "", scope.session_id or "", time.time(),
                      tenant or "")])

    def remove(self, block_id: str, scope: Optional[Scope] = None, tenant: Optional[str] = None) -> int:
        """Forget ``block_id`` for ``scope`` (every field given must match) of ``tenant`` (None: of every
        tenant), or for everyone; returns the number of owners left."""
        if scope is None or scope.empty:
            self._write("DELETE FROM scopes WHERE block_id = ?", [(block_id,)])
        else:
            where, args = self._where(scope, tenant)
            self._write(f"DELETE FROM scopes WHERE block_id = ? AND {where}", [(block_id, *args)])
        return len(self.owners(block_id))

    def _where(self, scope: Scope, tenant: Optional[str] = None) -> tuple[str, list[str]]:
        conds, args = [], []
        for col in ("user_id", "agent_id", "session_id"):
            val = getattr(scope, col)
            if val is not None:
                conds.append(f"{col} = ?")
                args.append(val)
        if tenant is not None:
            conds.append(f"{self._tenant_col} = ?")
            args.append(tenant)
        return " AND ".join(conds) or "1", args

    def blocks_of(self, scope: Scope, tenant: Optional[str] = None) -> set[str]:
        """The ids of the blocks owned within ``scope`` (each given field must match) by ``tenant``
        (``''``: the operator's own rows; None: every tenant's, the operator's view)."""
        where, args = self._where(scope, tenant)
        with self._lock:
            return {r[0] for r in self._db.execute(f"SELECT DISTINCT block_id FROM scopes WHERE {where}", args)}

    def owners(self, block_id: str, tenant: Optional[str] = None) -> list[Scope]:
        """The scopes that own ``block_id``, oldest first: ``tenant``'s rows (``''``: the operator's own),
        or every tenant's (None: the operator's view)."""
        where, args = (f" AND {self._tenant_col} = ?", [tenant]) if tenant is not None else ("", [])
        with self._lock:
            rows = self._db.execute(f"SELECT user_id, agent_id, session_id FROM scopes WHERE block_id = ?{where} "
                                    "ORDER BY added_at", (block_id, *args)).fetchall()
        return [Scope(user_id=u or None, agent_id=a or None, session_id=s or None) for u, a, s in rows]

    # ------------------------------------------------------------------ history
    def record(self, block_id: str, event: str, details: Optional[Mapping[str, Any]] = None) -> None:
        self._write("INSERT INTO history (block_id, event, at, details) VALUES (?, ?, ?, ?)",
                    [(block_id, event, time.time(), json.dumps(dict(details or {}), default=str, sort_keys=True))])

    def history(self, block_id: str) -> list[HistoryEvent]:
        with self._lock:
            rows = self._db.execute("SELECT seq, event, at, details FROM history WHERE block_id = ? ORDER BY seq",
                                    (block_id,)).fetchall()
        return [HistoryEvent(seq=seq, block_id=block_id, event=ev, at=at, details=json.loads(d))
                for seq, ev, at, d in rows]

    def reset(self) -> None:
        self._write("DELETE FROM scopes", [()])


def _setup(db: sqlite3.Connection) -> None:
    _migrate(db)
    db.executescript(_SCHEMA)


def _migrate(db: sqlite3.Connection) -> None:
    """An index written before tenants: its ``scopes`` table gets the ``tenant`` column (in the primary
    key, so that two tenants' identical scopes are two rows), every old row the operator's (``''``)."""
    cols = {r[1] for r in db.execute("PRAGMA table_info(scopes)")}
    if not cols or "tenant" in cols:
        return
    with transaction(db):
        if "tenant" in {r[1] for r in db.execute("PRAGMA table_info(scopes)")}:  # another process did it
            return
        db.execute("ALTER TABLE scopes RENAME TO scopes_before_tenants")
        db.execute("DROP INDEX IF EXISTS scopes_user")
        db.execute(_SCHEMA.split(";")[0])
        db.execute("INSERT INTO scopes (block_id, user_id, agent_id, session_id, added_at, tenant) "
                   "SELECT block_id, user_id, agent_id, session_id, added_at, '' FROM scopes_before_tenants")
        db.execute("DROP TABLE scopes_before_tenants")
