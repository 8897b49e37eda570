"""Long documents on a fleet: a worker that learns a document publishes its page index rows in the bucket
(one file per document), and every other worker merges them on its own, so it routes to the pages
without embedding the document again and without anyone copying an index by hand. Real SeaweedFS."""

from __future__ import annotations

import logging

import obstore

from graftmem import FleetStore, Memory
from tests.conftest import long_text
from tests.seaweed import bucket_url, seaweed  # noqa: F401 (fixtures)
from tests.test_needle import FACTS, _document

FARM_FACT = "The orchard behind the Kellow farm grows exactly nineteen quince trees."


def _worker(eng, url, tmp_path, name, embedder) -> Memory:
    """A worker with a cache of its own (a separate machine) and the session's MiniLM (the same model and id
    as a worker's own, loaded once)."""
    return Memory(engine=eng, store=FleetStore(url, cache_dir=tmp_path / f"cache-{name}", poll_interval=0),
                  embedder=embedder)


def _farm() -> str:
    filler = long_text(200, seed=77)
    cut = filler.index(". ", len(filler) // 2) + 2
    return filler[:cut] + FARM_FACT + " " + filler[cut:]


def test_documents_learned_on_two_workers_are_asked_on_a_third(tiny_llama, minilm, bucket_url, tmp_path, caplog):
    with _worker(tiny_llama, bucket_url, tmp_path, "a", minilm) as a, \
            _worker(tiny_llama, bucket_url, tmp_path, "c", minilm) as c:
        town = a.learn_document(_document(200), document="town", window=256, overlap=32, progress=False)
        farm = c.learn_document(_farm(), document="farm", window=256, overlap=32, progress=False)
    assert town.pages >= 2 and farm.pages >= 2
    # a stray object where the indexes live: logged and skipped, never a failed question
    x = FleetStore(bucket_url, cache_dir=tmp_path / "cache-x", poll_interval=0)
    try:
        obstore.put(x.bucket.store, "files/pages/docs/junk.sqlite", b"not a database")
    finally:
        x.close()
    with _worker(tiny_llama, bucket_url, tmp_path, "b", minilm) as b, \
            caplog.at_level(logging.WARNING, logger="graftmem"):
        ans = b.recall_document("How many sacks of barley does the copper mill at Dunmere grind each week?",
                                document="town", max_tokens=2, min_score=0.0)
        assert FACTS[1] in b.get(ans.page.block_id).text
        ans = b.recall_document("How many quince trees grow in the orchard behind the Kellow farm?",
                                document="farm", max_tokens=2, min_score=0.0)
        assert FARM_FACT in b.get(ans.page.block_id).text
        assert {d["id"] for d in b.pages.documents()} == {"town", "farm"}
        assert any("junk.sqlite" in r.getMessage() and "not merged" in r.getMessage() for r in caplog.records)
        # merging again adds nothing (every file is merged once, and merging is idempotent anyway)
        assert b._sync_pages(force=True) == 0
