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

import io
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import xxhash

__all__ = ["CHUNK", "FileVersion", "file_version", "remember", "recall", "forget", "read_hashed"]

#: Read size of the checked fast path: hashed while still in the core's L2 (1 MiB per core here).
CHUNK = 1 << 20
#: Read size when reading and hashing overlap (`read_hashed()`): big enough that the hand-off between
#: the two threads costs little (17 hand-offs for a 69 MB state), small enough to stay in the L3 cache.
OVERLAP_CHUNK = 4 << 20
#: Concurrent restores (the server's engine pool) each keep one read in flight at most.
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


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="graftmem-read")
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


def read_hashed(f: io.FileIO, view: memoryview) -> tuple[int, bytes]:
    """Fill ``view`` from ``f`` (from its current position) and return the bytes read (short on a
    truncated file) and their xxh3-128.

    Why two threads: xxhash holds the GIL while it hashes (~2.3 ms for 69 MB here), but a read
    releases it while the kernel copies from the page cache (~5 ms). A worker reads chunk i+1 while
    this thread hashes chunk i, so the check costs little more than the read alone (measured:
    5.3-5.5 ms vs 6.9 ms one after the other, 5.1 ms read only; bench/graft_speed.py). Each chunk is
    hashed after it landed in ``view``, which only this call writes, so the digest is of the bytes
    that are returned. Without ``os.preadv`` (some platforms), the same in one thread.
    """
    h = xxhash.xxh3_128()
    size = len(view)
    start = f.tell()
    if not hasattr(os, "preadv") or size <= OVERLAP_CHUNK:
        got = 0
        while got < size:
            n = f.readinto(view[got:min(got + CHUNK, size)])
            if not n:
                break
            h.update(view[got:got + n])
            got += n
        return got, h.digest()
    fd = f.fileno()
    pool = _readers()
    offs = list(range(0, size, OVERLAP_CHUNK))

    def read(o: int) -> "Future[int]":
        return pool.submit(_pread_full, fd, view[o:min(o + OVERLAP_CHUNK, size)], start + o)

    got = 0
    pending = read(offs[0])
    for i, o in enumerate(offs):
        n = pending.result()  # an OSError of the read is raised here
        want = min(OVERLAP_CHUNK, size - o)
        if n == want and i + 1 < len(offs):
            pending = read(offs[i + 1])
        h.update(view[o:o + n])
        got += n
        if n < want:  # end of file: truncated
            break
    f.seek(start + got)
    return got, h.digest()
