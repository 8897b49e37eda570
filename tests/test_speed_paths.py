"""The fast restore paths keep the contract: byte-exact grafts, and a flipped byte always refused.

One test per fast path (docs/benchmarks.md, graft speed):

* ``Engine.restore`` clears the cache without zeroing it: a graft over cells that still hold another
  block's bytes must equal a fresh prefill in a zeroed cache, byte for byte;
* a file version verified once (BLAKE3) is checked with xxh3-128 on later reads: a flip made through
  the file system (new ctime) goes back to BLAKE3, and a flip the file's stat cannot see is caught by
  xxh3-128;
* Gemma's root blocks past the window are read into scratch and placed straight into the engine buffer
  once the model is known to need placing: exact, and a flipped byte is refused on that path too;
* the receipt's per-phase breakdown is filled.
"""

from __future__ import annotations

import shutil

import pytest

from graftmem import BlockCorrupted, Engine, Memory, Store
from graftmem.core.engine import logits_sha256
from graftmem.memory.answer import graft
from graftmem.store import chain as _chain
from graftmem.store import verified

from .conftest import flip_bit as _flip
from .conftest import long_text
from .tiny import tall_path


def _fresh(eng, tokens: list[int], query: list[int]) -> str:
    eng.reset()  # zeroes the whole cache: the reference never sees stale bytes
    eng.prefill(tokens)
    eng.prefill(query)
    out = logits_sha256(eng.logits())
    eng.reset()
    return out


@pytest.fixture(scope="module")
def stale_pair(smol, tmp_path_factory):
    """A long and a short block, learned once for both queries of the stale-cells test (it only grafts them).
    The long one needs only to cover every cell the short block's graft and query attend: llama.cpp pads
    the cells it attends to a multiple of 256 (``llama_kv_cache::get_n_kv``), 512 here at most."""
    with Memory(engine=smol, home=tmp_path_factory.mktemp("stale") / "store") as m:
        yield m, m.learn(long_text(420, seed=71), name="long"), m.learn(long_text(150, seed=72), name="short")


