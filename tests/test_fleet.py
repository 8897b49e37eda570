"""The fleet store on a real SeaweedFS (tests/seaweed.py starts `weed server -s3` once per session):
workers learn into and graft from one bucket, each with its own cache; every byte that comes from the
bucket is checked before it can be grafted; faults are clear typed errors with the cache intact."""

from __future__ import annotations

import json
import threading
import time

import obstore
import pytest

from graftmem import AccessDenied, BlockCorrupted, BlockNotFound, ConfigError, FleetStore, Memory, TransferError
from graftmem.core.engine import Engine, logits_sha256
from graftmem.store import RetryPolicy, Store
from tests.conftest import flip_bit, long_text
from tests.seaweed import BUCKET, Seaweed, bucket_url, seaweed  # noqa: F401 (fixtures)
from tests.tiny import tall_path

QUERY = " Next:"
FAST = RetryPolicy(retries=1, retry_timeout=3.0, init_backoff=0.05, max_backoff=0.2, connect_timeout=1.0,
                   timeout=10.0)


@pytest.fixture(scope="module")
def tall():
    """The tall tiny model (tests/tiny.py) for the large blocks: a 280-word block of it is above 8 MiB,
    where a block comes down in 4 concurrent ranges (`Bucket.get_parts`, not a setting), and goes up in
    2 parts where a test lowers the multipart threshold to 6 MiB (SeaweedFS, like S3, refuses parts under
    5 MiB: the 2-layer model's blocks cannot go up in parts)."""
    with Engine(tall_path(), {"n_threads": 1}) as e:
        yield e


def _key(url: str, rel: str) -> str:
    return url.split(f"s3://{BUCKET}/", 1)[1] + "/" + rel


def _block_key(url: str, bid: str) -> str:
    return _key(url, f"blocks/{bid[:2]}/{bid}.gmb")


def _worker(eng, url, tmp_path, name, embedder=None, **kw) -> Memory:
    """A Memory over the shared engine and the bucket, with a cache of its own (a separate machine); a test
    that routes gives the session's MiniLM (the same model and id as a worker's own, loaded once)."""
    return Memory(engine=eng, store=FleetStore(url, cache_dir=tmp_path / f"cache-{name}", poll_interval=0, **kw),
                  embedder=embedder)


class _Counting:
    """An embedder that counts the texts it embeds (the same model and id as the one it wraps)."""

    def __init__(self, inner) -> None:
        self.inner, self.texts = inner, 0
        self.model_id = getattr(inner, "model_id", None)

    def embed_batch(self, texts):
        self.texts += len(texts)
        return self.inner.embed_batch(texts)


def _fresh_sha(eng, text: str) -> str:
    with eng.session():
        eng.prefill(eng.tokenize(text))
        eng.prefill(eng.tokenize(QUERY, add_special=False))
        return logits_sha256(eng.logits())


def test_learned_on_one_worker_grafts_exactly_on_another_with_an_empty_cache(tiny_llama, minilm, bucket_url, tmp_path,
                                                                              seaweed):
    text = long_text(150, seed=1)
    with _worker(tiny_llama, bucket_url, tmp_path, "a", minilm) as a:
        block = a.learn(text, name="refunds", when_to_use="refund questions")
    with _worker(tiny_llama, bucket_url, tmp_path, "b", minilm) as b:
        assert b.store.cache_stats()["blocks"] == 0
        assert [x.id for x in b.get_all()] == [block.id]
        r = b.ask(block.id, QUERY, max_tokens=1)
        st = b.store.cache_stats()
        assert st["blocks"] == 1 and st["get_bytes"] >= block.state_size  # fetched once, now cached
        again = b.ask(block.id, QUERY, max_tokens=1)
        assert b.store.cache_stats()["cache_hits"] >= 1
        # the routing data came with the marker: the new worker routes to it without being told
        hit = b.search("a question about refunds", top_k=1)
        assert hit and hit[0].block_id == block.id
        shared = b.embedder
    # the rows b embedded are in the bucket: a third worker embeds only its task, not the blocks
    counting = _Counting(shared)
    with Memory(engine=tiny_llama, store=FleetStore(bucket_url, cache_dir=tmp_path / "cache-c", poll_interval=0),
                embedder=counting) as c:
        hit = c.search("a question about refunds", top_k=1)
        assert hit and hit[0].block_id == block.id
    assert counting.texts == 1
    assert r.receipt.first_logits_sha256 == again.receipt.first_logits_sha256 == _fresh_sha(tiny_llama, text)
    keys = {o["path"] for o in obstore.list(seaweed.client(), prefix=_key(bucket_url, "")).collect()}
    routing = {k for k in keys if "/routing/" in k}
    assert keys - routing == {_block_key(bucket_url, block.id), _key(bucket_url, f"index/{block.id}.json")}
    assert len(routing) == 1 and block.id in routing.pop()  # the block's routing rows, shared once


