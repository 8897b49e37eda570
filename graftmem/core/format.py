"""Encode and decode the block file. Pure: works on bytes, buffers and open file objects, never paths.

Layout (all integers little-endian)::

    offset 0     header, 64 bytes
                   magic          8s   b"GRAFTMEM"
                   version        u32  FORMAT_VERSION
                   header_len     u32  64
                   manifest_len   u64  length of the manifest JSON
                   state_off      u64  offset of the state bytes (a multiple of 4096)
                   state_len      u64  length of the state bytes
                   reserved       24s  zero
    offset 64    manifest: UTF-8 JSON of [`Block`][graftmem.Block] (includes ``state_digest``)
                 zero padding up to state_off
    state_off    state bytes: llama.cpp's per-sequence state of sequence 0, untouched
    end - 32     trailer: BLAKE3 of (header || manifest || padding)

Why a two-level digest: the state is 20-70 MB and hashing it is the dominant cost of a checked
restore, so it is hashed once (``state_digest`` in the manifest) and the trailer covers header,
manifest and padding, and through ``state_digest`` the state too. BLAKE3 is cryptographic (a
tampered state cannot be made to match) and, multi-threaded, about 10x cheaper than SHA-256 here.
Padding aligns the state to a page so it can be read straight into an aligned buffer.
No pickle anywhere: a block file never executes anything when read.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from typing import BinaryIO, Callable, Iterator

import blake3

from .blocks import FORMAT_VERSION, Block
from .errors import BlockCorrupted

__all__ = ["MAGIC", "HEADER", "ALIGN", "STATE_DIGESTS", "WRITE_CHUNK", "check_algorithm", "paced", "state_digest", "state_hasher", "encode_prefix", "trailer_digest",
           "parse_header", "parse_manifest", "layout", "TRAILER_LEN", "write_block"]

MAGIC = b"GRAFTMEM"
HEADER = struct.Struct("<8sIIQQQ24s")
ALIGN = 4096
TRAILER_LEN = 32
assert HEADER.size == 64


#: The algorithms a block's ``state_digest`` may name, as ``<algorithm>:<hex>``: the digest's version.
#: Every block written so far names ``blake3`` (the whole state, BLAKE3's own tree mode, so a state
#: hashed in pieces as it is read gives the same digest as one pass). A new algorithm is added here
#: beside the old ones, never instead of them, so blocks written before keep reading
#: (tests/test_compat.py); one this graftmem does not know is refused by name (`check_algorithm`).
STATE_DIGESTS = ("blake3",)


def check_algorithm(digest: str, *, where: str) -> str:
    """The algorithm a ``state_digest`` names, or `BlockCorrupted` naming it if this graftmem cannot check it."""
    algorithm = digest.partition(":")[0]
    if algorithm not in STATE_DIGESTS:
        raise BlockCorrupted(f"{where}: state digest algorithm {algorithm!r} is not one this graftmem checks "
                             f"({', '.join(STATE_DIGESTS)}); was the block written by a newer graftmem?",
                             path=where, expected=", ".join(STATE_DIGESTS), actual=algorithm)
    return algorithm


def state_hasher(size: int) -> "blake3.blake3":
    """The BLAKE3 hasher of a state of ``size`` bytes (multi-threaded for large states), for a state
    that arrives in pieces: ``"blake3:" + h.hexdigest()`` after updating it with every piece in order
    equals `state_digest` of the whole (what a first read computes while it reads)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if size > (1 << 20) else 1)


def state_digest(state: memoryview | bytes) -> str:
    """``blake3:<hex>`` of the state bytes (multi-threaded for large states)."""
    h = state_hasher(len(state))
    h.update(state)
    return "blake3:" + h.hexdigest()


def trailer_digest(prefix: bytes) -> bytes:
    return blake3.blake3(prefix).digest()


def layout(manifest_len: int) -> int:
    """Offset of the state bytes for a manifest of this length."""
    end = HEADER.size + manifest_len
    return (end + ALIGN - 1) // ALIGN * ALIGN