@pytest.mark.parametrize("query", ["\n", "\nQuestion: " + " ".join(["which step comes first"] * 14) + "?"])
def test_graft_over_stale_cells_equals_fresh(stale_pair, smol, query):
    """restore() clears with data=False: a longer block grafted first leaves its K/V bytes in the cells
    after the short block; the short block's graft + query must still equal a fresh prefill."""
    mem, long_b, short_b = stale_pair
    assert long_b.n_tokens > short_b.n_tokens + 200
    q = smol.tokenize(query, add_special=False)
    assert long_b.n_tokens >= -(-(short_b.n_tokens + len(q)) // 256) * 256  # stale bytes in every attended cell
    with smol.session():
        graft(smol, mem.store, long_b)
        graft(smol, mem.store, short_b)  # cells past short_b + q still hold long_b's bytes
        smol.prefill(q)
        grafted = logits_sha256(smol.logits())
    assert grafted == _fresh(smol, short_b.tokens, q)



def test_flip_after_a_verified_read_goes_back_to_blake3(tiny_mem):
    mem = tiny_mem
    block = mem.learn(long_text(120, seed=5), name="hot")
    path = mem.store.path_of(block.id)
    mem.ask(block.id, "\nQ:", max_tokens=1)
    mem.ask(block.id, "\nQ:", max_tokens=1)  # the second read took the xxh3-128 path
    with open(path, "rb") as f:
        assert verified.recall(verified.file_version(f.fileno(), block.state_digest)) is not None
    _flip(path, path.stat().st_size - 32 - 777)  # inside the state: changes ctime
    with pytest.raises(BlockCorrupted, match="state digest mismatch") as ei:
        mem.ask(block.id, "\nQ:", max_tokens=1)
    assert ei.value.expected == block.state_digest


@pytest.fixture(scope="module")
def tall():
    """The tall tiny Llama 3.1 (tests/tiny.py: 32 KiB of KV cache a token): states of several MiB, across
    ``verified.OVERLAP_CHUNK``, in a prefill several times cheaper than SmolLM2's for the same size."""
    with Engine(tall_path(), {"n_threads": 1}) as e:
        yield e


@pytest.fixture(scope="module")
def bitrot_home(tall, tmp_path_factory):
    """A closed home holding the blocks the xxh3 test flips, learned once (the 300-word one, ~11 MB of
    state, serves two cases; the 60-word one is ~2 MB): block id by word count. Each case flips a byte
    in a copy of its own."""
    home = tmp_path_factory.mktemp("bitrot") / "store"
    with Memory(engine=tall, home=home) as m:
        ids = {n: m.learn(long_text(n, seed=6), name="bitrot").id for n in (60, 300)}
    return home, ids


@pytest.fixture
def bitrot_mem(bitrot_home, tall, tmp_path):
    home = tmp_path / "store"
    shutil.copytree(bitrot_home[0], home)
    with Memory(engine=tall, home=home) as m:
        yield m


@pytest.mark.parametrize("n_words,back", [(60, 4097), (300, 4097), (300, 6 << 20)],
                         ids=["one-thread", "overlapped-last-chunk", "overlapped-middle-chunk"])
def test_flip_invisible_to_stat_is_refused_by_xxh3(bitrot_home, bitrot_mem, n_words, back):
    """A change the file's stat does not show (a bit flipped on the medium or in the page cache):
    simulated by moving the verified entry to the flipped file's new version key. A state over
    ``verified.OVERLAP_CHUNK`` is read by a worker thread while this one hashes: the flip is refused
    in the chunks that worker read too."""
    mem = bitrot_mem
    block = mem.get(bitrot_home[1][n_words])
    overlapped = block.state_size > verified.OVERLAP_CHUNK
    assert overlapped == (n_words > 60)
    assert back < block.state_size
    if back > verified.OVERLAP_CHUNK:  # the flip lands in a chunk that is neither the first nor the last
        assert verified.OVERLAP_CHUNK < block.state_size - back < block.state_size // verified.OVERLAP_CHUNK * verified.OVERLAP_CHUNK
    path = mem.store.path_of(block.id)
    mem.ask(block.id, "\nQ:", max_tokens=1)
    with open(path, "rb") as f:
        old_key = verified.file_version(f.fileno(), block.state_digest)
    known = verified.recall(old_key)
    assert known is not None
    _flip(path, path.stat().st_size - 32 - back)
    with open(path, "rb") as f:
        new_key = verified.file_version(f.fileno(), block.state_digest)
    assert new_key != old_key
    verified.forget(old_key)
    verified.remember(new_key, known)  # as if the stat had not changed
    with pytest.raises(BlockCorrupted, match="changed since it was verified"):
        mem.ask(block.id, "\nQ:", max_tokens=1)
    assert verified.recall(new_key) is None  # forgotten: the next read checks BLAKE3 again
    with pytest.raises(BlockCorrupted, match="state digest mismatch"):
        mem.ask(block.id, "\nQ:", max_tokens=1)


def test_gemma_root_placed_from_scratch_is_exact_and_refuses_a_flip(gmem, gemma):
    block = gmem.learn(long_text(560, seed=77), name="gemma-scratch")
    assert block.n_tokens > gemma.n_swa + 64
    q = gemma.tokenize(" the", add_special=False)
    fresh = _fresh(gemma, block.tokens, q)
    for _ in range(2):  # the first read learns that this model places cells; the second reads into scratch
        r = gmem.ask(block.id, " the", max_tokens=1)
        assert r.receipt.first_logits_sha256 == fresh
        assert r.receipt.place_ms is not None and r.receipt.place_ms > 0
    assert _chain._PLACING.get(block.fingerprint.model_sha256) is True
    path = gmem.store.path_of(block.id)
    _flip(path, path.stat().st_size - 32 - 3000)
    with pytest.raises(BlockCorrupted):
        gmem.ask(block.id, " the", max_tokens=1)


def test_receipt_breaks_the_restore_down(tiny_mem):
    mem = tiny_mem
    block = mem.learn(long_text(200, seed=8), name="phases")
    rc = mem.ask(block.id, "\nQ:", max_tokens=2).receipt
    parts = [rc.read_ms, rc.check_ms, rc.set_data_ms]
    assert all(p is not None and p > 0 for p in parts)
    assert rc.place_ms is not None  # measured (a dense model has nothing to place: ~0)
    assert sum(parts) + rc.place_ms <= rc.restore_ms
    assert rc.route_ms is None  # asked directly, not routed


def test_overlapped_read_hashes_exactly_the_bytes_and_sees_truncation(tmp_path):
    """`verified.read_hashed` over several chunks (each read and hashed by a worker; a later read queues
    every chunk at once, a first read keeps one per core in flight): the digest is `verified.chunked_digest` of the xxh3-128 of each chunk of the range read
    from the file's current position, a BLAKE3 hasher passed along gets every byte in order (a first
    read's check, with no second pass: equal to `state_digest` of the whole), the file position ends
    after the range, one flipped byte in any chunk changes the digest, and a short file returns a short
    count. Fails on the one-hasher reader (no ``strong`` argument, no chunk digests)."""
    import os
    import xxhash

    from graftmem.core.format import state_digest, state_hasher

    data = bytearray(os.urandom(3 * verified.OVERLAP_CHUNK + 12345))
    p = tmp_path / "f.bin"
    p.write_bytes(b"HEAD" + bytes(data) + b"TAIL")
    view = memoryview(bytearray(len(data)))
    strong = state_hasher(len(data))
    with open(p, "rb", buffering=0) as f:
        f.seek(4)
        got, digest = verified.read_hashed(f, view, strong)
        assert f.tell() == 4 + len(data)
    assert got == len(data) and bytes(view) == bytes(data)
    chunks = [bytes(data[o:o + verified.OVERLAP_CHUNK]) for o in range(0, len(data), verified.OVERLAP_CHUNK)]
    assert digest == xxhash.xxh3_128(b"".join(xxhash.xxh3_128(c).digest() for c in chunks)).digest()
    assert "blake3:" + strong.hexdigest() == state_digest(bytes(data))
    small = memoryview(bytearray(1000))  # one chunk, read on this thread: the same definition
    with open(p, "rb", buffering=0) as f:
        f.seek(4)
        assert verified.read_hashed(f, small)[1] == verified.chunked_digest([xxhash.xxh3_128(bytes(data[:1000])).digest()])
    for at in (0, verified.OVERLAP_CHUNK + 7, 3 * verified.OVERLAP_CHUNK + 100):
        _flip(p, 4 + at)
        with open(p, "rb", buffering=0) as f:
            f.seek(4)
            assert verified.read_hashed(f, view)[1] != digest
        _flip(p, 4 + at)  # back
    with open(p, "r+b") as f:
        f.truncate(4 + 2 * verified.OVERLAP_CHUNK + 5)
    with open(p, "rb", buffering=0) as f:
        f.seek(4)
        got, _ = verified.read_hashed(f, view)
    assert got == 2 * verified.OVERLAP_CHUNK + 5  # what is left of the data after the 4-byte head


def test_concurrent_reads_share_the_reader_threads_and_each_gets_its_own_bytes(tmp_path):
    """The server's engines restore at once: their reads queue every chunk on the same reader threads
    (more reads than threads here, a first read with BLAKE3 among them). Each gets exactly its file's
    bytes and digest, and none waits on another forever (bounded by a timeout)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from graftmem.core.format import state_digest, state_hasher

    files = []
    for i in range(3):
        data = os.urandom(2 * verified.OVERLAP_CHUNK + 999 * (i + 1))
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(data)
        want = verified.chunked_digest([xxhash.xxh3_128(data[o:o + verified.OVERLAP_CHUNK]).digest()
                                        for o in range(0, len(data), verified.OVERLAP_CHUNK)])
        files.append((p, data, want))

    def read(i: int, first: bool) -> tuple[bool, bool, bool]:
        p, data, want = files[i % len(files)]
        view = memoryview(bytearray(len(data)))
        strong = state_hasher(len(data)) if first else None
        with open(p, "rb", buffering=0) as f:
            got, digest = verified.read_hashed(f, view, strong)
        blake_ok = strong is None or "blake3:" + strong.hexdigest() == state_digest(data)
        return got == len(data) and bytes(view) == data, digest == want, blake_ok

    jobs = [(i, i == 4) for i in range(2 * verified.READ_WORKERS + 1)]  # more reads than reader threads
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = [f.result(timeout=120) for f in [ex.submit(read, i, first) for i, first in jobs]]
    assert results == [(True, True, True)] * len(jobs)


def test_a_state_digest_of_an_unknown_algorithm_is_refused_by_name(bitrot_home, tmp_path):
    """The state digest is versioned by its algorithm prefix (`graftmem.core.format.STATE_DIGESTS`): a
    block naming one this graftmem cannot check (a newer writer's) is refused with the algorithm's name,
    not reported as a corrupted state; the blocks written so far (``blake3:``) read on. Fails where the
    reader compares any digest with BLAKE3 ("state digest mismatch")."""
    from graftmem.core.format import write_block
    from graftmem.store.local import read_block_file

    home, ids = bitrot_home
    store = Store(home)
    try:
        block = store.get(ids[60])
        state = bytes(store.read_state(block.id, lambda n: memoryview(bytearray(n)))[1])
    finally:
        store.close()
    other = block.model_copy(update={"state_digest": "blake9:" + "0" * 64})
    path = tmp_path / f"{block.id}.gmb"
    with open(path, "wb") as f:
        write_block(f, other, state)
    with pytest.raises(BlockCorrupted, match="state digest algorithm 'blake9' is not one this graftmem checks"):
        read_block_file(path, lambda n: memoryview(bytearray(n)), expect_id=block.id)
    with open(path, "wb") as f:
        write_block(f, block, state)
    assert bytes(read_block_file(path, lambda n: memoryview(bytearray(n)), expect_id=block.id)[1]) == state