def test_a_re_put_of_identical_content_is_a_no_op_and_other_content_under_a_key_is_refused(
        tiny_llama, bucket_url, tmp_path, seaweed):
    text = long_text(80, seed=2)
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        block = a.learn(text, name="one")
        state = a.store.cache.read_state(block.id, lambda n: memoryview(bytearray(n)))[1]
    client = seaweed.client()
    before = obstore.head(client, _block_key(bucket_url, block.id))
    # a second worker, empty cache, puts the same block: nothing is written
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-c", poll_interval=0)
    try:
        store.put(block, bytes(state))
        assert store.counters["put_bytes"] == 0
        # a worker killed between its block and its marker: the next put finds the object, checks it is
        # the same block (header + manifest + trailer), and writes the marker only
        obstore.delete(client, _key(bucket_url, f"index/{block.id}.json"))
        store.refresh(force=True)
        assert not store.contains(block.id)
        store.put(block, bytes(state))
        assert store.contains(block.id) and store.counters["put_bytes"] == 0
        after = obstore.head(client, _block_key(bucket_url, block.id))
        assert (after["e_tag"], after["last_modified"]) == (before["e_tag"], before["last_modified"])
        # another block's bytes under this key: refused as corrupted, no marker written
        with _worker(tiny_llama, bucket_url, tmp_path, "d") as d:
            other = d.learn(long_text(60, seed=3), name="other")
        obstore.delete(client, _key(bucket_url, f"index/{block.id}.json"))
        obstore.copy(client, _block_key(bucket_url, other.id), _block_key(bucket_url, block.id))
        store.refresh(force=True)
        store2 = FleetStore(bucket_url, cache_dir=tmp_path / "cache-e", poll_interval=0)
        try:
            with pytest.raises(BlockCorrupted, match="other content"):
                store2.put(block, bytes(state))
            assert not store2.contains(block.id)
        finally:
            store2.close()
    finally:
        store.close()


def test_a_corrupted_or_swapped_object_is_refused_and_never_cached(tiny_llama, bucket_url, tmp_path, seaweed):
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        one = a.learn(long_text(100, seed=4), name="one")
        two = a.learn(long_text(100, seed=5), name="two")
        src = a.store.cache.path_of(one.id)
        damaged = tmp_path / "damaged.gmb"
        damaged.write_bytes(src.read_bytes())
    flip_bit(damaged, damaged.stat().st_size - 32 - 1000)  # a byte of the state
    client = seaweed.client()
    # two's key now holds one's (intact) file: a swap; one's key a file with one flipped state bit
    obstore.copy(client, _block_key(bucket_url, one.id), _block_key(bucket_url, two.id))
    obstore.put(client, _block_key(bucket_url, one.id), damaged.read_bytes())
    with _worker(tiny_llama, bucket_url, tmp_path, "b") as b:
        with pytest.raises(BlockCorrupted, match="digest"):
            b.ask(one.id, QUERY, max_tokens=1)
        with pytest.raises(BlockCorrupted, match="id/size|manifest|bytes than its marker"):
            b.ask(two.id, QUERY, max_tokens=1)
        assert b.store.cache_stats()["blocks"] == 0  # nothing entered the cache
        assert not list((tmp_path / "cache-b" / ".staging").glob("*.gmb"))