def encode_prefix(block: Block) -> bytes:
    """Header, manifest and padding: everything before the state bytes."""
    manifest = block.model_dump_json().encode()
    state_off = layout(len(manifest))
    header = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, len(manifest), state_off,
                         block.state_size, b"\0" * 24)
    return header + manifest + b"\0" * (state_off - HEADER.size - len(manifest))


#: Bytes of state written between two calls of a thread's pacer (`paced`).
WRITE_CHUNK = 8 << 20

_pacing = threading.local()


@contextlib.contextmanager
def paced(pace: Callable[[], None]) -> Iterator[None]:
    """Write the state of every block this thread writes meanwhile in `WRITE_CHUNK` pieces, calling
    ``pace()`` before each.

    Why: the server learns prefixes on a writer thread after the answer, and writing a 3,000-token
    SmolLM2 prefix (two ~55 MB files: 0.22 s of copying into the page cache, measured) took the cores from
    the next request's prefill, whose llama.cpp threads wait for each other at every step: turns 3-5 of
    an agent's first session prefilled ~40-90 new tokens in 0.8-1.3 s where the same engine took 0.8 s
    for 82 tokens on turn 2 (bench/results/serve_turn_calls.json). The writer's pacer waits while a
    request computes, so the copy runs between requests. A thread-local hook, not an argument, so every
    store's write path is paced without each store taking a parameter."""
    prev = getattr(_pacing, "fn", None)
    _pacing.fn = pace
    try:
        yield
    finally:
        _pacing.fn = prev


def _write_state(f: BinaryIO, state: memoryview | bytes) -> None:
    pace = getattr(_pacing, "fn", None)
    if pace is None:
        f.write(state)
        return
    view = memoryview(state).cast("B")
    for off in range(0, len(view), WRITE_CHUNK):
        pace()
        f.write(view[off:off + WRITE_CHUNK])


def write_block(f: BinaryIO, block: Block, state: memoryview | bytes) -> int:
    """Write a whole block file to ``f``; return the byte count. ``block.state_digest`` must match."""
    prefix = encode_prefix(block)
    f.write(prefix)
    _write_state(f, state)
    f.write(trailer_digest(prefix))
    return len(prefix) + len(state) + TRAILER_LEN


def parse_header(raw: bytes, *, where: str, file_size: int) -> tuple[int, int, int]:
    """Validate the 64-byte header; return ``(manifest_len, state_off, state_len)``."""
    if len(raw) < HEADER.size:
        raise BlockCorrupted(f"{where}: truncated header ({len(raw)} of {HEADER.size} bytes)", path=where)
    magic, version, hlen, mlen, soff, slen, _ = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BlockCorrupted(f"{where}: not a graftmem block (magic {magic!r})", path=where)
    if version != FORMAT_VERSION or hlen != HEADER.size:
        raise BlockCorrupted(f"{where}: block format version {version} is not supported "
                             f"(this graftmem reads version {FORMAT_VERSION})", path=where)
    expected_size = soff + slen + TRAILER_LEN
    if soff != layout(mlen) or file_size != expected_size:
        raise BlockCorrupted(f"{where}: truncated or padded file: {file_size} bytes, header says "
                             f"{expected_size}", path=where, expected=str(expected_size),
                             actual=str(file_size))
    return mlen, soff, slen


def parse_manifest(prefix: bytes, trailer: bytes, *, where: str) -> Block:
    """Check the trailer digest over the prefix, then parse the manifest."""
    actual = trailer_digest(prefix)
    if actual != trailer:
        raise BlockCorrupted(f"{where}: header/manifest digest mismatch: expected {trailer.hex()}, "
                             f"actual {actual.hex()}", path=where, expected=trailer.hex(),
                             actual=actual.hex())
    mlen = HEADER.unpack_from(prefix)[3]
    try:
        block = Block.model_validate_json(prefix[HEADER.size:HEADER.size + mlen])
    except ValueError as exc:
        raise BlockCorrupted(f"{where}: manifest does not parse: {exc}", path=where) from exc
    if any(prefix[HEADER.size + mlen:]):
        raise BlockCorrupted(f"{where}: non-zero padding", path=where)
    return block
