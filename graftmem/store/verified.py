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
  same file version check xxh3 while reading, or, on a graft, while llama.cpp copies the bytes (`Later`). It catches what happens to bytes at rest or in flight
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
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Protocol

import xxhash

__all__ = ["CHUNK", "FileVersion", "Later", "chunked_digest", "file_version", "remember", "recall", "forget",
           "read_hashed"]


class Hasher(Protocol):
    """What `read_hashed` feeds the bytes to on a first read (a ``blake3.blake3``)."""

    def update(self, data: memoryview, /) -> object: ...

#: Read size of the checked fast path: hashed while still in the core's L2 (1 MiB per core here).
CHUNK = 1 << 20
#: Read-and-hash unit of `read_hashed()` (one worker, one core each): big enough that the hand-offs cost
#: little (17 for a 69 MB state), small enough that a chunk is hashed while it is still in the cache.
OVERLAP_CHUNK = 4 << 20
#: Reader threads at least (the pool has two per usable core): concurrent restores (the server's engine
#: pool) share them, their chunks served in the order queued.
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
    """Chunks read at once: one per usable core (at least 2, so that reading overlaps the hashing on
    one core too)."""
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


def _read_chunk(fd: int, view: memoryview, offset: int, hash_now: bool) -> tuple[int, bytes]:
    """Read one chunk and (``hash_now``) hash it on the same core while its bytes are still in the cache."""
    n = _pread_full(fd, view, offset)
    return n, xxhash.xxh3_128(view[:n]).digest() if hash_now else b""


def _chunks_digest(view: memoryview) -> bytes:
    """`chunked_digest` of ``view`` cut in `OVERLAP_CHUNK` pieces, on the calling thread (one core)."""
    return chunked_digest([xxhash.xxh3_128(view[o:o + OVERLAP_CHUNK]).digest()
                           for o in range(0, len(view), OVERLAP_CHUNK)])


def chunked_digest(chunk_digests: list[bytes]) -> bytes:
    """The remembered digest of a state: xxh3-128 over the xxh3-128 of each `OVERLAP_CHUNK` of it, in
    order (`read_hashed`). In this process only (never written), so its definition may change freely."""
    return xxhash.xxh3_128(b"".join(chunk_digests)).digest()


def read_hashed(f: io.FileIO, view: memoryview, strong: Optional[Hasher] = None, *,
                hash_now: bool = True) -> tuple[int, bytes]:
    """Fill ``view`` from ``f`` (from its current position) and return the bytes read (short on a
    truncated file) and their `chunked_digest`; ``strong`` (a BLAKE3 hasher: the first read of a file
    version) is updated with the bytes in order while the later chunks are still being read.

    Why chunks on every core: reading from the page cache is a copy the kernel makes on the reading
    core, and hashing is another pass over the same bytes. Each `OVERLAP_CHUNK` is read and hashed
    (xxh3-128, which releases the GIL) by a worker, every chunk queued at once, so the check
    runs on every core while the bytes are still in its cache instead of a second pass on one core
    (the previous design read on a worker and hashed on this thread: two cores, one pass each). The
    BLAKE3 of a first read is fed here, in order, as the chunks land, instead of a pass after the read
    (the cost #44 measured: 4.8 ms on top of a 7 ms read at 3,000 SmolLM2 tokens). Each chunk is hashed
    after it landed in ``view``, which only this call writes, so the digests are of the bytes returned;
    every worker has finished with ``view`` when this returns or raises. Without ``os.preadv`` (some
    platforms), the same in one thread.

    ``hash_now=False`` (no ``strong``): the chunks are only read, and the digest returned is empty; the
    caller checks the bytes later (`Later`), while llama.cpp copies them.
    """
    size = len(view)
    start = f.tell()
    if strong is not None and not hash_now:
        raise ValueError("a first read hashes while reading")
    if not hasattr(os, "preadv") or size <= OVERLAP_CHUNK:
        got, parts = 0, []
        while got < size:
            end = min(got + OVERLAP_CHUNK, size)
            h = xxhash.xxh3_128()
            while got < end:
                n = f.readinto(view[got:min(got + CHUNK, end)])
                if not n:
                    break
                if hash_now:
                    h.update(view[got:got + n])
                if strong is not None:
                    strong.update(view[got:got + n])
                got += n
            parts.append(h.digest())
            if got < end:  # end of file: truncated
                break
        return got, chunked_digest(parts) if hash_now else b""
    fd = f.fileno()
    pool = _readers()
    offs = list(range(0, size, OVERLAP_CHUNK))
    # every chunk queued at once: with a window of one chunk per core, each next chunk waited for this
    # thread to be scheduled between the busy workers (on 2 cores: read 4.2 ms instead of 3.0, #44)
    pending: "deque[Future[tuple[int, bytes]]]" = deque(
        pool.submit(_read_chunk, fd, view[o:min(o + OVERLAP_CHUNK, size)], start + o, hash_now) for o in offs)
    got, parts = 0, []
    try:
        for o in offs:
            n, d = pending.popleft().result()  # an OSError of the read is raised here
            want = min(OVERLAP_CHUNK, size - o)
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
    return got, chunked_digest(parts) if hash_now else b""


