"""Fleet-wide learning rules on a real SeaweedFS (tests/seaweed.py): a prompt prefix's sightings are
counted in the bucket, so a prefix seen once on each of two workers is learned, and by one of them;
a learn lease keeps a second worker from writing the same prefix at the same time, and a dead
owner's lease is taken over once stale."""

from __future__ import annotations

from graftmem import FleetStore
from graftmem.server.prefix import PrefixCache, prefix_keys
from tests.seaweed import bucket_url, seaweed  # noqa: F401 (fixtures)


def _cache(tiny_llama, url, tmp_path, name) -> PrefixCache:
    store = FleetStore(url, cache_dir=tmp_path / f"cache-{name}", poll_interval=0)
    return PrefixCache(store, tiny_llama.fingerprint, min_tokens=8, sightings=2)


def _segments(tiny_llama, user: str) -> list[list[int]]:
    """A chat-like prompt: a system segment (long enough to learn), a user turn, a generation header."""
    system = tiny_llama.tokenize("You are the fleet's helper. Answer in one short sentence, politely.")
    return [system, tiny_llama.tokenize(user, add_special=False), tiny_llama.tokenize(" A:", add_special=False)]


def test_a_prefix_seen_once_on_each_of_two_workers_is_learned_by_one(tiny_llama, bucket_url, tmp_path):
    a, b = _cache(tiny_llama, bucket_url, tmp_path, "a"), _cache(tiny_llama, bucket_url, tmp_path, "b")
    try:
        # the system prompt's first sighting is on a, its second on b (a round-robin proxy's order)
        assert a.learn_target(_segments(tiny_llama, " Q: hello?")) == 0
        assert b.learn_target(_segments(tiny_llama, " Q: and you?")) == 1  # due fleet-wide: b learns it
        # a third worker, or a again, before b's blocks are listed: counted, but b holds the lease
        assert a.learn_target(_segments(tiny_llama, " Q: third?")) == 0
        key = prefix_keys(_segments(tiny_llama, " Q: x"))[0]
        assert a.store.sightings.seen(key) == 2  # counted to the rule's limit, no further
        assert a.store.sightings.holder(key) == b.store.sightings.owner
    finally:
        a.store.close()
        b.store.close()


def test_a_learn_lease_is_held_by_one_worker_and_a_stale_one_is_taken_over(bucket_url, tmp_path):
    a_store = FleetStore(bucket_url, cache_dir=tmp_path / "a", poll_interval=0)
    b_store = FleetStore(bucket_url, cache_dir=tmp_path / "b", poll_interval=0)
    try:
        a, b = a_store.sightings, b_store.sightings
        key = b"\x01" * 32
        assert a.acquire(key) and not b.acquire(key)  # one writer at a time
        assert not a.acquire(key)  # a lease is not re-entrant: a second learn of the same prefix waits too
        b.lease_ttl = -1.0  # a's lease is older than b's patience: a died before its blocks were listed
        assert b.acquire(key) and a.holder(key) == b.owner
        # sightings and leases are garbage once old: collect_garbage removes them
        assert a.sight(key, 2) == 1 and b.sight(key, 2) == 2 and a.sight(key, 2) == 3
        assert a_store.collect_garbage(grace=0)["sightings_removed"] == 3  # 2 sightings + 1 lease
        assert a.seen(key) == 0 and a.holder(key) is None
    finally:
        a_store.close()
        b_store.close()
