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


def test_a_paced_write_calls_the_pacer_per_chunk_and_writes_the_same_bytes(mem):
    """The server's writer paces its block writes (`graftmem.core.format.paced`): the state goes out in
    WRITE_CHUNK pieces with the pacer called before each, and the file is the unpaced one, byte for byte."""
    from graftmem.core.format import WRITE_CHUNK, paced

    block = mem.learn("Pacing check: a short manual.")
    raw = mem.store.path_of(block.id).read_bytes()
    _mlen, soff, slen = parse_header(raw[:HEADER.size], where="x", file_size=len(raw))
    state = raw[soff:soff + slen] * (2 + WRITE_CHUNK // slen)  # several chunks (the digest is not checked)
    big = block.model_copy(update={"state_size": len(state), "state_digest": state_digest(state)})
    plain, paced_buf, calls = io.BytesIO(), io.BytesIO(), []
    write_block(plain, big, state)
    with paced(lambda: calls.append(paced_buf.tell())):
        write_block(paced_buf, big, state)
    write_block(io.BytesIO(), big, state)  # outside the context: no pacer any more
    assert paced_buf.getvalue() == plain.getvalue()
    n_chunks = -(-len(state) // WRITE_CHUNK)
    assert len(calls) == n_chunks >= 2, (len(calls), len(state))
    assert calls[1] - calls[0] == WRITE_CHUNK  # one chunk between two calls


def test_the_writer_pacer_waits_while_a_request_computes(mem):
    """`PrefixCache._quiet_until`: returns at once when no request computes or the deadline has passed,
    and otherwise when the computing request is done (the thread is bounded by a join timeout)."""
    import threading
    import time

    from graftmem.server.prefix import PrefixCache

    cache = PrefixCache(mem.store, mem.engine.fingerprint)
    cache._quiet_until(time.monotonic() + 60)  # nothing computes: no wait
    done = threading.Event()
    with cache.computing():
        cache._quiet_until(time.monotonic() - 1)  # past the deadline: no wait either
        t = threading.Thread(target=lambda: (cache._quiet_until(time.monotonic() + 60), done.set()))
        t.start()
        for _ in range(3000):  # until the pacer waits on the cache's condition (bounded: 30 s)
            with cache._lock:
                if cache._quiet._waiters:  # noqa: SLF001 - the state this test is about
                    break
            time.sleep(0.01)
        assert cache._quiet._waiters and not done.is_set()  # held while the request computes
    t.join(timeout=30)
    assert done.is_set() and not t.is_alive()


_DEADLOCKED: list = []  #: what a failing run of the test below must never close nor collect


def test_a_paced_write_holds_no_store_lock_while_it_waits(mem, tmp_path):
    """The writer's pacer waits while a request computes; if it waited inside the store's lock, the
    request's own prefix lookup (which reads the index) would wait for the writer: a deadlock until the
    writer's deadline, measured as a 600 s client timeout in bench/serve.py before the store wrote its
    files outside the lock."""
    import threading
    import time

    from graftmem.core.format import paced
    from graftmem.server.prefix import PrefixCache
    from graftmem.store.local import Store

    block = mem.learn("Lock check: a short manual.")
    raw = mem.store.path_of(block.id).read_bytes()
    _mlen, soff, slen = parse_header(raw[:HEADER.size], where="x", file_size=len(raw))
    store = Store(tmp_path / "other")
    cache = PrefixCache(store, mem.engine.fingerprint)
    wrote = threading.Event()

    def writer() -> None:
        with paced(lambda: cache._quiet_until(time.monotonic() + 60)):
            store.put(block, raw[soff:soff + slen])
        wrote.set()

    held = cache.computing()  # a request computes: the pacer holds the write
    held.__enter__()
    t = threading.Thread(target=writer, daemon=True)  # daemon: a deadlock must fail the test, not hang it
    t.start()
    for _ in range(3000):  # until the writer waits in its pacer (bounded: 30 s)
        with cache._lock:
            if cache._quiet._waiters:  # noqa: SLF001
                break
        time.sleep(0.01)
    looked = threading.Event()
    r = threading.Thread(target=lambda: (cache.refresh(), store.contains(block.id), looked.set()), daemon=True)
    r.start()
    r.join(timeout=20)
    if not looked.is_set():  # deadlocked: leave the threads, the request and the store as they are (closing
        _DEADLOCKED.append((store, cache, held))  # or collecting them needs a lock a deadlocked thread holds)
        pytest.fail("a reader of the index waited for the paced writer")
    assert not wrote.is_set()
    held.__exit__(None, None, None)
    t.join(timeout=30)
    assert wrote.is_set() and store.contains(block.id)
    store.close()
