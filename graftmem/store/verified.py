"""Verified once per file version, checked on every read: a cheap checksum layered under BLAKE3.

Why: checking a block's BLAKE3 ``state_digest`` costs about as much as reading the 20-95 MB state
(5-9 ms at 3,000 SmolLM2 tokens on 2 cores), on every graft, and a hot block is grafted again and
again. What each digest defends against (docs/format.md has the whole threat model):

* BLAKE3 (``state_digest`` in the manifest, cryptographic) binds the state bytes to the manifest: a
  signature over the manifest covers the state, and nobody can make other bytes with the same digest.
  It is checked on the first read of every file version in a process, at import, pull and export.
* xxh3-128 (not cryptographic, ~20x cheaper) is computed here over bytes that just passed the BLAKE3
  check and remembered in this process only, keyed by the file's identity and version
  (device, inode, size, mtime_ns, ctime_ns) and by the manifest's BLAKE3 digest. Later reads of the
  same file version check xxh3 while reading. It catches what happens to bytes at rest or in flight
  between two reads (a flipped bit on disk or in the page cache, a truncation, a stray write that left
  the timestamps alone); 2^-128 is the chance that a random change keeps it. It does not defend against
  an adversary who crafts a collision, and does not need to: any change made through the file system
  changes ``ctime`` (which no user-space call can set back), so the next read misses this cache and pays
  the full BLAKE3 check again, and a writer who can replace the file can replace its manifest digest
  and trailer just as well (neither is keyed), so BLAKE3 alone never defended against a local writer:
  signatures and re-derivation do (docs/trust.md).

Nothing is written to disk: the block format, the manifest and the index are unchanged, and a new
process starts with an empty cache (its first read of each block checks BLAKE3).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol

import xxhash

__all__ = ["CHUNK", "FileVersion", "chunked_digest", "file_version", "remember", "recall", "forget", "read_hashed"]


class Hasher(Protocol):
    """What `read_hashed` feeds the bytes to on a first read (a ``blake3.blake3``)."""

    def update(self, data: memoryview, /) -> object: ...

#: Read size of the checked fast path: hashed while still in the core's L2 (1 MiB per core here).
CHUNK = 1 << 20
#: Read-and-hash unit of `read_hashed()` (one worker, one core each): big enough that the hand-offs cost
#: little (17 for a 69 MB state), small enough that a chunk is hashed while it is still in the cache.
OVERLAP_CHUNK = 4 << 20
#: Reader threads at least (the pool has two per usable core), shared by concurrent restores (the server's
#: engine pool): their chunks are served in the order queued.
READ_WORKERS = 4
#: File versions remembered per process (an entry is ~100 bytes).
MAX_ENTRIES = 4096

FileVersion = tuple[int, int, int, int, int, str]

_lock = threading.Lock()
_seen: "OrderedDict[FileVersion, bytes]" = OrderedDict()


def file_version(fd: int, state_digest: str) -> FileVersion:
    """The key of one version of an open file: what any write through the file system changes."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, state_digest)


def remember(key: FileVersion, digest: bytes) -> None:
    """Record the xxh3-128 of state bytes that passed the BLAKE3 check for this file version."""
    with _lock:
        _seen[key] = digest
        _seen.move_to_end(key)
        while len(_seen) > MAX_ENTRIES:
            _seen.popitem(last=False)


def recall(key: FileVersion) -> bytes | None:
    with _lock:
        got = _seen.get(key)
        if got is not None:
            _seen.move_to_end(key)
        return got


def forget(key: FileVersion) -> None:
    with _lock:
        _seen.pop(key, None)


_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _in_flight() -> int:
    """Chunks a first read keeps in flight: one per usable core (at least 2, so that reading overlaps the
    hashing on one core too)."""
    from ..core.engine import usable_cores  # the one rule for "cores this process may use"

    return max(2, usable_cores())


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(READ_WORKERS, 2 * _in_flight()), thread_name_prefix="graftmem-read")
        return _pool


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (short reads looped); fewer bytes only at end of file."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got


