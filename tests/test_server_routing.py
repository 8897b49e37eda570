"""Routed recall and search (through the server, or a Memory on the same home) never pick an automatic
prefix block: those are pieces of conversations the prompt cache kept, not knowledge learned for tasks,
even when their text matches the task better than any manual (the router ranked one first before it
left them out of its index)."""

from __future__ import annotations

import time

import httpx
import openai

from graftmem import Memory
from graftmem.server import AUTO_KIND, api_server

TASK = "Can I get my money back for a return?"


def test_search_and_routed_recall_skip_automatic_blocks(smol, tmp_path):
    with Memory(engine=smol, home=tmp_path / "home") as m:
        manual = m.learn("Refunds: customers get their money back within 14 days with the receipt.", chat=True,
                         name="refunds", when_to_use="questions about refunds, returns and money back")
        with api_server(m.store, [smol], min_prefix_tokens=8, sightings=1, router=lambda: m.router) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            convo = [{"role": "system", "content": f"{TASK} Money back for a return? {TASK}"},
                     {"role": "user", "content": TASK}, {"role": "assistant", "content": "Let me check."},
                     {"role": "user", "content": "Thanks."}]
            c.chat.completions.create(model="smollm2", messages=convo, max_tokens=2, temperature=0)
            deadline = time.monotonic() + 60  # the answer is sent before the request stores its prefix
            while not (autos := {b.id for b in m.store.list(kind=AUTO_KIND)}) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert autos
            # the router never indexes them (it used to rank one first for this task), so a Memory opened
            # on the server's home does not offer them either
            m.router.sync(force=True)
            assert not autos & {bid for bid, _ in m.router.search(TASK, 5)}
            local = m.search(TASK, top_k=5)
            assert local and local[0].block_id == manual.id and not autos & {h.block_id for h in local}
            hits = httpx.post(srv.url + "/v1/memory/search", json={"query": TASK, "top_k": 5}, timeout=120).json()["hits"]
            assert hits and hits[0]["block_id"] == manual.id and not autos & {h["block_id"] for h in hits}
            r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": TASK}], max_tokens=2,
                                          temperature=0, extra_body={"graftmem": {"recall": True, "min_score": 0.1}})
            assert r.model_extra["graftmem"]["recall"]["block_id"] == manual.id
            rec = httpx.post(srv.url + "/v1/memory/recall", json={"task": TASK, "max_tokens": 2, "min_score": 0.1},
                             timeout=120).json()
            assert rec["block"]["id"] == manual.id
