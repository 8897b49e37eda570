"""`FleetStore`: the [`BlockStore`][graftmem.store.BlockStore] over a bucket, composed of the
fleet's rooms: the index mirror (`index`), the read-through cache (`cache`), the writes (`writes`),
what workers share beside the blocks (`shared`) and garbage collection (`gc`). The package doc
(`graftmem.store.fleet`) says what is consistent when and why."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
import os
import sqlite3
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ...core.blocks import PROVENANCE_LOCAL, PROVENANCE_UNVERIFIED, Block, Fingerprint, StoreStats
from ...core.errors import BlockNotFound, ConfigError, StoreError
from ..home import Home
from ..local import Store
from ..protocol import BlockStore
from ..remote import Bucket, RetryPolicy, parse_url
from .cache import ReadCache
from .gc import DEFAULT_GRACE, collect_garbage
from .index import BucketIndex
from .shared import SharedFiles
from .sightings import FleetSightings
from .writes import BucketWriter

__all__ = ["FleetStore", "default_cache_dir", "open_store", "is_remote", "DEFAULT_CACHE_BYTES",
           "DEFAULT_POLL_INTERVAL"]

log = logging.getLogger("graftmem")

#: Default cap of a worker's block cache: 20 GiB (about 300 SmolLM2 3,000-token blocks, or 6 Gemma 3
#: 270M 32k pages at f16). Set ``cache_bytes`` from the blocks a worker grafts in a working day.
DEFAULT_CACHE_BYTES = 20 << 30
#: Seconds between two listings of the bucket (the delay before a worker sees another's learn).
DEFAULT_POLL_INTERVAL = 2.0


def is_remote(spec: object) -> bool:
    """Whether a store spec names object storage (``s3://...``) rather than a directory."""
    return isinstance(spec, str) and spec.startswith("s3://")


def default_cache_dir(url: str) -> Path:
    """``<user cache dir>/graftmem/fleet/<sha256(url)[:16]>``: one cache per bucket URL and endpoint."""
    import platformdirs

    key = f"{url}\n{os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL') or ''}"
    return Path(platformdirs.user_cache_dir("graftmem")) / "fleet" / hashlib.sha256(key.encode()).hexdigest()[:16]


class FleetStore:
    """A block store in an S3-compatible bucket with a local read-through cache (see the package doc).

    ``url`` is ``s3://bucket[/prefix]``; ``cache_dir`` defaults to `default_cache_dir`; ``cache_bytes``
    caps the cache (LRU eviction, the block being read is never evicted); ``poll_interval`` is the
    seconds between listings; ``retry`` the bounded retries of each request. A fetched block enters
    ``cache`` (a local `Store`) behind the graft that fetched it: `flush` before looking into it.
    """

    #: other workers share these blocks: their learns are seen at the next listing
    remote = True

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
        self.counters = {"gets": 0, "get_bytes": 0, "puts": 0, "put_bytes": 0, "lists": 0, "cache_hits": 0}
        try:
            self._index = BucketIndex(self.bucket, root / "fleet.sqlite", url=url, poll_interval=poll_interval,
                                      timeout=lock_timeout, counters=self.counters, on_gone=self._on_gone)
        except sqlite3.Error as exc:
            self.cache.close()
            raise StoreError(f"cannot open the fleet index in {root}: {exc}") from exc
        self._reads = ReadCache(self.cache, self._index, self.bucket, url=url, cache_bytes=cache_bytes,
                                counters=self.counters)
        self._writer = BucketWriter(self.bucket, self._index, self._reads, url=url, counters=self.counters)
        self._shared = SharedFiles(self.bucket, url=url, counters=self.counters)
        #: the fleet's prompt-prefix sightings and learn leases (`graftmem.store.fleet.sightings`): the
        #: prompt cache counts in the bucket, so a prefix seen once on each of two workers is due
        self.sightings = FleetSightings(self.bucket, url=url, counters=self.counters)
        try:
            self.refresh(force=True)
        except BaseException:
            self.close()
            raise

    def _on_gone(self, bid: str) -> None:
        self._reads.drop(bid)

    # ------------------------------------------------------------------ settings (kept by the rooms)
    @property
    def poll_interval(self) -> float:
        """Seconds between two listings of the bucket."""
        return self._index.poll_interval

    @poll_interval.setter
    def poll_interval(self, value: float) -> None:
        self._index.poll_interval = float(value)

    @property
    def cache_bytes(self) -> int:
        """The cap of this worker's cache (LRU eviction above it)."""
        return self._reads.cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: int) -> None:
        self._reads.cache_bytes = int(value)

    @property
    def fetch_parts(self) -> int:
        """Concurrent range requests per block download (above 8 MiB)."""
        return self._reads.fetch_parts

    @fetch_parts.setter
    def fetch_parts(self, value: int) -> None:
        self._reads.fetch_parts = int(value)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._reads.close()
        self._index.close()
        self.cache.close()

    def __repr__(self) -> str:
        return f"FleetStore({self.url!r}, cache={str(self.home)!r})"

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """The cache's lock (serializes this machine's writers; the bucket needs none: writes are
        create-once)."""
        return self.cache.lock()

    # ------------------------------------------------------------------ listing (the index)
    def refresh(self, *, force: bool = False) -> bool:
        """List the bucket (markers and tombstones) and bring the local index up to date, if
        ``poll_interval`` has passed or ``force``; True if anything changed. Deleted blocks leave the
        cache too."""
        return self._index.refresh(force=force)

    def data_version(self) -> int:
        """Changes whenever a listing saw another worker's learn or delete (polled at most every
        ``poll_interval`` seconds); this store's own writes do not change it, as locally."""
        self.refresh()
        return self._index.version

    def resolve(self, block_id: str) -> str:
        """Full id for an id or a unique prefix of at least 4 hex characters (one fresh listing on a miss)."""
        return self._index.resolve(block_id)

    def get(self, block_id: str) -> Block:
        """The block's manifest (from its marker), with the fleet's provenance."""
        return self._index.get(block_id)

    def contains(self, block_id: str) -> bool:
        return self._index.contains(block_id)

    def provenance(self, block_id: str) -> str:
        return self.get(block_id).provenance or PROVENANCE_UNVERIFIED

    def list(self, *, kind: str | None = None) -> list[Block]:
        return self._index.list(kind=kind)

    def children(self, block_id: str) -> builtins.list[str]:
        return self._index.children(block_id)

    def stats(self) -> StoreStats:
        """Counts and sizes of the blocks in the bucket (from the listing; no object is read)."""
        return self._index.stats()

    def routing_rows(self, *, exclude_kinds: Sequence[str] = ()) -> builtins.list[tuple[str, str, str, str | None]]:
        """As [`Store.routing_rows()`][graftmem.Store.routing_rows], over the bucket's blocks."""
        return self._index.routing_rows(exclude_kinds=exclude_kinds)

    def reconcile(self) -> dict[str, int]:
        """List the bucket now and reconcile the cache's own index with its files."""
        before = self._index.version
        self.refresh(force=True)
        rep = self.cache.reconcile()
        return {**rep, "listed_changes": self._index.version - before}

    # ------------------------------------------------------------------ reads (the cache)
    def cache_stats(self) -> dict[str, int]:
        """Blocks and bytes in this worker's cache, its cap, and the request counters of this process
        (after the cache writes in progress)."""
        self.flush()
        st = self.cache.stats()
        return {"blocks": st.blocks, "bytes": st.bytes_on_disk, "cap": self.cache_bytes, **self.counters}

    def read_manifest(self, path: Path) -> Block:
        return self.cache.read_manifest(path)

    def path_of(self, block_id: str) -> Path:
        """The cached file of a block, fetched (and checked) first if it is not cached."""
        return self._reads.path_of(self.resolve(block_id))

    def check_file(self, block_id: str) -> Block:
        """The manifest as the block's file holds it, with header, trailer and padding checked (the
        state is not read): what ``graftmem doctor`` asks of every block. A block not cached is
        fetched (and checked) first."""
        bid = self.resolve(block_id)
        self.path_of(bid)
        return self.cache.check_file(bid)

    def read_state(self, block_id: str, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """Read a block's state into ``buffer(n)``, checked, from the cache or else from the bucket.

        A cache hit is a local read (the same checks as [`Store.read_state()`][graftmem.Store.read_state]);
        a miss downloads the block file into memory, checks all of it as the local reader does (header,
        trailer, manifest id, fingerprint, BLAKE3) while copying its state into ``buffer``, and only
        then writes it into the cache, behind the graft (`ReadCache.fetch`). ``timings`` also gets
        ``fetch_ms`` on a miss (the download, with the copy and the hash that overlap it). The block
        returned is the marker's manifest; a block file whose state digest differs from its marker's
        is refused."""
        bid = self.resolve(block_id)
        return self._reads.read_state(bid, self.get(bid), buffer, fingerprint=fingerprint, timings=timings)

    def flush(self) -> None:
        """Wait until the blocks fetched or prefetched so far are in the cache (both are written behind
        the graft that asked for them); a failed prefetch was logged and is not raised here."""
        self._reads.flush()

    def prefetch(self, block_ids: builtins.list[str]) -> builtins.list[Future]:
        """Fetch blocks into the cache in the background (two at a time), checked on arrival as any
        fetch; blocks already cached or on their way are skipped. For the pager: the pages ranked
        next for a task are likely the next ones asked. A failure is logged, never raised here."""
        return self._reads.prefetch(block_ids)

    # ------------------------------------------------------------------ writes
    def put(self, block: Block, state: memoryview | bytes, *, replace: bool = False,
            provenance: str = PROVENANCE_LOCAL, labels_trusted: bool = True) -> Block:
        """Store a block in the bucket (and the cache): a block already listed is returned as is
        unless ``replace``. Written as the local store writes it, then uploaded (see the package doc)."""
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
        self._writer.upload(block, self.cache.path_of(block.id), provenance, labels_trusted, replace=replace)
        self._index.touch(block.id)
        self._reads.evict(keep=block.id)
        return block.model_copy(update={"provenance": provenance, "labels_trusted": labels_trusted})

    def adopt(self, files: builtins.list[tuple[Block, Path]]) -> builtins.list[str]:
        """Move verified block files (staged on the cache's file system) into the cache and upload
        them; blocks already in the bucket are skipped. Used by bundle import and pull."""
        todo = [(b, p) for b, p in files if not self.contains(b.id)]
        added = self.cache.adopt(todo)
        for block, _ in todo:
            if block.id in added or self.cache.contains(block.id):
                prov = block.provenance or PROVENANCE_UNVERIFIED
                self._writer.upload(block, self.cache.path_of(block.id), prov, bool(block.labels_trusted),
                                    replace=False)
                self._index.touch(block.id)
        return [b.id for b, _ in todo if b.id in added]

    def set_manifest(self, block: Block) -> None:
        """Rewrite a block's manifest (its marker: the block object is immutable). The state digest
        and id may not change."""
        cur = self.get(block.id)
        if cur.state_digest != block.state_digest:
            raise ConfigError("set_manifest may not change a block's id or state")
        labels = block.labels_trusted if block.labels_trusted is not None else cur.labels_trusted
        self._writer.rewrite_marker(block, cur.provenance or PROVENANCE_UNVERIFIED, bool(labels))
        if self.cache.contains(block.id):
            self.cache.set_manifest(block)

    def set_provenance(self, block_id: str, provenance: str, *, labels_trusted: Optional[bool] = None) -> None:
        cur = self.get(block_id)
        labels = bool(cur.labels_trusted) if labels_trusted is None else labels_trusted
        self._writer.rewrite_marker(cur, provenance, labels)
        if self.cache.contains(cur.id):
            self.cache.set_provenance(cur.id, provenance, labels_trusted=labels)

    def delete(self, block_id: str, *, cascade: bool = False) -> builtins.list[str]:
        """Delete a block (and, with ``cascade``, the blocks chained on it) for every worker: a
        tombstone first, then the marker; the block object stays for `collect_garbage`."""
        return self._writer.delete(self.resolve(block_id), cascade=cascade)

    def upload_store(self, source: BlockStore, *,
                     progress: Optional[Callable[[int, int], None]] = None) -> builtins.list[str]:
        """Upload every block of another store (block files as they are, markers with their
        provenance) into this bucket; blocks already there are skipped. Returns the ids uploaded.
        Only public verbs of ``source`` are used (``list``, ``path_of``)."""
        return self._writer.upload_store(source, progress=progress)

    def collect_garbage(self, *, grace: float = DEFAULT_GRACE) -> dict[str, int]:
        """Remove block objects without a marker, tombstones whose marker is gone and abandoned large
        uploads, once older than ``grace`` seconds (`graftmem.store.fleet.gc.collect_garbage`)."""
        return collect_garbage(self.bucket, grace=grace)

    # ------------------------------------------------------------------ shared beside the blocks
    def get_vectors(self, space: str, names: builtins.list[str]) -> dict[str, Any]:
        """Routing rows other workers embedded (``routing/<space>/<id>-<entry key>.npy``), for the
        router (`graftmem.memory.router`); missing or unreadable ones are left out (embedded locally)."""
        return self._shared.get_vectors(space, names)

    def put_vectors(self, space: str, rows: dict[str, Any]) -> None:
        """Share routing rows this worker embedded (written once; a failure only costs a re-embed elsewhere)."""
        self._shared.put_vectors(space, rows)

    def put_file(self, name: str, path: Path) -> None:
        """Share a file beside the blocks (``files/<name>``, overwritten): e.g. a snapshot of a page
        index, so that a new worker asks a long document without re-embedding its passages."""
        self._shared.put_file(name, path)

    def list_files(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """The files shared under ``prefix`` (`put_file()` names): ``name``, ``size`` and ``e_tag`` each."""
        return self._shared.list_files(prefix)

    def get_file(self, name: str, dest: Path) -> bool:
        """Download ``files/<name>`` to ``dest`` (atomically); False if there is none."""
        return self._shared.get_file(name, dest)


def open_store(spec: "str | os.PathLike[str] | None", **kwargs: Any) -> BlockStore:
    """A local `Store` for a directory (or None: the default home), a `FleetStore` for ``s3://...``."""
    if is_remote(spec):
        return FleetStore(str(spec), **kwargs)
    return Store(spec, **{k: v for k, v in kwargs.items() if k == "lock_timeout"})