def test_a_deleted_block_is_tombstoned_for_every_worker_and_can_be_learned_again(tiny_llama, bucket_url, tmp_path,
                                                                                  seaweed):
    text = long_text(90, seed=6)
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a, _worker(tiny_llama, bucket_url, tmp_path, "b") as b:
        block = a.learn(text, name="gone")
        b.ask(block.id, QUERY, max_tokens=1)  # b has it cached
        b.store.flush()  # the cache file is written behind the graft
        assert b.store.cache.contains(block.id)
        assert a.delete(block.id) == [block.id]
        client = seaweed.client()
        assert obstore.head(client, _key(bucket_url, f"tombstones/{block.id}"))
        # the object stays for readers that listed before the delete, until garbage collection
        assert obstore.head(client, _block_key(bucket_url, block.id))
        assert b.get_all() == []
        assert not b.store.cache.contains(block.id)  # and b's cached copy is gone with it
        with pytest.raises(BlockNotFound):
            b.ask(block.id, QUERY, max_tokens=1)
        assert a.store.collect_garbage(grace=3600)["blocks_removed"] == 0
        again = b.learn(text, name="back")
        assert again.id == block.id and [x.name for x in a.get_all()] == ["back"]
        a.delete(block.id)
        assert a.store.collect_garbage(grace=0) == {"blocks_removed": 1, "tombstones_removed": 1,
                                                    "uploads_removed": 0, "sightings_removed": 0}
        assert not list(obstore.list(client, prefix=_key(bucket_url, "blocks")).collect())


