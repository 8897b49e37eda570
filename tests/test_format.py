"""The block file format, byte level: layout, alignment, digests, refusal of malformed files."""

from __future__ import annotations

import io

import pytest

from graftmem import BlockCorrupted
from graftmem.core.format import (ALIGN, HEADER, TRAILER_LEN, parse_header, parse_manifest,
                              state_digest, write_block)


def test_layout_and_roundtrip(mem):
    block = mem.learn("Format check: a short manual.")
    raw = mem.store.path_of(block.id).read_bytes()
    mlen, soff, slen = parse_header(raw[:HEADER.size], where="x", file_size=len(raw))
    assert raw[:8] == b"GRAFTMEM" and soff % ALIGN == 0 and slen == block.state_size
    assert len(raw) == soff + slen + TRAILER_LEN
    assert len(raw) <= 1.05 * slen + ALIGN  # the container adds at most a page and a digest
    parsed = parse_manifest(raw[:soff], raw[-TRAILER_LEN:], where="x")
    assert parsed == block
    assert state_digest(memoryview(raw)[soff:soff + slen]) == block.state_digest
    buf = io.BytesIO()
    write_block(buf, block, raw[soff:soff + slen])
    assert buf.getvalue() == raw  # encoding is deterministic


def test_not_a_block_and_wrong_version_are_refused(mem):
    block = mem.learn("Version check.")
    raw = bytearray(mem.store.path_of(block.id).read_bytes())
    with pytest.raises(BlockCorrupted, match="not a graftmem block"):
        parse_header(b"PK\x03\x04" + bytes(60), where="zip", file_size=len(raw))
    raw[8] = 99  # version field
    with pytest.raises(BlockCorrupted, match="version 99"):
        parse_header(bytes(raw[:HEADER.size]), where="v", file_size=len(raw))
