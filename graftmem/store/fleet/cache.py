"""The fleet store's read-through cache: a local [`Store`][graftmem.Store] that a block enters after
it was downloaded and checked, written behind the graft that asked for it, prefetched in the
background for the pager, and kept under its cap by LRU eviction.

Why the download lands in memory (`Landing`): writing 69 MB into a new file and reading it back cost
more than the download itself (bench/fleet.py: fetch 190-260 ms staged on disk, 55-80 ms into memory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from ...core.blocks import Block, Fingerprint
from ...core.errors import BlockCorrupted, BlockNotFound, StoreError, TransferError
from ...core.format import HEADER, TRAILER_LEN, state_hasher
from ..home import BLOCK_SUFFIX
from ...core.identity import incompatibility
from ..local import Store, check_head
from ..remote import Bucket
from .index import BucketIndex
from .layout import block_key

__all__ = ["Landing", "ReadCache"]

log = logging.getLogger("graftmem")


class Landing:
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


class ReadCache:
    """Blocks of a bucket on this machine: ``store`` (a local `Store`) holds the checked copies,
    ``index`` says what the bucket holds (manifests, file sizes) and when each copy was last used."""

    def __init__(self, store: Store, index: BucketIndex, bucket: Bucket, *, url: str, cache_bytes: int,
                 counters: dict[str, int]) -> None:
        self.store, self.index, self.bucket, self.url, self.counters = store, index, bucket, url, counters
        self.cache_bytes = int(cache_bytes)
        self.fetch_parts = 4  #: concurrent range requests per block download (above 8 MiB)
        self._lock = threading.RLock()
        self._closed = False
        self._prefetches: dict[str, Future] = {}  # block id -> its prefetch, until it ends
        self._prefetcher: Optional[ThreadPoolExecutor] = None
        self._writer: Optional[ThreadPoolExecutor] = None  #: writes fetched blocks into the cache
        self._writes: dict[str, Future] = {}  #: block id -> its cache write in progress
        self._use = threading.Lock()  #: a cache hit's "used now" against an eviction's order (`evict`)

    def close(self) -> None:
        """Let running prefetches and the cache writes in progress land, drop queued prefetches."""
        with self._lock:
            self._closed = True
            pool, self._prefetcher = self._prefetcher, None
        if pool is not None:  # let running prefetches land (they write into the cache), drop queued ones
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:  # blocks fetched so far enter the cache before it closes
            writer.shutdown(wait=True)

    # ------------------------------------------------------------------ reads
    def drop(self, bid: str) -> None:
        """Remove a block's cached copy (deleted in the bucket, or damaged here)."""
        self.wait(bid)  # a write behind would bring it back
        if self.store.contains(bid):
            with contextlib.suppress(BlockNotFound):
                self.store.delete(bid, cascade=True)
        self.index.forget_use(bid)

    def path_of(self, bid: str) -> Path:
        """The cached file of a block, fetched (and checked) first if it is not cached."""
        self.wait(bid)
        if not self.store.contains(bid):
            self.read_state(bid, self.index.get(bid), lambda n: memoryview(bytearray(n)))
            self.wait(bid)
        return self.store.path_of(bid)

    def read_state(self, bid: str, meta: Block, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """A block's state in ``buffer(n)``, checked, from the cache or else from the bucket (`fetch`);
        ``meta`` is its marker's manifest, which is what is returned."""
        self.wait(bid)  # fetched a moment ago and being written: read it from the cache
        with self._use:  # used from now on: an eviction that runs during the read keeps it (`evict`)
            hit = self.store.contains(bid)
            if hit:
                self.index.touch(bid)
        if hit:
            try:
                _, view = self.store.read_state(bid, buffer, fingerprint=fingerprint, timings=timings)
                self.counters["cache_hits"] += 1
                return meta, view
            except BlockNotFound:
                pass
            except BlockCorrupted as exc:  # the local copy rotted: drop it, fetch a checked one again
                log.warning("fleet store %s: cached block %s is damaged (%s); fetching it again", self.url,
                            bid[:12], exc)
                self.drop(bid)
        return self.fetch(bid, meta, buffer, fingerprint, timings)

    def fetch(self, bid: str, meta: Block, buffer: Callable[[int], memoryview],
              fingerprint: Optional[Fingerprint], timings: Optional[dict[str, float]]) -> tuple[Block, memoryview]:
        """Download a block file into memory, check all of it, return its state; cache it behind.

        The parts land in memory (``fetch_parts`` concurrent range requests); each part's state bytes
        are copied into ``buffer`` as it lands, where the marker says the state lies, and hashed in
        file order as soon as every part before it has landed (`Landing`). Then the whole file is
        checked as the local reader checks it (`check_head`: header, trailer, manifest, id, size; the
        parts join up; the fingerprint; BLAKE3 of the bytes in ``buffer``; the marker's digest) before
        anything is returned, so before anything is grafted. Only then is the cache file written, from
        the same downloaded bytes, on the cache writer thread (`flush` waits for it; a read of the same
        block waits for it too); it is checked again with BLAKE3 on its first read, as any new file."""
        key = block_key(bid)
        where = f"{self.url}/{key}"
        t0 = time.perf_counter()
        size = self.index.file_size(bid)
        slen = meta.state_size
        soff = size - slen - TRAILER_LEN  # where the marker says the state lies: the header must agree
        landing = Landing(buffer(slen), soff) if size and soff >= HEADER.size else None

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
                landing = Landing(buffer(hlen), hoff)
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
        # used now, not when the write behind ends: a read of another block may come in between, and the
        # cap must evict by the order of the reads (test_the_cache_is_capped_least_recently_used_first)
        self.index.touch(bid)
        self._cache_behind(bid, meta, parts, got)
        return meta, view

    # ------------------------------------------------------------------ writes behind the graft
    def _cache_behind(self, bid: str, meta: Block, parts: list[tuple[int, Any]], size: int) -> None:
        """Write checked bytes into the cache on the writer thread (the graft does not wait for it)."""
        with self._lock:
            if bid in self._writes or (self._closed and self._writer is None):
                return  # on its way already; or closed (running prefetches still land: close waits)
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graftmem-cache-write",
                                                  initializer=_background_priority)
            self._writes[bid] = self._writer.submit(self._write_cached, bid, meta, parts, size)

    def _write_cached(self, bid: str, meta: Block, parts: list[tuple[int, Any]], size: int) -> None:
        stage_dir = self.store.layout.staging
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
            self.store.adopt([(staged, tmp)])
            # by the order of the reads, the most recent one kept: not ``bid``, which other reads (cache hits
            # of blocks this write's eviction would otherwise have removed) may have passed since its fetch
            self.evict()
        except (OSError, StoreError) as exc:  # a cache that cannot take it: the read was served anyway
            log.warning("fleet store %s: block %s not cached: %s", self.url, bid[:12], exc)
            self.index.forget_use(bid)
        finally:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._writes.pop(bid, None)

    def wait(self, bid: str) -> None:
        """Wait for the cache write of ``bid`` in progress, if any."""
        with self._lock:
            fut = self._writes.get(bid)
        if fut is not None:
            fut.result()

    def flush(self) -> None:
        """Wait until the blocks fetched or prefetched so far are in the cache."""
        with self._lock:
            prefetches = list(self._prefetches.values())
        for fut in prefetches:
            fut.result()
        with self._lock:
            futs = list(self._writes.values())
        for fut in futs:
            fut.result()

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, block_ids: list[str]) -> list[Future]:
        """Fetch blocks into the cache in the background (two at a time), checked on arrival as any
        fetch; blocks already cached or on their way are skipped. A failure is logged, never raised."""
        futures = []
        for bid in block_ids:
            with self._lock:
                if bid in self._prefetches or bid in self._writes or self._closed:
                    continue
                if self.store.contains(bid):
                    continue
                if self._prefetcher is None:
                    self._prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="graftmem-prefetch")
                fut = self._prefetches[bid] = self._prefetcher.submit(self._prefetch_one, bid)
                futures.append(fut)
        return futures

    def _prefetch_one(self, bid: str) -> bool:
        try:
            if not self.store.contains(bid):
                full = self.index.resolve(bid)
                self.read_state(full, self.index.get(full), lambda n: memoryview(bytearray(n)))
                self.wait(bid)  # done means cached
            return True
        except Exception as exc:  # noqa: BLE001 - a prefetch is a hint: the graft that needs the block fetches it again
            log.warning("fleet store %s: prefetch of %s failed: %s", self.url, bid[:12], exc)
            return False
        finally:
            with self._lock:
                self._prefetches.pop(bid, None)

    # ------------------------------------------------------------------ eviction
    def evict(self, keep: Optional[str] = None) -> None:
        """Remove least recently used blocks until the cache is under its cap; ``keep`` (the block being
        read; None: the most recently used one) stays even if the cap is smaller than it. Under the lock
        a cache hit takes to mark its block used before reading it: a hit that began before is in the
        order (its block the most recent one), one that begins after finds what is left."""
        with self._use:
            self._evict(keep)

    def _evict(self, keep: Optional[str]) -> None:
        size = self.store.stats().bytes_on_disk
        if size <= self.cache_bytes:
            return
        order = self.index.least_recently_used()
        if keep is None and order:
            keep = order[-1]
        cached = {b.id: b for b in self.store.list()}
        order += [bid for bid in cached if bid not in set(order)]
        for bid in order:
            if size <= self.cache_bytes:
                break
            if bid == keep or bid not in cached or not self.store.contains(bid):
                continue
            gone = self.store.delete(bid, cascade=True)
            for g in gone:
                size -= cached[g].state_size if g in cached else 0
                self.index.forget_use(g)
            log.debug("fleet cache %s: evicted %s", self.store.home, ", ".join(g[:12] for g in gone))
