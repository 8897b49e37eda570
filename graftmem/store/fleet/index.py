"""The fleet store's index: a local SQLite mirror of the bucket's markers (which blocks exist, their
manifests, provenance and file sizes), kept up to date by listing the bucket, and the cache's use
times (its LRU order), in ``<cache dir>/fleet.sqlite``.

Why a mirror: every read of the store (get, list, route, stats) would otherwise be a LIST or a GET
of the bucket. A listing costs two LISTs (markers and tombstones) and runs at most every
``poll_interval`` seconds, when something asks; a block id this worker does not know is looked up at
once with one HEAD (`BucketIndex.lookup`), so an id handed over by another worker is usable now.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ...core.blocks import PROVENANCE_UNVERIFIED, Block, StoreStats
from ...core.errors import BlockNotFound, ConfigError
from ...core.identity import id_problem
from ..local import block_from_row, checked_id
from ..remote import Bucket
from ..sqlite import connect, marks, transaction
from .layout import INDEX, TOMBSTONES, id_of, marker_key, tomb_key

__all__ = ["BucketIndex"]

log = logging.getLogger("graftmem")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS remote (
    id TEXT PRIMARY KEY,
    etag TEXT NOT NULL,
    kind TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    file_size INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    fp_digest TEXT NOT NULL,
    manifest TEXT NOT NULL,
    provenance TEXT NOT NULL,
    labels_trusted INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS used (id TEXT PRIMARY KEY, at REAL NOT NULL);
"""