def test_the_cache_is_capped_least_recently_used_first(tiny_llama, bucket_url, tmp_path):
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        blocks = [a.learn(long_text(60, seed=10 + i), name=f"b{i}") for i in range(3)]
    cap = int(max(b.state_size for b in blocks) * 2.5)
    with _worker(tiny_llama, bucket_url, tmp_path, "b", cache_bytes=cap) as b:
        shas = [b.ask(x.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for x in blocks]
        b.ask(blocks[1].id, QUERY, max_tokens=1)  # b1 is now the most recently used
        b.ask(blocks[0].id, QUERY, max_tokens=1)  # fetches b0 again, evicting b2 (least recent)
        b.store.flush()  # the cache file is written (and the cap enforced) behind the graft
        cached = {x.id for x in b.store.cache.list()}
        assert b.store.cache_stats()["bytes"] <= cap
        assert cached == {blocks[0].id, blocks[1].id}
        assert [b.ask(x.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for x in blocks] == shas


class _HeldWrite:
    """Holds the cache write of block ``bid`` (written behind its graft) until ``gate`` is set: ``waiting`` is
    set once it is held, ``written`` once it ended (and evicted what the cap asked)."""

    def __init__(self, monkeypatch, bid: str) -> None:
        from graftmem.store.fleet.cache import ReadCache

        self.gate, self.waiting, self.written = threading.Event(), threading.Event(), threading.Event()
        real = ReadCache._write_cached

        def held(cache, b, *args):
            if b == bid:
                self.waiting.set()
                assert self.gate.wait(60), "the test never released the write"
            try:
                return real(cache, b, *args)
            finally:
                if b == bid:
                    self.written.set()

        monkeypatch.setattr(ReadCache, "_write_cached", held)


def _capped_while_b2_is_written(tiny_llama, bucket_url, tmp_path, monkeypatch, seed: int, meanwhile) -> None:
    """Three blocks in a cache capped at 2.5 of them: b0 and b1 cached, b2 fetched with its write held;
    ``meanwhile(worker, blocks, held)`` reads b1 then b0 from the cache, after which b2 is the least recently
    used: once its write ended the cache must hold b0 and b1, and every graft stays exact."""
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        blocks = [a.learn(long_text(60, seed=seed + i), name=f"b{i}") for i in range(3)]
    held = _HeldWrite(monkeypatch, blocks[2].id)
    cap = int(max(b.state_size for b in blocks) * 2.5)
    with _worker(tiny_llama, bucket_url, tmp_path, "b", cache_bytes=cap) as b:
        shas = [b.ask(x.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for x in blocks[:2]]
        b.store.flush()
        shas.append(b.ask(blocks[2].id, QUERY, max_tokens=1).receipt.first_logits_sha256)  # its write waits
        assert held.waiting.wait(60)
        meanwhile(b, blocks, held)
        held.gate.set()
        b.store.flush()
        assert held.written.is_set() and b.store.cache_stats()["bytes"] <= cap
        assert {x.id for x in b.store.cache.list()} == {blocks[0].id, blocks[1].id}
        assert [b.ask(x.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for x in blocks] == shas


def test_a_write_behind_evicts_by_the_reads_that_passed_it(tiny_llama, bucket_url, tmp_path, monkeypatch):
    """A fetched block's cache file is written behind the graft; reads of cached blocks may come in before
    that write ends. Its eviction must follow the order of all those reads: the block it wrote is then the
    least recently used, not one to keep (it kept it, and evicted a block read after it: found on a fast host)."""
    def hits(b, blocks, held) -> None:
        for x in (blocks[1], blocks[0]):  # cache hits while b2's write is held
            assert b.ask(x.id, QUERY, max_tokens=1).receipt.fetch_ms is None

    _capped_while_b2_is_written(tiny_llama, bucket_url, tmp_path, monkeypatch, 40, hits)


def test_a_block_read_from_the_cache_is_not_evicted_by_a_write_that_ends_during_the_read(
        tiny_llama, bucket_url, tmp_path, monkeypatch):
    """A cache hit marks its block used before it reads it: a write behind that ends (and evicts) during
    the read sees that block as the most recent one. It used to mark it after the read, so the eviction
    took the block being read for the least recently used (found on a fast host: the cache then lacked
    the block just asked)."""
    pause, real_read, blocks_of = threading.Event(), Store.read_state, {}

    def paused_read(self, bid, *args, **kw):
        out = real_read(self, bid, *args, **kw)
        held = blocks_of.get(bid)
        if held is not None and pause.is_set() and not held.gate.is_set():
            held.gate.set()  # b2's write ends, and evicts, while this read of b0 is in progress
            assert held.written.wait(60)
        return out

    def hits(b, blocks, held) -> None:
        assert b.ask(blocks[1].id, QUERY, max_tokens=1).receipt.fetch_ms is None
        blocks_of[blocks[0].id] = held
        pause.set()
        assert b.ask(blocks[0].id, QUERY, max_tokens=1).receipt.fetch_ms is None  # a hit; b2 written meanwhile
        assert held.written.is_set()

    monkeypatch.setattr(Store, "read_state", paused_read)
    _capped_while_b2_is_written(tiny_llama, bucket_url, tmp_path, monkeypatch, 50, hits)


def test_bucket_down_is_a_clear_error_and_the_cache_stays(tiny_llama, tmp_path, monkeypatch):
    server = Seaweed(tmp_path / "sw").start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{BUCKET}/down"
        with Memory(engine=tiny_llama,
                    store=FleetStore(url, cache_dir=tmp_path / "c", poll_interval=0, retry=FAST)) as m:
            cached = m.learn(long_text(60, seed=20), name="cached")
            with _worker(tiny_llama, url, tmp_path, "other") as other:
                remote_only = other.learn(long_text(60, seed=21), name="remote")
            want = m.ask(cached.id, QUERY, max_tokens=1).receipt.first_logits_sha256
            m.store.refresh(force=True)
            server.stop()
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="object storage .* failed"):
                m.ask(remote_only.id, QUERY, max_tokens=1)
            assert time.monotonic() - t0 < 30  # bounded retries
            with pytest.raises(TransferError):
                m.learn(long_text(60, seed=22), name="new")
            # what is cached still grafts, byte-exactly
            assert m.ask(cached.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == want
            assert m.store.cache.contains(cached.id) and not m.store.cache.contains(remote_only.id)
        with pytest.raises(TransferError):
            FleetStore(url, cache_dir=tmp_path / "c2", retry=FAST)
    finally:
        server.stop()


def test_wrong_credentials_are_a_clear_error(bucket_url, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(AccessDenied, match="AWS_SECRET_ACCESS_KEY"):
        FleetStore(bucket_url, cache_dir=tmp_path / "c", retry=FAST)


def test_the_store_is_chosen_by_url_env_or_cli_flag(tiny_llama, bucket_url, tmp_path, monkeypatch, capsys):
    from graftmem.cli import main

    with pytest.raises(ConfigError, match="s3://bucket"):
        FleetStore("http://not-s3/x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GRAFTMEM_STORE", bucket_url)
    with Memory(engine=tiny_llama) as m:
        assert isinstance(m.store, FleetStore) and str(tmp_path / "xdg") in str(m.store.home)
        block = m.learn(long_text(40, seed=30), name="by-env")
    monkeypatch.delenv("GRAFTMEM_STORE")
    assert main(["ls", "--json", "--store", bucket_url]) == 0
    assert [b["id"] for b in json.loads(capsys.readouterr().out)] == [block.id]
    assert main(["ls", "--store", bucket_url, "--home", str(tmp_path / "h")]) != 0
    assert "not both" in capsys.readouterr().err


def test_a_local_store_uploads_into_a_bucket(tiny_llama, bucket_url, tmp_path, monkeypatch, capsys):
    with Memory(engine=tiny_llama, home=tmp_path / "local") as local:
        blocks = [local.learn(long_text(50, seed=40 + i), name=f"l{i}") for i in range(2)]
        want = [local.ask(b.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for b in blocks]
    from graftmem.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["upload", str(tmp_path / "local"), "--store", bucket_url, "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["uploaded"]) == sorted(b.id for b in blocks)
    src = Store(tmp_path / "local")
    fleet = FleetStore(bucket_url, cache_dir=tmp_path / "c", poll_interval=0)
    try:
        assert fleet.upload_store(src) == []  # again: nothing
    finally:
        src.close()
        fleet.close()
    with _worker(tiny_llama, bucket_url, tmp_path, "w") as w:
        assert [w.ask(b.id, QUERY, max_tokens=1).receipt.first_logits_sha256 for b in blocks] == want
        assert all(b.provenance == "local" for b in w.get_all())



def test_a_truncated_or_extended_large_object_is_refused(tall, bucket_url, tmp_path, seaweed):
    """Above 8 MiB a block comes down in concurrent ranges sized from its marker: an object shorter or
    longer than that is refused as corrupted, not grafted and not cached."""
    with _worker(tall, bucket_url, tmp_path, "a") as a:
        big = a.learn(long_text(280, seed=50), name="big")
        raw = a.store.cache.path_of(big.id).read_bytes()
    assert len(raw) > 8 << 20
    client = seaweed.client()
    for bad in (raw[:-(1 << 20)], raw + b"\0" * 4096):
        obstore.put(client, _block_key(bucket_url, big.id), bad)
        with _worker(tall, bucket_url, tmp_path, f"b{len(bad)}") as b:
            with pytest.raises(BlockCorrupted, match="bytes than its marker"):
                b.ask(big.id, QUERY, max_tokens=1)
            assert b.store.cache_stats()["blocks"] == 0
    obstore.put(client, _block_key(bucket_url, big.id), raw)
    with _worker(tall, bucket_url, tmp_path, "c") as c:
        assert c.ask(big.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == _fresh_sha(tall, big.text)


def test_a_fleet_store_is_a_block_store_and_doctor_checks_its_files(tiny_llama, bucket_url, tmp_path, seaweed):
    """Every member of `BlockStore` on an open fleet store (tests/test_store_protocol.py compares the
    signatures); ``check_file`` (what ``graftmem doctor`` asks) fetches a block it has not cached, checked."""
    from graftmem.store import BlockStore

    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        block = a.learn(long_text(40, seed=77), name="doctor")
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-doctor", poll_interval=0)
    try:
        assert isinstance(store, BlockStore) and store.remote is True
        assert all(hasattr(store, name) for name in BlockStore.__annotations__)
        store.poll_interval = 7
        assert store.poll_interval == 7.0
        assert not store.cache.contains(block.id)
        assert store.check_file(block.id[:10]).id == block.id
        assert store.cache.contains(block.id)
    finally:
        store.close()


def test_a_large_block_goes_up_in_parts_and_a_second_upload_is_skipped(tall, bucket_url, tmp_path, seaweed):
    """Above the multipart threshold (lowered here to 6 MiB, 5 MiB parts) a block is uploaded in parts:
    the object is whole when listed, and a worker that finds it there checks it instead of uploading."""
    text = long_text(280, seed=60)
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-a", poll_interval=0)
    store.bucket.multipart_above, store.bucket.part_size = 6 << 20, 5 << 20
    with Memory(engine=tall, store=store) as a:
        big = a.learn(text, name="big")
    assert store.counters["put_bytes"] > 6 << 20
    store.close()
    head = obstore.head(seaweed.client(), _block_key(bucket_url, big.id))
    assert "-" in head["e_tag"]  # a multipart ETag: "<md5 of part md5s>-<parts>"
    with _worker(tall, bucket_url, tmp_path, "b") as b:
        b.delete(big.id)  # marker gone, object kept: a learn finds the object and checks it
    c_store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-c", poll_interval=0)
    c_store.bucket.multipart_above = 6 << 20
    with Memory(engine=tall, store=c_store) as c:
        again = c.learn(text, name="big again")
        assert again.id == big.id and c_store.counters["put_bytes"] == 0
        assert [x.name for x in c.get_all()] == ["big again"]
    c_store.close()
    with _worker(tall, bucket_url, tmp_path, "d") as d:
        assert d.ask(big.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == _fresh_sha(tall, text)


def test_prefetch_brings_blocks_into_the_cache_checked(tiny_llama, bucket_url, tmp_path, seaweed):
    """The pager's hint: blocks fetched in the background are checked like any fetch; a corrupted one
    is logged and left out, and the graft that needs it later still refuses it."""
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        good = a.learn(long_text(60, seed=70), name="good")
        bad = a.learn(long_text(60, seed=71), name="bad")
        raw = bytearray(a.store.cache.path_of(bad.id).read_bytes())
    raw[-32 - 100] ^= 1  # a bit of the state
    obstore.put(seaweed.client(), _block_key(bucket_url, bad.id), bytes(raw))
    with _worker(tiny_llama, bucket_url, tmp_path, "b") as b:
        futures = b.store.prefetch([good.id, bad.id, good.id])
        assert len(futures) == 2 and [f.result(timeout=60) for f in futures] == [True, False]
        assert {x.id for x in b.store.cache.list()} == {good.id}
        assert b.store.prefetch([good.id]) == []  # cached: nothing to do
        hits = b.store.cache_stats()["cache_hits"]
        b.ask(good.id, QUERY, max_tokens=1)
        assert b.store.cache_stats()["cache_hits"] == hits + 1
        with pytest.raises(BlockCorrupted):
            b.ask(bad.id, QUERY, max_tokens=1)


def test_a_document_asked_from_a_bucket_prefetches_the_runner_up_pages(tiny_llama, minilm, bucket_url, tmp_path):
    """A long document learned on one worker is asked on another with an empty cache (its page index
    shared as a file): the page that answers is fetched for the graft, the runner-up pages follow in
    the background, and nothing else is fetched."""
    import sqlite3

    from graftmem.store import Home
    from tests.test_needle import FACTS, _document

    with _worker(tiny_llama, bucket_url, tmp_path, "a", minilm) as a:
        rep = a.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
        snap = tmp_path / "pages.sqlite"
        with sqlite3.connect(a.store.layout.pages_index) as src, sqlite3.connect(snap) as dst:
            src.backup(dst)
        a.store.put_file("pages/index.sqlite", snap)
    assert rep.pages >= 4
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-b", poll_interval=0)
    assert store.get_file("pages/index.sqlite", Home(tmp_path / "cache-b").pages_index)
    with Memory(engine=tiny_llama, store=store, embedder=minilm) as b:
        ans = b.recall_document("How many sacks of barley does the copper mill at Dunmere grind each week?",
                                document="town", max_tokens=2, min_score=0.0)
        assert FACTS[1] in b.get(ans.page.block_id).text
        store.flush()  # the prefetches of the runner-up pages have landed
        cached = {x.id for x in store.cache.list()}
        assert ans.page.block_id in cached and 2 <= len(cached) <= 3 < rep.pages
    store.close()


@pytest.mark.parametrize("message, error", [
    ("Error performing HEAD http://127.0.0.1:40331/fleet/k in 51ms - error sending request", TransferError),
    ("Error performing GET http://127.0.0.1:9000/fleet/blocks/a4/a403f.gmb - connection refused", TransferError),
    ("HTTP status client error (403 Forbidden) for url (http://127.0.0.1:9000/fleet/k)", AccessDenied),
    ("<Code>SignatureDoesNotMatch</Code>", AccessDenied),
])
def test_errors_are_told_apart_by_what_they_say_not_by_digits(message, error, monkeypatch):
    """A refused connection to a port like 40331 was read as refused credentials ("403" in the text)."""
    from graftmem.store.remote import Bucket

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    b = Bucket("s3://fleet/t")
    with pytest.raises(TransferError) as ei:  # AccessDenied is a TransferError too: compare the class
        with b._errors("reading", "k"):
            raise OSError(message)
    assert type(ei.value) is error, ei.value


def test_an_id_learned_elsewhere_is_usable_at_once_without_a_listing(tiny_llama, bucket_url, tmp_path):
    """An id handed over from another worker (a queue message) grafts at once: one HEAD and one GET of its
    marker, no listing of the bucket. It raced before: a worker that had listed < 0.25 s earlier said
    BlockNotFound."""
    with _worker(tiny_llama, bucket_url, tmp_path, "a") as a:
        block = a.learn(long_text(70, seed=41), name="handed over")
        fresh = a.ask(block.id, QUERY, max_tokens=1).receipt.first_logits_sha256
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-b", poll_interval=3600)
    with Memory(engine=tiny_llama, store=store) as b:
        store._index._last_poll = time.monotonic()  # as if b had listed the bucket just before the learn
        store._index.db.execute("DELETE FROM remote")  # ... and not seen it
        lists = store.counters["lists"]
        assert b.ask(block.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == fresh
        assert store.counters["lists"] == lists
        assert not store.contains("f" * 64)  # an id the bucket does not have: still no listing
        assert store.counters["lists"] == lists
    store.close()


def test_a_flipped_bit_in_any_downloaded_part_is_refused_and_never_cached(tall, bucket_url, tmp_path, seaweed):
    """A large block comes down in 4 concurrent ranges, each copied into the engine buffer and hashed
    as it lands: one flipped bit in the first, a middle or the last range's state bytes, in the
    manifest or in the trailer is refused before the graft (nothing cached, nothing staged), and the
    intact object still grafts exactly, from the bucket and then from the cache it entered."""
    from graftmem.core.format import HEADER, parse_header

    with _worker(tall, bucket_url, tmp_path, "a") as a:
        big = a.learn(long_text(280, seed=80), name="big")
        raw = a.store.cache.path_of(big.id).read_bytes()
    _, soff, slen = parse_header(raw[:HEADER.size], where="big", file_size=len(raw))
    step = -(-len(raw) // 4)
    assert len(raw) > 8 << 20 and soff < step  # 4 ranges, the state begins in the first
    client = seaweed.client()
    flips = {"first range": soff + 100, "middle range": 2 * step + 7, "last range": len(raw) - 32 - 100,
             "manifest": HEADER.size + 10, "trailer": len(raw) - 5}
    for where, offset in flips.items():
        bad = bytearray(raw)
        bad[offset] ^= 1
        obstore.put(client, _block_key(bucket_url, big.id), bytes(bad))
        with _worker(tall, bucket_url, tmp_path, where.replace(" ", "-")) as b:
            with pytest.raises(BlockCorrupted, match="digest|manifest|id/size") as err:
                b.ask(big.id, QUERY, max_tokens=1)
            assert "nothing was grafted" in str(err.value), where
            b.store.flush()
            assert b.store.cache_stats()["blocks"] == 0, where
            assert not list((tmp_path / f"cache-{where.replace(' ', '-')}" / ".staging").glob("*"))
    obstore.put(client, _block_key(bucket_url, big.id), raw)
    with _worker(tall, bucket_url, tmp_path, "good") as c:
        cold = c.ask(big.id, QUERY, max_tokens=1).receipt.first_logits_sha256
        assert c.store.path_of(big.id).read_bytes() == raw  # the cache file: the object's bytes
        warm = c.ask(big.id, QUERY, max_tokens=1).receipt.first_logits_sha256
        assert c.store.cache_stats()["cache_hits"] == 1
    assert cold == warm == _fresh_sha(tall, big.text)


def test_parts_landing_in_any_order_hash_as_the_whole_state_and_a_missing_one_is_refused():
    """`_Landing` copies parts into the buffer as they come and hashes in file order: any arrival
    order gives the digest of the whole state; a part that never came (or came short) is refused."""
    import itertools
    import os

    from graftmem.core.format import state_digest
    from graftmem.store.fleet.cache import Landing as _Landing

    soff, state = 4096, os.urandom(3 * 1000 + 17)
    file = bytes(soff) + state + bytes(32)
    cuts = [0, 1500, 4096 + 1000, 4096 + 2999, len(file)]
    parts = [(a, memoryview(file)[a:b]) for a, b in zip(cuts, cuts[1:])]
    for order in itertools.permutations(parts):
        landing = _Landing(memoryview(bytearray(len(state))), soff)
        for start, data in order:
            landing.land(start, data)
        view, digest = landing.digest()
        assert bytes(view) == state and digest == state_digest(state)
    landing = _Landing(memoryview(bytearray(len(state))), soff)
    for start, data in parts[:2] + parts[3:]:
        landing.land(start, data)
    with pytest.raises(BlockCorrupted, match="state bytes arrived"):
        landing.digest()


def test_a_large_upload_that_loses_a_race_writes_nothing_over_the_winner(tall, bucket_url, tmp_path, seaweed):
    """Above the multipart threshold a block goes up in parts under uploads/ and is then copied to its
    key only if nothing is there (a multipart copy completed with If-None-Match: *, which SeaweedFS
    refuses with 412 like S3). A worker that looked, saw nothing, and lost the race to another
    writer leaves the winner's object as it was: here other bytes under the key, refused by the
    check that follows; no upload is left behind, and collect_garbage removes one a killed worker left."""
    text = long_text(280, seed=62)

    def lowered(name):
        store = FleetStore(bucket_url, cache_dir=tmp_path / f"cache-{name}", poll_interval=0)
        store.bucket.multipart_above, store.bucket.part_size = 6 << 20, 5 << 20
        return store

    a_store = lowered("a")
    with Memory(engine=tall, store=a_store) as a:
        big = a.learn(text, name="big")
        other = a.learn(long_text(60, seed=63), name="other")
        other_raw = a_store.cache.path_of(other.id).read_bytes()
        a.delete(big.id)  # the marker goes, the object stays: a learn uploads again
    a_store.close()
    client = seaweed.client()
    key = _block_key(bucket_url, big.id)
    assert obstore.head(client, key)["size"] > 6 << 20
    obstore.put(client, key, other_raw)  # the race's winner, written after the loser looked
    c_store = lowered("c")
    real_head, looked = c_store.bucket.head, []

    def head(k):  # the loser's one look at the block key finds nothing (the winner lands just after)
        if k.endswith(f"{big.id}.gmb") and not looked:
            looked.append(k)
            return None
        return real_head(k)

    c_store.bucket.head = head
    with Memory(engine=tall, store=c_store) as c:
        with pytest.raises(BlockCorrupted, match="holds other content"):
            c.learn(text, name="big again")
    c_store.close()
    assert looked and bytes(obstore.get(client, key).bytes()) == other_raw  # not written over
    uploads = _key(bucket_url, "uploads/")
    assert not obstore.list(client, prefix=uploads).collect()  # the staging upload was removed
    obstore.put(client, uploads + f"{big.id}.1.2.3.gmb", b"left by a killed worker")
    g_store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-g", poll_interval=0)
    assert g_store.collect_garbage(grace=0)["uploads_removed"] == 1
    g_store.close()
    assert not obstore.list(client, prefix=uploads).collect()