def _read_chunk(fd: int, view: memoryview, offset: int) -> tuple[int, bytes]:
    """Read one chunk and hash it on the same core while its bytes are still in the cache."""
    n = _pread_full(fd, view, offset)
    return n, xxhash.xxh3_128(view[:n]).digest()


def chunked_digest(chunk_digests: list[bytes]) -> bytes:
    """The remembered digest of a state: xxh3-128 over the xxh3-128 of each `OVERLAP_CHUNK` of it, in
    order (`read_hashed`). In this process only (never written), so its definition may change freely."""
    return xxhash.xxh3_128(b"".join(chunk_digests)).digest()


def read_hashed(f: io.FileIO, view: memoryview, strong: Optional[Hasher] = None) -> tuple[int, bytes]:
    """Fill ``view`` from ``f`` (from its current position) and return the bytes read (short on a
    truncated file) and their `chunked_digest`; ``strong`` (a BLAKE3 hasher: the first read of a file
    version) is updated with the bytes in order while the later chunks are still being read.

    Why chunks on every core: reading from the page cache is a copy the kernel makes on the reading
    core, and hashing is another pass over the same bytes. Each `OVERLAP_CHUNK` is read and hashed
    (xxh3-128; the binding holds the GIL while it hashes, and a ctypes call into the same xxh3 that
    releases it measured no faster) by a worker (a later read queues every chunk at once), so the check
    runs on every core while the bytes are still in its cache instead of a second pass on one core
    (the previous design read on a worker and hashed on this thread: two cores, one pass each). The
    BLAKE3 of a first read is fed here, in order, as the chunks land, instead of a pass after the read
    (the cost #44 measured: 4.8 ms on top of a 7 ms read at 3,000 SmolLM2 tokens). Each chunk is hashed
    after it landed in ``view``, which only this call writes, so the digests are of the bytes returned;
    every worker has finished with ``view`` when this returns or raises. Without ``os.preadv`` (some
    platforms), the same in one thread.
    """
    size = len(view)
    start = f.tell()
    if not hasattr(os, "preadv") or size <= OVERLAP_CHUNK:
        got, parts = 0, []
        while got < size:
            end = min(got + OVERLAP_CHUNK, size)
            h = xxhash.xxh3_128()
            while got < end:
                n = f.readinto(view[got:min(got + CHUNK, end)])
                if not n:
                    break
                h.update(view[got:got + n])
                if strong is not None:
                    strong.update(view[got:got + n])
                got += n
            parts.append(h.digest())
            if got < end:  # end of file: truncated
                break
        return got, chunked_digest(parts)
    fd = f.fileno()
    pool = _readers()
    offs = list(range(0, size, OVERLAP_CHUNK))
    pending: "deque[Future[tuple[int, bytes]]]" = deque()

    def submit(i: int) -> None:
        o = offs[i]
        pending.append(pool.submit(_read_chunk, fd, view[o:min(o + OVERLAP_CHUNK, size)], start + o))

    # a later read (no ``strong``) queues every chunk at once: with a window of one chunk per core, each
    # next chunk waited for this thread to be scheduled between the two busy readers (on 2 cores, restore /
    # floor 1.30-1.35 with the window, 1.13-1.16 without, #44). A first read keeps the window: this thread
    # feeds BLAKE3, which hashes on every core (`state_hasher`), in step with the readers
    ahead = len(offs) if strong is None else min(len(offs), _in_flight())
    for i in range(ahead):
        submit(i)
    got, parts = 0, []
    try:
        for i, o in enumerate(offs):
            n, d = pending.popleft().result()  # an OSError of the read is raised here
            want = min(OVERLAP_CHUNK, size - o)
            if n == want and i + ahead < len(offs):
                submit(i + ahead)
            if strong is not None:
                strong.update(view[o:o + n])
            parts.append(d)
            got += n
            if n < want:  # end of file: truncated
                break
    finally:
        for fut in pending:  # chunks read past a truncation or an error still write into ``view``
            with contextlib.suppress(Exception):
                fut.result()
    f.seek(start + got)
    return got, chunked_digest(parts)