class BucketIndex:
    """The mirror of one bucket's markers (see the module doc). ``on_gone(id)`` runs for every block a
    listing finds deleted (the fleet store drops its cached copy: a deleted block is never grafted)."""

    def __init__(self, bucket: Bucket, path: Path, *, url: str, poll_interval: float, timeout: float,
                 counters: dict[str, int], on_gone: Callable[[str], None]) -> None:
        self.bucket, self.url, self.counters = bucket, url, counters
        self.poll_interval = float(poll_interval)
        self.on_gone = on_gone
        self.lock = threading.RLock()  #: guards the connection (one per process, shared by threads)
        self._poll_lock = threading.Lock()
        self._last_poll = float("-inf")
        #: bumped whenever a listing (or a lookup) saw another worker's learn or delete
        self.version = 0
        self.db = connect(path, timeout=timeout, setup=lambda db: db.executescript(_SCHEMA))

    def close(self) -> None:
        with self.lock:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()

    # ------------------------------------------------------------------ listing
    def refresh(self, *, force: bool = False) -> bool:
        """List the bucket (markers and tombstones) and bring the index up to date, if
        ``poll_interval`` has passed or ``force``; True if anything changed."""
        if not force and time.monotonic() - self._last_poll < self.poll_interval:
            return False
        with self._poll_lock:
            if not force and time.monotonic() - self._last_poll < self.poll_interval:
                return False
            markers = {}
            for o in self.bucket.list(INDEX):
                bid = id_of(o["path"], INDEX, ".json")
                if bid is not None:
                    markers[bid] = str(o.get("e_tag") or o.get("last_modified"))
            tombs = {bid for o in self.bucket.list(TOMBSTONES)
                     if (bid := id_of(o["path"], TOMBSTONES)) is not None}
            self.counters["lists"] += 2
            self._last_poll = time.monotonic()
            live = {bid: tag for bid, tag in markers.items() if bid not in tombs}
            with self.lock:
                rows = dict(self.db.execute("SELECT id, etag FROM remote").fetchall())
            gone = [bid for bid in rows if bid not in live]
            new = [bid for bid, tag in live.items() if rows.get(bid) != tag]
            fetched = self.fetch_markers(new)
            with self.lock:
                with transaction(self.db):
                    for bid in gone:
                        self.db.execute("DELETE FROM remote WHERE id=?", (bid,))
                    for bid, marker in fetched.items():
                        # the listing's tag: an unchanged marker is not fetched again
                        self.upsert(marker, live[bid])
            for bid in gone:  # a deleted block must not be grafted from the cache either
                self.on_gone(bid)
            changed = bool(gone or fetched)
            if changed:
                self.version += 1
                log.info("fleet store %s: %d new or changed, %d gone", self.url, len(fetched), len(gone))
            return changed

    def fetch_markers(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The markers of ``ids`` (8 at a time); unreadable or vanished ones are left out."""
        def one(bid: str) -> Optional[tuple[str, dict[str, Any]]]:
            try:
                raw = bytes(self.bucket.get(marker_key(bid)))
            except BlockNotFound:  # deleted between the listing and now
                return None
            self.counters["gets"] += 1
            try:
                marker = json.loads(raw)
                block = Block.model_validate(marker["manifest"])
                if block.id != bid:
                    raise ValueError(f"the marker of {bid[:12]} describes block {block.id[:12]}")
                why = id_problem(block)  # another writer of the bucket cannot give a block another's id
                if why is not None:
                    raise ValueError(why)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("fleet store %s: ignoring the unreadable marker of %s: %s", self.url, bid[:12], exc)
                return None
            return bid, marker

        if not ids:
            return {}
        if len(ids) < 4:
            got = [one(b) for b in ids]
        else:
            with ThreadPoolExecutor(max_workers=8) as pool:
                got = list(pool.map(one, ids))
        return dict(item for item in got if item is not None)

    def upsert(self, marker: dict[str, Any], tag: str) -> None:
        """Insert or replace a block's row from its marker; ``tag`` is the marker's ETag ("" to take
        the listing's at the next poll)."""
        block = Block.model_validate(marker["manifest"])
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO remote (id, etag, kind, n_tokens, file_size, created_at, fp_digest, "
                "manifest, provenance, labels_trusted) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (block.id, tag, block.kind, block.n_tokens, int(marker.get("file_size", 0)),
                 block.created_at.isoformat(), block.fingerprint.digest(), block.model_dump_json(),
                 str(marker.get("provenance") or PROVENANCE_UNVERIFIED), int(bool(marker.get("labels_trusted")))))

    def remove(self, bid: str) -> None:
        """Forget a block this worker deleted."""
        with self.lock:
            self.db.execute("DELETE FROM remote WHERE id=?", (bid,))

    def lookup(self, bid: str) -> bool:
        """Bring one block another worker learned since the last listing into the index, at once.

        Why not a listing: an id handed over from another worker (a queue message, a REST call) must
        be usable now, and a listing costs two LISTs of the whole bucket; this is one HEAD of the
        block's marker for an id the bucket does not have (the common case: ``contains`` before a
        learn), plus a HEAD of its tombstone and a GET of the marker when it is there."""
        head = self.bucket.head(marker_key(bid))
        if head is None or self.bucket.head(tomb_key(bid)) is not None:
            return False
        marker = self.fetch_markers([bid]).get(bid)
        if marker is None:
            return False
        with self.lock:
            self.upsert(marker, str(head.get("e_tag") or head.get("last_modified")))
            self.version += 1  # routers re-sync, as after a listing that saw it
        return True

    # ------------------------------------------------------------------ reads
    def one(self, sql: str, args: tuple) -> Any:
        with self.lock:
            return self.db.execute(sql, args).fetchone()

    def file_size(self, bid: str) -> int:
        """The size of a block's file as its marker says (0 if the marker did not say)."""
        row = self.one("SELECT file_size FROM remote WHERE id=?", (bid,))
        return int(row[0]) if row else 0

    def resolve(self, block_id: str) -> str:
        """Full id for an id or a unique prefix of at least 4 hex characters (one fresh listing on a miss)."""
        if checked_id(block_id):
            return block_id
        for attempt in (0, 1):
            with self.lock:
                ids = [r[0] for r in self.db.execute(
                    "SELECT id FROM remote WHERE id >= ? AND id < ? LIMIT 2", (block_id, block_id + "g"))]
            if ids or attempt:
                break
            self.refresh(force=True)
        if not ids:
            raise BlockNotFound(f"no block {block_id!r} in {self.url}")
        if len(ids) > 1:
            raise ConfigError(f"block id prefix {block_id!r} is ambiguous: give more characters")
        return ids[0]

    def row(self, bid: str) -> Optional[tuple]:
        """``(manifest, provenance, labels_trusted)`` of a block, looked up in the bucket if unknown."""
        q = "SELECT manifest, provenance, labels_trusted FROM remote WHERE id=?"
        row = self.one(q, (bid,))
        if row is None and self.lookup(bid):  # learned elsewhere since the last listing?
            row = self.one(q, (bid,))
        return row

    def get(self, block_id: str) -> Block:
        bid = self.resolve(block_id)
        row = self.row(bid)
        if row is None:
            raise BlockNotFound(f"no block {block_id!r} in {self.url}")
        return block_from_row(*row)

    def contains(self, block_id: str) -> bool:
        if not isinstance(block_id, str) or len(block_id) != 64:
            return False
        return self.row(block_id) is not None

    def list(self, *, kind: str | None = None) -> list[Block]:
        self.refresh()
        q = ("SELECT manifest, provenance, labels_trusted FROM remote" + (" WHERE kind=?" if kind else "")
             + " ORDER BY created_at, id")
        with self.lock:
            rows = self.db.execute(q, (kind,) if kind else ()).fetchall()
        return [block_from_row(*r) for r in rows]

    def children(self, block_id: str) -> builtins.list[str]:
        with self.lock:
            return [r[0] for r in self.db.execute(
                "SELECT id FROM remote WHERE json_extract(manifest, '$.parent') = ? ORDER BY id", (block_id,))]

    def stats(self) -> StoreStats:
        self.refresh()
        with self.lock:
            n, toks, size = self.db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_tokens),0), COALESCE(SUM(file_size),0) FROM remote").fetchone()
            kinds = dict(self.db.execute("SELECT kind, COUNT(*) FROM remote GROUP BY kind").fetchall())
        return StoreStats(home=self.url, blocks=int(n), tokens=int(toks), bytes_on_disk=int(size),
                          bytes_per_token=size / toks if toks else 0.0,
                          kinds={str(k): int(v) for k, v in kinds.items()})

    def routing_rows(self, *, exclude_kinds: Sequence[str] = ()) -> builtins.list[tuple[str, str, str, str | None]]:
        self.refresh()
        with self.lock:
            return self.db.execute(
                "SELECT id, json_extract(manifest, '$.name'), fp_digest, "
                "json_extract(manifest, '$.metadata.when_to_use') FROM remote "
                f"WHERE kind NOT IN ({marks(len(exclude_kinds))}) AND provenance != ? "
                "AND labels_trusted = 1", (*exclude_kinds, PROVENANCE_UNVERIFIED)).fetchall()

    # ------------------------------------------------------------------ the cache's use times (LRU)
    def touch(self, bid: str) -> None:
        """Mark ``bid`` used now: ``at`` is one past the largest so far (a sequence, not the wall clock,
        which a virtual machine's time sync can step back between two reads: the cache then evicted a
        block read after another one first; rows written as ``time.time()`` before still order below)."""
        with self.lock, contextlib.suppress(sqlite3.Error):
            self.db.execute("INSERT OR REPLACE INTO used (id, at) "
                            "VALUES (?, (SELECT COALESCE(MAX(at), 0) + 1 FROM used))", (bid,))

    def forget_use(self, bid: str) -> None:
        with self.lock, contextlib.suppress(sqlite3.Error):
            self.db.execute("DELETE FROM used WHERE id=?", (bid,))

    def least_recently_used(self) -> builtins.list[str]:
        """Block ids by their last use, oldest first."""
        with self.lock:
            return [r[0] for r in self.db.execute("SELECT id FROM used ORDER BY at")]