class Later:
    """The per-read checks a reader leaves for its caller to finish: what lets the xxh3-128 of a
    verified file version run while llama.cpp copies the bytes, instead of before.

    Why: on a hot graft from the page cache the read, the check and ``llama_state_seq_set_data`` are
    three passes over the same 20-95 MB, and on a 2-core CPU the check's pass competed with the read
    for both cores (restore / floor 1.22-1.34, #44). ``set_data`` copies on one core and leaves the
    other idle: the check runs there instead (measured: restore / floor ~1.0, docs/benchmarks.md).

    What keeps it safe: only the *later* reads of a file version are deferred, whose bytes passed BLAKE3
    in this process and whose parse (header, trailer, manifest, fingerprint) was checked before any byte
    of the state was read; the buffer is this process's own and nothing writes it until `wait`
    returns; the caller that handed the bytes to llama.cpp calls `wait` before anything is computed
    from them and clears the cells if it raises (`graftmem.memory.answer.graft`). A first read (BLAKE3)
    is never deferred. Use as a context manager: leaving it waits for every check still running (so no
    worker reads a buffer that is about to be reused), raising nothing of its own if the block is left
    by an exception.
    """

    def __init__(self) -> None:
        self._checks: list[tuple[Future[bytes], bytes, FileVersion, str]] = []
        self._then: list[Callable[[], None]] = []

    def check(self, view: memoryview, expected: bytes, key: FileVersion, where: str) -> None:
        """Start hashing ``view`` (just read, not written again until `wait`) on a reader thread; `wait`
        compares it with ``expected``, the xxh3-128 remembered for ``key``."""
        self._checks.append((_readers().submit(_chunks_digest, view), expected, key, where))

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every check passed (at once if none is pending): what may only see checked
        bytes, such as the hot tier's copy."""
        if self._checks:
            self._then.append(fn)
        else:
            fn()

    @property
    def pending(self) -> bool:
        return bool(self._checks)

    def wait(self) -> float:
        """Finish every check; the milliseconds this waited. A changed byte is
        [`BlockCorrupted`][graftmem.BlockCorrupted] (and its file version forgotten: the next read checks
        BLAKE3 again), as the reader would have raised it."""
        from ..core.errors import BlockCorrupted  # the store's error type, raised where the check ends

        t0 = time.perf_counter()
        checks, self._checks = self._checks, []
        then, self._then = self._then, []
        failed: Optional[BlockCorrupted] = None
        for fut, expected, key, where in checks:
            seen = fut.result()
            if seen != expected and failed is None:
                forget(key)
                failed = BlockCorrupted(f"{where}: state changed since it was verified: xxh3-128 expected "
                                        f"{expected.hex()}, actual {seen.hex()}", path=where,
                                        expected=expected.hex(), actual=seen.hex())
        if failed is not None:
            raise failed
        for fn in then:
            fn()
        return (time.perf_counter() - t0) * 1e3

    def __enter__(self) -> "Later":
        return self

    def __exit__(self, *exc: object) -> None:
        for fut, *_ in self._checks:
            with contextlib.suppress(Exception):
                fut.result()
        self._checks, self._then = [], []
