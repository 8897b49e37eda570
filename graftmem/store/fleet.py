"""The fleet store: one memory in an S3-compatible bucket, shared by many workers, each with a local
read-through cache. Same interface as the local [`Store`][graftmem.Store]; selected with
``Memory(store="s3://bucket/prefix")``, ``GRAFTMEM_STORE=s3://...`` or the CLI's ``--store``.

Bucket layout (keys under the URL's prefix)::

    blocks/<id[:2]>/<id>.gmb   the block file, the same bytes as a local one (self-verifying: header,
                               manifest with the id and the state's BLAKE3 digest, trailer); written
                               ONCE (If-None-Match: *; above 256 MiB: a look first, then a multipart
                               upload under uploads/ and a server-side copy completed with
                               If-None-Match: *, so of two racing workers one writes)
    index/<id>.json            the marker: manifest, provenance, labels_trusted, file size. Written
                               after the block file, so a listing of index/ shows complete blocks only
                               (a worker killed mid-upload leaves at most an unlisted block object)
    tombstones/<id>            a delete: the block is gone for every reader that lists after it; the
                               block object stays until `collect_garbage` (after a grace period), so a
                               reader that listed before the delete still gets whole, checked bytes

The routing data is in the bucket too: a marker carries the manifest, whose ``metadata`` holds the
block's text and ``when_to_use``, so a new worker routes over every block after one listing (its
embedder embeds them locally, once; the router index is cached beside the block cache).

What is consistent when: a worker's own writes are visible to it at once; another worker's learn or
delete is seen at the next listing, which runs when ``poll_interval`` seconds (default 2) have passed
since the last one and something asks (list, route, stats), or at once when a block id is asked
for that this worker does not know. S3 (since 2020), MinIO, R2 and SeaweedFS list a completed PUT
immediately (strong read-after-write), so the delay is the poll interval.

The cache is a local `Store` under the platform cache dir (``platformdirs.user_cache_dir``, one
directory per bucket URL) capped at ``cache_bytes`` with LRU eviction: a block is fetched once,
checked on arrival (header, trailer, manifest id, fingerprint, BLAKE3 of the state, the local store's
checks) before it is grafted or enters the cache, and checked again on every graft as today. A
corrupted or swapped object raises [`BlockCorrupted`][graftmem.BlockCorrupted] and never enters the
cache; a bucket that is down or slow raises [`TransferError`][graftmem.TransferError] after bounded
retries with back-off, and the cache is left as it was.

Trust: whoever can write the bucket is trusted like whoever can write a local home: the marker's
provenance (``local`` for a block a worker prefilled itself) is taken as it is. Bundles, pulls and
signatures (docs/security.md) are how blocks from outside the fleet come in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..core.blocks import PROVENANCE_LOCAL, PROVENANCE_UNVERIFIED, Block, Fingerprint, StoreStats
from ..core.errors import BlockCorrupted, BlockNotFound, ConfigError, StoreError, TransferError
from ..core.format import HEADER, TRAILER_LEN, parse_header, parse_manifest, state_hasher
from .home import BLOCK_SUFFIX, Home
from .local import Store, _marks, check_head, checked_id, deletion_order, incompatibility
from .remote import Bucket, RetryPolicy, parse_url
from .sqlite import connect, transaction

__all__ = ["FleetStore", "default_cache_dir", "DEFAULT_CACHE_BYTES", "DEFAULT_POLL_INTERVAL", "is_remote"]

log = logging.getLogger("graftmem")

#: Default cap of a worker's block cache: 20 GiB (about 300 SmolLM2 3,000-token blocks, or 6 Gemma 3
#: 270M 32k pages at f16). Set ``cache_bytes`` from the blocks a worker grafts in a working day.
DEFAULT_CACHE_BYTES = 20 << 30
#: Seconds between two listings of the bucket (the delay before a worker sees another's learn).
DEFAULT_POLL_INTERVAL = 2.0
#: A tombstoned or unlisted block object older than this is removed by `FleetStore.collect_garbage`.
DEFAULT_GRACE = 3600.0
_MARKER_VERSION = 1

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


def is_remote(spec: object) -> bool:
    """Whether a store spec names object storage (``s3://...``) rather than a directory."""
    return isinstance(spec, str) and spec.startswith("s3://")


def default_cache_dir(url: str) -> Path:
    """``<user cache dir>/graftmem/fleet/<sha256(url)[:16]>``: one cache per bucket URL and endpoint."""
    import platformdirs

    key = f"{url}\n{os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL') or ''}"
    return Path(platformdirs.user_cache_dir("graftmem")) / "fleet" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _block_key(bid: str) -> str:
    return f"blocks/{bid[:2]}/{bid}{BLOCK_SUFFIX}"


def _upload_key(bid: str) -> str:
    """Where a large block goes up before its conditional copy to its key: a name of this writer's own."""
    return f"uploads/{bid}.{os.getpid()}.{threading.get_ident()}.{time.time_ns()}{BLOCK_SUFFIX}"


def _marker_key(bid: str) -> str:
    return f"index/{bid}.json"


def _tomb_key(bid: str) -> str:
    return f"tombstones/{bid}"


def _id_of(path: str, folder: str, suffix: str = "") -> Optional[str]:
    name = path.rsplit("/", 1)[-1]
    if suffix:
        if not name.endswith(suffix):
            return None
        name = name[:-len(suffix)]
    if len(name) == 64 and all(c in "0123456789abcdef" for c in name) and f"{folder}/" in f"/{path}":
        return name
    return None


class _Landing:
    """The state bytes of a block file arriving in parts, in any order: each part's state bytes are
    copied into ``view`` (the caller's buffer) as the part lands, and hashed (BLAKE3, in file order)
    as soon as every byte before them has landed, so the hash runs while later parts are in flight.
    The hash is over the bytes in ``view``: what is returned is what was checked."""

    def __init__(self, view: memoryview, state_off: int) -> None:
        self.view, self.soff = view, state_off
        self.hasher = state_hasher(len(view))
        self._lock = threading.Lock()
        self._landed: dict[int, int] = {}  # file offset -> end of a landed, not yet hashed run
        self._hashed_to = state_off  # file offset: every state byte before it is hashed

    def land(self, start: int, data: memoryview) -> None:
        """Part ``data`` of the file, at file offset ``start`` (bytes outside the state are skipped)."""
        soff, end = self.soff, self.soff + len(self.view)
        a, b = max(start, soff), min(start + len(data), end)
        if a >= b:
            return
        self.view[a - soff:b - soff] = data[a - start:b - start]
        with self._lock:
            self._landed[a] = b
            while self._hashed_to in self._landed:
                stop = self._landed.pop(self._hashed_to)
                self.hasher.update(self.view[self._hashed_to - soff:stop - soff])
                self._hashed_to = stop

    def digest(self) -> tuple[memoryview, str]:
        """The view and ``blake3:<hex>`` of the state; `BlockCorrupted` if any state byte is missing."""
        with self._lock:
            if self._hashed_to != self.soff + len(self.view):
                raise BlockCorrupted(f"{self._hashed_to - self.soff} of {len(self.view)} state bytes arrived "
                                     "in order")
            return self.view, "blake3:" + self.hasher.hexdigest()


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: nice 10, this thread only): the cache write runs while
    the block it wrote is restored and prefilled, which should not wait for it. Not ``SCHED_IDLE``:
    measured, a thread that never runs while llama.cpp computes holds up the locks it takes (grafts
    of 3 s instead of 0.1 s). Elsewhere a no-op (``setpriority`` there would lower the whole process)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class FleetStore:
    """A block store in an S3-compatible bucket with a local read-through cache (see the module doc).

    ``url`` is ``s3://bucket[/prefix]``; ``cache_dir`` defaults to `default_cache_dir`; ``cache_bytes``
    caps the cache (LRU eviction, the block being read is never evicted); ``poll_interval`` is the
    seconds between listings; ``retry`` the bounded retries of each request. A fetched block enters
    ``cache`` (a local `Store`) behind the graft that fetched it: `flush` before looking into it.
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, poll_interval: float = DEFAULT_POLL_INTERVAL,
                 retry: RetryPolicy = RetryPolicy(), lock_timeout: float = 30.0) -> None:
        parse_url(url)
        if cache_bytes <= 0:
            raise ConfigError(f"cache_bytes must be > 0, got {cache_bytes}")
        self.url = url
        self.bucket = Bucket(url, retry=retry)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(url)
        self.cache = Store(root, lock_timeout=lock_timeout)
        self.home = self.cache.home  #: the local side: cache, routing index, page index, scopes
        self.layout: Home = self.cache.layout
        self.lock_timeout = lock_timeout
        self.read_only = False
        self.cache_bytes = int(cache_bytes)
        self.poll_interval = float(poll_interval)
        self.fetch_parts = 4  #: concurrent range requests per block download (above 8 MiB)
        self._tlock = threading.RLock()
        self._poll_lock = threading.Lock()
        self._last_poll = float("-inf")
        self._version = 0
        self._closed = False
        self._prefetches: dict[str, Future] = {}  # block id -> its prefetch, until it ends
        self._prefetcher: Optional[ThreadPoolExecutor] = None
        self._writer: Optional[ThreadPoolExecutor] = None  #: writes fetched blocks into the cache
        self._writes: dict[str, Future] = {}  #: block id -> its cache write in progress
        self.counters = {"gets": 0, "get_bytes": 0, "puts": 0, "put_bytes": 0, "lists": 0, "cache_hits": 0}
        try:
            self._db = connect(root / "fleet.sqlite", timeout=lock_timeout, setup=lambda db: db.executescript(_SCHEMA))
        except sqlite3.Error as exc:
            self.cache.close()
            raise StoreError(f"cannot open the fleet index in {root}: {exc}") from exc
        try:
            self.refresh(force=True)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._tlock:
            self._closed = True
            pool, self._prefetcher = self._prefetcher, None
        if pool is not None:  # let running prefetches land (they write into the cache), drop queued ones
            pool.shutdown(wait=True, cancel_futures=True)
        with self._tlock:
            writer, self._writer = self._writer, None
        if writer is not None:  # blocks fetched so far enter the cache before it closes
            writer.shutdown(wait=True)
        with self._tlock:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
        self.cache.close()

    def __repr__(self) -> str:
        return f"FleetStore({self.url!r}, cache={str(self.home)!r})"

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """The cache's lock (serializes this machine's writers; the bucket needs none: writes are
        create-once)."""
        return self.cache.lock()

    # ------------------------------------------------------------------ listing
    def refresh(self, *, force: bool = False) -> bool:
        """List the bucket (markers and tombstones) and bring the local index up to date, if
        ``poll_interval`` has passed or ``force``; True if anything changed. Deleted blocks leave the
        cache too."""
        if not force and time.monotonic() - self._last_poll < self.poll_interval:
            return False
        with self._poll_lock:
            if not force and time.monotonic() - self._last_poll < self.poll_interval:
                return False
            markers = {}
            for o in self.bucket.list("index"):
                bid = _id_of(o["path"], "index", ".json")
                if bid is not None:
                    markers[bid] = str(o.get("e_tag") or o.get("last_modified"))
            tombs = {bid for o in self.bucket.list("tombstones")
                     if (bid := _id_of(o["path"], "tombstones")) is not None}
            self.counters["lists"] += 2
            self._last_poll = time.monotonic()
            live = {bid: tag for bid, tag in markers.items() if bid not in tombs}
            with self._tlock:
                rows = dict(self._db.execute("SELECT id, etag FROM remote").fetchall())
            gone = [bid for bid in rows if bid not in live]
            new = [bid for bid, tag in live.items() if rows.get(bid) != tag]
            fetched = self._fetch_markers(new)
            with self._tlock:
                with transaction(self._db):
                    for bid in gone:
                        self._db.execute("DELETE FROM remote WHERE id=?", (bid,))
                    for bid, marker in fetched.items():
                        # the listing's tag: an unchanged marker is not fetched again
                        self._upsert(marker, live[bid])
            for bid in gone:  # a deleted block must not be grafted from the cache either
                self._drop_cached(bid)
            changed = bool(gone or fetched)
            if changed:
                self._version += 1
                log.info("fleet store %s: %d new or changed, %d gone", self.url, len(fetched), len(gone))
            return changed

    def _fetch_markers(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The markers of ``ids`` (8 at a time); unreadable or vanished ones are left out."""
        def one(bid: str) -> Optional[tuple[str, dict[str, Any]]]:
            try:
                raw = bytes(self.bucket.get(_marker_key(bid)))
            except BlockNotFound:  # deleted between the listing and now
                return None
            self.counters["gets"] += 1
            try:
                marker = json.loads(raw)
                block = Block.model_validate(marker["manifest"])
                if block.id != bid:
                    raise ValueError(f"the marker of {bid[:12]} describes block {block.id[:12]}")
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

    def _upsert(self, marker: dict[str, Any], tag: str) -> None:
        block = Block.model_validate(marker["manifest"])
        self._db.execute(
            "INSERT OR REPLACE INTO remote (id, etag, kind, n_tokens, file_size, created_at, fp_digest, manifest, "
            "provenance, labels_trusted) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (block.id, tag, block.kind, block.n_tokens, int(marker.get("file_size", 0)),
             block.created_at.isoformat(), block.fingerprint.digest(), block.model_dump_json(),
             str(marker.get("provenance") or PROVENANCE_UNVERIFIED), int(bool(marker.get("labels_trusted")))))

    def data_version(self) -> int:
        """Changes whenever a listing saw another worker's learn or delete (polled at most every
        ``poll_interval`` seconds); this store's own writes do not change it, as locally."""
        self.refresh()
        return self._version

    # ------------------------------------------------------------------ index reads
    def _one(self, sql: str, args: tuple) -> Any:
        with self._tlock:
            return self._db.execute(sql, args).fetchone()

    def resolve(self, block_id: str) -> str:
        """Full id for an id or a unique prefix of at least 4 hex characters (one fresh listing on a miss)."""
        if checked_id(block_id):
            return block_id
        for attempt in (0, 1):
            with self._tlock:
                ids = [r[0] for r in self._db.execute(
                    "SELECT id FROM remote WHERE id >= ? AND id < ? LIMIT 2", (block_id, block_id + "g"))]
            if ids or attempt:
                break
            self.refresh(force=True)
        if not ids:
            raise BlockNotFound(f"no block {block_id!r} in {self.url}")
        if len(ids) > 1:
            raise ConfigError(f"block id prefix {block_id!r} is ambiguous: give more characters")
        return ids[0]

    def _row(self, bid: str) -> Optional[tuple]:
        q = "SELECT manifest, provenance, labels_trusted FROM remote WHERE id=?"
        row = self._one(q, (bid,))
        if row is None and self._lookup(bid):  # learned elsewhere since the last listing?
            row = self._one(q, (bid,))
        return row

    def _lookup(self, bid: str) -> bool:
        """Bring one block another worker learned since the last listing into the index, at once.

        Why not a listing: an id handed over from another worker (a queue message, a REST call) must
        be usable now, and a listing costs two LISTs of the whole bucket; this is one HEAD of the
        block's marker for an id the bucket does not have (the common case: ``contains`` before a
        learn), plus a HEAD of its tombstone and a GET of the marker when it is there."""
        head = self.bucket.head(_marker_key(bid))
        if head is None or self.bucket.head(_tomb_key(bid)) is not None:
            return False
        marker = self._fetch_markers([bid]).get(bid)
        if marker is None:
            return False
        with self._tlock:
            self._upsert(marker, str(head.get("e_tag") or head.get("last_modified")))
            self._version += 1  # routers re-sync, as after a listing that saw it
        return True

    def get(self, block_id: str) -> Block:
        """The block's manifest (from its marker), with the fleet's provenance."""
        bid = self.resolve(block_id)
        row = self._row(bid)
        if row is None:
            raise BlockNotFound(f"no block {block_id!r} in {self.url}")
        return Store._row(*row)

    def contains(self, block_id: str) -> bool:
        if not isinstance(block_id, str) or len(block_id) != 64:
            return False
        return self._row(block_id) is not None

    def provenance(self, block_id: str) -> str:
        return self.get(block_id).provenance or PROVENANCE_UNVERIFIED

    def list(self, *, kind: str | None = None) -> list[Block]:
        self.refresh()
        q = ("SELECT manifest, provenance, labels_trusted FROM remote" + (" WHERE kind=?" if kind else "")
             + " ORDER BY created_at, id")
        with self._tlock:
            rows = self._db.execute(q, (kind,) if kind else ()).fetchall()
        return [Store._row(*r) for r in rows]

    def children(self, block_id: str) -> list[str]:
        with self._tlock:
            return [r[0] for r in self._db.execute(
                "SELECT id FROM remote WHERE json_extract(manifest, '$.parent') = ? ORDER BY id", (block_id,))]

    def stats(self) -> StoreStats:
        """Counts and sizes of the blocks in the bucket (from the listing; no object is read)."""
        self.refresh()
        with self._tlock:
            n, toks, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_tokens),0), COALESCE(SUM(file_size),0) FROM remote").fetchone()
            kinds = dict(self._db.execute("SELECT kind, COUNT(*) FROM remote GROUP BY kind").fetchall())
        return StoreStats(home=self.url, blocks=int(n), tokens=int(toks), bytes_on_disk=int(size),
                          bytes_per_token=size / toks if toks else 0.0,
                          kinds={str(k): int(v) for k, v in kinds.items()})

    def cache_stats(self) -> dict[str, int]:
        """Blocks and bytes in this worker's cache, its cap, and the request counters of this process
        (after the cache writes in progress)."""
        self.flush()
        st = self.cache.stats()
        return {"blocks": st.blocks, "bytes": st.bytes_on_disk, "cap": self.cache_bytes, **self.counters}

    def routing_rows(self, *, exclude_kinds: Sequence[str] = ()) -> list[tuple[str, str, str, str | None]]:
        """As [`Store.routing_rows()`][graftmem.Store.routing_rows], over the bucket's blocks."""
        self.refresh()
        with self._tlock:
            return self._db.execute(
                "SELECT id, json_extract(manifest, '$.name'), fp_digest, "
                "json_extract(manifest, '$.metadata.when_to_use') FROM remote "
                f"WHERE kind NOT IN ({_marks(len(exclude_kinds))}) AND provenance != ? "
                "AND labels_trusted = 1", (*exclude_kinds, PROVENANCE_UNVERIFIED)).fetchall()

    def reconcile(self) -> dict[str, int]:
        """List the bucket now and reconcile the cache's own index with its files."""
        before = self._version
        self.refresh(force=True)
        rep = self.cache.reconcile()
        return {**rep, "listed_changes": self._version - before}

    # ------------------------------------------------------------------ reads
    def _touch(self, bid: str) -> None:
        with self._tlock, contextlib.suppress(sqlite3.Error):
            self._db.execute("INSERT OR REPLACE INTO used (id, at) VALUES (?, ?)", (bid, time.time()))

    def _drop_cached(self, bid: str) -> None:
        self._wait_cached(bid)  # a write behind would bring it back
        if self.cache.contains(bid):
            with contextlib.suppress(BlockNotFound):
                self.cache.delete(bid, cascade=True)
        with self._tlock, contextlib.suppress(sqlite3.Error):
            self._db.execute("DELETE FROM used WHERE id=?", (bid,))

    def read_manifest(self, path: Path) -> Block:
        return self.cache.read_manifest(path)

    def path_of(self, block_id: str) -> Path:
        """The cached file of a block, fetched (and checked) first if it is not cached."""
        bid = self.resolve(block_id)
        self._wait_cached(bid)
        if not self.cache.contains(bid):
            self.read_state(bid, lambda n: memoryview(bytearray(n)))
            self._wait_cached(bid)
        return self.cache.path_of(bid)

    def read_state(self, block_id: str, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """Read a block's state into ``buffer(n)``, checked, from the cache or else from the bucket.

        A cache hit is a local read (the same checks as [`Store.read_state()`][graftmem.Store.read_state]);
        a miss downloads the block file into memory, checks all of it as the local reader does (header,
        trailer, manifest id, fingerprint, BLAKE3) while copying its state into ``buffer``, and only
        then writes it into the cache, behind the graft (`_fetch`). ``timings`` also gets ``fetch_ms``
        on a miss (the download, with the copy and the hash that overlap it). The block returned is the marker's
        manifest; a block file whose state digest differs from its marker's is refused."""
        bid = self.resolve(block_id)
        meta = self.get(bid)
        self._wait_cached(bid)  # fetched a moment ago and being written: read it from the cache
        if self.cache.contains(bid):
            try:
                _, view = self.cache.read_state(bid, buffer, fingerprint=fingerprint, timings=timings)
                self.counters["cache_hits"] += 1
                self._touch(bid)
                return meta, view
            except BlockNotFound:
                pass
            except BlockCorrupted as exc:  # the local copy rotted: drop it, fetch a checked one again
                log.warning("fleet store %s: cached block %s is damaged (%s); fetching it again", self.url,
                            bid[:12], exc)
                self._drop_cached(bid)
        block, view = self._fetch(bid, meta, buffer, fingerprint, timings)
        return block, view

    def _fetch(self, bid: str, meta: Block, buffer: Callable[[int], memoryview],
               fingerprint: Optional[Fingerprint], timings: Optional[dict[str, float]]) -> tuple[Block, memoryview]:
        """Download a block file into memory, check all of it, return its state; cache it behind.

        Why in memory: writing 69 MB into a new file and reading it back cost more than the download
        itself (bench/fleet.py: fetch 190-260 ms staged on disk, 55-80 ms into memory). The parts land
        in memory (``fetch_parts`` concurrent range requests); each part's state bytes are copied into
        ``buffer`` as it lands, where the marker says the state lies, and hashed in file order as soon
        as every part before it has landed (`_Landing`). Then the whole file is checked as the local
        reader checks it (`check_head`: header, trailer, manifest, id, size; the parts join up; the
        fingerprint; BLAKE3 of the bytes in ``buffer``; the marker's digest) before anything is
        returned, so before anything is grafted. Only then is the cache file written, from
        the same downloaded bytes, on the cache writer thread (`flush` waits for it; a read of the same
        block waits for it too); it is checked again with BLAKE3 on its first read, as any new file."""
        key = _block_key(bid)
        where = f"{self.url}/{key}"
        t0 = time.perf_counter()
        row = self._one("SELECT file_size FROM remote WHERE id=?", (bid,))
        size = int(row[0]) if row else 0
        slen = meta.state_size
        soff = size - slen - TRAILER_LEN  # where the marker says the state lies: the header must agree
        landing = _Landing(buffer(slen), soff) if size and soff >= HEADER.size else None

        def on_part(start: int, data: memoryview) -> None:  # in the part's thread, while others arrive
            if landing is not None:
                landing.land(start, data)

        try:
            parts = self.bucket.get_parts(key, size, parts=self.fetch_parts, on_part=on_part)
        except TransferError:
            head = self.bucket.head(key) if size else None
            if head is not None and int(head["size"]) != size:  # ranges past a shorter object's end
                raise BlockCorrupted(f"{where}: {head['size']} bytes, its marker says {size}; refused",
                                     path=where) from None
            raise
        got = sum(len(data) for _, data in parts)
        self.counters["gets"] += 1
        self.counters["get_bytes"] += got
        t1 = time.perf_counter()
        if size and got != size:
            raise BlockCorrupted(f"{where}: the object has {'more' if got > size else 'fewer'} bytes than "
                                 f"its marker's {size}; it was not cached and nothing was grafted", path=where)
        if any(parts[i][0] + len(parts[i][1]) != parts[i + 1][0] for i in range(len(parts) - 1)):
            raise BlockCorrupted(f"{where}: the object's ranges came back with other lengths than asked; it "
                                 "was not cached and nothing was grafted", path=where)

        def read(offset: int, n: int) -> bytes:
            out = bytearray()
            for start, data in parts:
                a, b = max(offset, start), min(offset + n, start + len(data))
                if a < b:
                    out += memoryview(data)[a - start:b - start]
            return bytes(out)

        try:
            block, hoff, hlen = check_head(read, got, where=where, expect_id=bid)
            if landing is None:  # no size in the marker: one GET, copied and hashed now
                landing = _Landing(buffer(hlen), hoff)
                for start, data in parts:
                    landing.land(start, memoryview(data))
            elif (hoff, hlen) != (soff, slen):  # a marker whose size disagrees with its object's header
                raise BlockCorrupted(f"{where}: the header puts the state at {hoff}+{hlen}, its marker "
                                     f"at {soff}+{slen}", path=where)
            if fingerprint is not None:
                err = incompatibility(block, fingerprint)
                if err is not None:
                    raise err
            view, actual = landing.digest()  # every state byte, hashed in order: else BlockCorrupted
            if actual != block.state_digest:
                raise BlockCorrupted(f"{where}: state digest mismatch: expected {block.state_digest}, actual "
                                     f"{actual}", path=where, expected=block.state_digest, actual=actual)
        except BlockCorrupted as exc:
            raise BlockCorrupted(f"{where}: the object fails its check ({exc}); it was not cached and "
                                 "nothing was grafted", path=where, expected=exc.expected,
                                 actual=exc.actual) from exc
        if block.state_digest != meta.state_digest:
            raise BlockCorrupted(f"{where}: its state digest {block.state_digest} differs from its "
                                 f"marker's {meta.state_digest} (a swapped object?)", path=where,
                                 expected=meta.state_digest, actual=block.state_digest)
        if timings is not None:
            t2 = time.perf_counter()
            timings["fetch_ms"] = timings.get("fetch_ms", 0.0) + (t1 - t0) * 1e3
            timings["check_ms"] = timings.get("check_ms", 0.0) + (t2 - t1) * 1e3
        self._cache_behind(bid, meta, parts, got)
        return meta, view

    def _cache_behind(self, bid: str, meta: Block, parts: list[tuple[int, Any]], size: int) -> None:
        """Write checked bytes into the cache on the writer thread (the graft does not wait for it)."""
        with self._tlock:
            if bid in self._writes or (self._closed and self._writer is None):
                return  # on its way already; or closed (running prefetches still land: close waits)
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graftmem-cache-write",
                                                  initializer=_background_priority)
            self._writes[bid] = self._writer.submit(self._write_cached, bid, meta, parts, size)

    def _write_cached(self, bid: str, meta: Block, parts: list[tuple[int, Any]], size: int) -> None:
        stage_dir = self.layout.staging
        tmp = stage_dir / f"{bid}.{os.getpid()}.{threading.get_ident()}{BLOCK_SUFFIX}"
        try:
            stage_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:  # one call for all parts (contiguous): the GIL is released for the whole write
                views = [memoryview(data) for _, data in parts]
                done = 0
                while done < size:
                    n = os.pwritev(fd, views, done)
                    if n <= 0:
                        raise OSError(f"{tmp}: the write stopped at {done} of {size} bytes")
                    done += n
                    while views and n >= len(views[0]):
                        n -= len(views[0])
                        views.pop(0)
                    if views and n:
                        views[0] = views[0][n:]
            finally:
                os.close(fd)
            if os.stat(tmp).st_size != size:
                raise OSError(f"{tmp}: {os.stat(tmp).st_size} bytes written of {size}")
            staged = meta.model_copy(update={"provenance": meta.provenance, "labels_trusted": meta.labels_trusted})
            self.cache.adopt([(staged, tmp)])
            self._touch(bid)
            self._evict(keep=bid)
        except (OSError, StoreError) as exc:  # a cache that cannot take it: the read was served anyway
            log.warning("fleet store %s: block %s not cached: %s", self.url, bid[:12], exc)
        finally:
            tmp.unlink(missing_ok=True)
            with self._tlock:
                self._writes.pop(bid, None)

    def _wait_cached(self, bid: str) -> None:
        with self._tlock:
            fut = self._writes.get(bid)
        if fut is not None:
            fut.result()

    def flush(self) -> None:
        """Wait until the blocks fetched or prefetched so far are in the cache (both are written behind
        the graft that asked for them); a failed prefetch was logged and is not raised here."""
        with self._tlock:
            prefetches = list(self._prefetches.values())
        for fut in prefetches:
            fut.result()
        with self._tlock:
            futs = list(self._writes.values())
        for fut in futs:
            fut.result()

    def prefetch(self, block_ids: list[str]) -> list[Future]:
        """Fetch blocks into the cache in the background (two at a time), checked on arrival as any
        fetch; blocks already cached or on their way are skipped. For the pager: the pages ranked
        next for a task are likely the next ones asked. A failure is logged, never raised here."""
        futures = []
        for bid in block_ids:
            with self._tlock:
                if bid in self._prefetches or bid in self._writes or self._closed:
                    continue
                if self.cache.contains(bid):
                    continue
                if self._prefetcher is None:
                    self._prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="graftmem-prefetch")
                fut = self._prefetches[bid] = self._prefetcher.submit(self._prefetch_one, bid)
                futures.append(fut)
        return futures

    def _prefetch_one(self, bid: str) -> bool:
        try:
            if not self.cache.contains(bid):
                self.read_state(bid, lambda n: memoryview(bytearray(n)))
                self._wait_cached(bid)  # done means cached
            return True
        except Exception as exc:  # a prefetch is a hint: the graft that needs the block fetches it again
            log.warning("fleet store %s: prefetch of %s failed: %s", self.url, bid[:12], exc)
            return False
        finally:
            with self._tlock:
                self._prefetches.pop(bid, None)

    def _evict(self, keep: str) -> None:
        """Remove least recently used blocks until the cache is under its cap."""
        size = self.cache.stats().bytes_on_disk
        if size <= self.cache_bytes:
            return
        with self._tlock:
            order = [r[0] for r in self._db.execute("SELECT id FROM used ORDER BY at")]
        cached = {b.id: b for b in self.cache.list()}
        order += [bid for bid in cached if bid not in set(order)]
        for bid in order:
            if size <= self.cache_bytes:
                break
            if bid == keep or bid not in cached or not self.cache.contains(bid):
                continue
            gone = self.cache.delete(bid, cascade=True)
            for g in gone:
                size -= cached[g].state_size if g in cached else 0
                with self._tlock, contextlib.suppress(sqlite3.Error):
                    self._db.execute("DELETE FROM used WHERE id=?", (g,))
            log.debug("fleet cache %s: evicted %s", self.home, ", ".join(g[:12] for g in gone))

    # ------------------------------------------------------------------ writes
    def _marker(self, block: Block, file_size: int, provenance: str, labels_trusted: bool) -> bytes:
        return json.dumps({"v": _MARKER_VERSION, "manifest": json.loads(block.model_dump_json()),
                           "provenance": provenance, "labels_trusted": bool(labels_trusted),
                           "file_size": int(file_size)}, sort_keys=True).encode()

    def _upload(self, block: Block, path: Path, provenance: str, labels_trusted: bool, *, replace: bool) -> None:
        """Block file first (create-once), then its marker, then clear a tombstone of an earlier delete."""
        size = path.stat().st_size
        key = _block_key(block.id)
        if size > self.bucket.multipart_above:
            # in parts under a staging key, then a conditional server-side copy (Bucket.put_large_once):
            # of two workers racing here exactly one writes; a look first skips the upload when it is there
            tag = None if self.bucket.head(key) is not None else self.bucket.put_large_once(
                key, path, _upload_key(block.id), size=size)
        else:
            tag = self.bucket.put(key, path, create=True, size=size)
        self.counters["puts"] += 1
        if tag is None:  # already there (another worker, or a killed upload of ours): same bytes?
            self._check_existing(block, key)
        else:
            self.counters["put_bytes"] += size
        marker = self._marker(block, size, provenance, labels_trusted)
        mtag = self.bucket.put(_marker_key(block.id), marker, create=not replace)
        self.counters["puts"] += 1
        if mtag is None:  # learned by another worker at the same time: theirs stands, ours is the same state
            log.info("fleet store %s: block %s was written by another worker meanwhile", self.url, block.short_id)
        self.bucket.delete(_tomb_key(block.id))
        with self._tlock:
            self._upsert(json.loads(marker), mtag or "")
            if mtag is None:  # take the listing's tag at the next poll
                self._db.execute("UPDATE remote SET etag='' WHERE id=?", (block.id,))

    def _check_existing(self, block: Block, key: str) -> None:
        """The object under a block's key must be that block: id and state digest from its header."""
        head = self.bucket.head(key)
        if head is None:
            raise StoreError(f"{self.url}/{key} was reported present and is gone; retry")
        size = int(head["size"])
        raw = bytes(self.bucket.get_ranges(key, [0], [min(size, HEADER.size)])[0])
        _, soff, slen = parse_header(raw, where=key, file_size=size)
        prefix, trailer = self.bucket.get_ranges(key, [0, soff + slen], [soff, soff + slen + TRAILER_LEN])
        other = parse_manifest(bytes(prefix), bytes(trailer), where=f"{self.url}/{key}")
        if other.id != block.id or other.state_digest != block.state_digest:
            raise BlockCorrupted(f"{self.url}/{key} holds other content (id {other.id[:12]}, state "
                                 f"{other.state_digest}) than block {block.short_id} ({block.state_digest}); "
                                 "refusing to mark it as this block", path=f"{self.url}/{key}",
                                 expected=block.state_digest, actual=other.state_digest)

    def put(self, block: Block, state: memoryview | bytes, *, replace: bool = False,
            provenance: str = PROVENANCE_LOCAL, labels_trusted: bool = True) -> Block:
        """Store a block in the bucket (and the cache): a block already listed is returned as is
        unless ``replace``. Written as the local store writes it, then uploaded (see the module doc)."""
        if block.state_size != len(state):
            raise ConfigError(f"block says {block.state_size} state bytes, got {len(state)}")
        if not replace and self.contains(block.id):
            return self.get(block.id)
        if block.parent is not None and not self.contains(block.parent):
            raise BlockNotFound(f"block {block.short_id} is chained on {block.parent[:12]}, which is not in "
                                f"{self.url} (deleted meanwhile?)")
        if block.parent is not None:
            self.path_of(block.parent)  # the cache's put checks the parent is there
        self.cache.put(block, state, replace=replace, provenance=provenance, labels_trusted=labels_trusted)
        self._upload(block, self.cache.path_of(block.id), provenance, labels_trusted, replace=replace)
        self._touch(block.id)
        self._evict(keep=block.id)
        return block.model_copy(update={"provenance": provenance, "labels_trusted": labels_trusted})

    def adopt(self, files: list[tuple[Block, Path]]) -> list[str]:
        """Move verified block files (staged on the cache's file system) into the cache and upload
        them; blocks already in the bucket are skipped. Used by bundle import and pull."""
        todo = [(b, p) for b, p in files if not self.contains(b.id)]
        added = self.cache.adopt(todo)
        for block, _ in todo:
            if block.id in added or self.cache.contains(block.id):
                prov = block.provenance or PROVENANCE_UNVERIFIED
                self._upload(block, self.cache.path_of(block.id), prov, bool(block.labels_trusted), replace=False)
                self._touch(block.id)
        return [b.id for b, _ in todo if b.id in added]

    def set_manifest(self, block: Block) -> None:
        """Rewrite a block's manifest (its marker: the block object is immutable). The state digest
        and id may not change."""
        cur = self.get(block.id)
        if cur.state_digest != block.state_digest:
            raise ConfigError("set_manifest may not change a block's id or state")
        labels = block.labels_trusted if block.labels_trusted is not None else cur.labels_trusted
        self._rewrite_marker(block, cur.provenance or PROVENANCE_UNVERIFIED, bool(labels))
        if self.cache.contains(block.id):
            self.cache.set_manifest(block)

    def set_provenance(self, block_id: str, provenance: str, *, labels_trusted: Optional[bool] = None) -> None:
        cur = self.get(block_id)
        labels = bool(cur.labels_trusted) if labels_trusted is None else labels_trusted
        self._rewrite_marker(cur, provenance, labels)
        if self.cache.contains(cur.id):
            self.cache.set_provenance(cur.id, provenance, labels_trusted=labels)

    def _rewrite_marker(self, block: Block, provenance: str, labels_trusted: bool) -> None:
        row = self._one("SELECT file_size FROM remote WHERE id=?", (block.id,))
        marker = self._marker(block, row[0] if row else 0, provenance, labels_trusted)
        tag = self.bucket.put(_marker_key(block.id), marker, create=False)
        self.counters["puts"] += 1
        with self._tlock:
            self._upsert(json.loads(marker), tag or "")

    def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        """Delete a block (and, with ``cascade``, the blocks chained on it) for every worker: a
        tombstone first, then the marker; the block object stays for `collect_garbage`."""
        bid = self.resolve(block_id)
        order = deletion_order(bid, self.children, cascade=cascade)
        for cur in reversed(order):  # children first
            self.bucket.put(_tomb_key(cur), b"", create=False)
            self.bucket.delete(_marker_key(cur))
            with self._tlock:
                self._db.execute("DELETE FROM remote WHERE id=?", (cur,))
            self._drop_cached(cur)
        return list(reversed(order))

    # ------------------------------------------------------------------ routing vectors
    def get_vectors(self, space: str, names: list[str]) -> dict[str, Any]:
        """Routing rows other workers embedded (``routing/<space>/<id>-<entry key>.npy``), for the
        router (`graftmem.memory.router`); missing or unreadable ones are left out (embedded locally)."""
        import io

        import numpy as np

        if not names:
            return {}
        try:
            there = {o["path"].rsplit("/", 1)[-1][:-4] for o in self.bucket.list(f"routing/{space}")
                     if o["path"].endswith(".npy")}
        except (StoreError, TransferError) as exc:
            log.warning("fleet store %s: routing vectors not listed (%s); embedding here", self.url, exc)
            return {}
        want = [n for n in names if n in there]

        def one(name: str) -> Optional[tuple[str, Any]]:
            try:
                raw = bytes(self.bucket.get(f"routing/{space}/{name}.npy"))
                arr = np.load(io.BytesIO(raw), allow_pickle=False)
            except (StoreError, TransferError, ValueError, OSError) as exc:
                log.warning("fleet store %s: routing vectors %s unreadable (%s); embedding here", self.url, name, exc)
                return None
            if arr.dtype != np.float32 or arr.ndim != 2 or not np.isfinite(arr).all():
                return None
            return name, arr

        with ThreadPoolExecutor(max_workers=8) as pool:
            got = [g for g in pool.map(one, want) if g is not None]
        self.counters["gets"] += len(want)
        return dict(got)

    def put_vectors(self, space: str, rows: dict[str, Any]) -> None:
        """Share routing rows this worker embedded (written once; a failure only costs a re-embed elsewhere)."""
        import io

        import numpy as np

        def one(item: tuple[str, Any]) -> None:
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(item[1], dtype=np.float32), allow_pickle=False)
            try:
                self.bucket.put(f"routing/{space}/{item[0]}.npy", buf.getvalue(), create=True)
            except (StoreError, TransferError) as exc:
                log.warning("fleet store %s: routing vectors %s not shared: %s", self.url, item[0], exc)

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(one, rows.items()))
        self.counters["puts"] += len(rows)

    # ------------------------------------------------------------------ shared files
    def put_file(self, name: str, path: Path) -> None:
        """Share a file beside the blocks (``files/<name>``, overwritten): e.g. a snapshot of a page
        index, so that a new worker asks a long document without re-embedding its passages."""
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ConfigError(f"{name!r} is not a relative file name")
        self.bucket.put(f"files/{name}", Path(path), create=False)
        self.counters["puts"] += 1

    def list_files(self, prefix: str) -> list[dict[str, Any]]:
        """The files shared under ``prefix`` (`put_file()` names): ``name``, ``size`` and ``e_tag`` each."""
        base = f"files/{prefix}"
        return [{"name": o["path"][len("files/"):], "size": o.get("size"), "e_tag": o.get("e_tag")}
                for o in self.bucket.list(base) if o["path"].startswith(base)]

    def get_file(self, name: str, dest: Path) -> bool:
        """Download ``files/<name>`` to ``dest`` (atomically); False if there is none."""
        from .local import atomic_file

        try:
            data = self.bucket.get(f"files/{name}")
        except BlockNotFound:
            return False
        self.counters["gets"] += 1
        self.counters["get_bytes"] += len(data)
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(Path(dest)) as f:
            f.write(memoryview(data))
        return True

    def collect_garbage(self, *, grace: float = DEFAULT_GRACE) -> dict[str, int]:
        """Remove block objects without a marker (deleted, or left by a worker killed between its
        block and its marker), tombstones whose marker is gone and large uploads left in ``uploads/`` by
        a worker killed before their copy, once older than ``grace`` seconds. Safe while workers run: a
        reader that listed a block before its delete has ``grace`` seconds to fetch it."""
        now = time.time()
        markers = {bid for o in self.bucket.list("index") if (bid := _id_of(o["path"], "index", ".json"))}
        removed = tombs = 0
        for o in self.bucket.list("blocks"):
            bid = _id_of(o["path"], "blocks", BLOCK_SUFFIX)
            if bid and bid not in markers and now - o["last_modified"].timestamp() > grace:
                self.bucket.delete(_block_key(bid))
                removed += 1
        for o in self.bucket.list("tombstones"):
            bid = _id_of(o["path"], "tombstones")
            if bid and bid not in markers and now - o["last_modified"].timestamp() > grace:
                self.bucket.delete(_tomb_key(bid))
                tombs += 1
        uploads = 0
        for o in self.bucket.list("uploads"):
            if now - o["last_modified"].timestamp() > grace:
                self.bucket.delete("uploads/" + o["path"].rsplit("/", 1)[-1])
                uploads += 1
        return {"blocks_removed": removed, "tombstones_removed": tombs, "uploads_removed": uploads}

    def upload_store(self, source: Store, *, progress: Optional[Callable[[int, int], None]] = None) -> list[str]:
        """Upload every block of a local store (block files as they are, markers with their
        provenance) into this bucket; blocks already there are skipped. Returns the ids uploaded."""
        blocks = source.list()
        done: list[str] = []
        for i, block in enumerate(blocks):
            if not self.contains(block.id):
                self._upload(block, source.path_of(block.id), block.provenance or PROVENANCE_UNVERIFIED,
                             bool(block.labels_trusted), replace=False)
                done.append(block.id)
            if progress is not None:
                progress(i + 1, len(blocks))
        return done


def open_store(spec: "str | os.PathLike[str] | None", **kwargs: Any) -> "Store | FleetStore":
    """A local `Store` for a directory (or None: the default home), a `FleetStore` for ``s3://...``."""
    if is_remote(spec):
        return FleetStore(str(spec), **kwargs)
    return Store(spec, **{k: v for k, v in kwargs.items() if k == "lock_timeout"})

