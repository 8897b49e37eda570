"""What a worker tells a gateway (graftmem/server/fleet.py), without a model: the KV-utilisation gauge,
the KV events a request's kept cells and the prefix cache's writes produce, and the stream's refusal
on a server with tenants."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.testclient import TestClient

from graftmem.server.fleet import KvEvents, kv_usage
from graftmem.server.tenants import TENANT_STATE


def _engine(n_past: int, keys=(), ends=()):
    return SimpleNamespace(n_ctx=1000, n_past=n_past, kept=SimpleNamespace(keys=keys, ends=ends) if keys else None)


def test_the_gauge_counts_the_cells_of_busy_engines_only():
    busy, idle = _engine(250), _engine(900)  # the idle engine's kept cells are a cache: free
    pool = SimpleNamespace(engines=[busy, idle], busy=[busy])
    assert kv_usage(pool) == 0.125
    assert kv_usage(SimpleNamespace(engines=[busy], busy=[busy])) == 0.25


def test_kept_cells_and_stored_blocks_become_events_in_vllms_names():
    e = _engine(0)
    hub = KvEvents(SimpleNamespace(engines=[e], busy=[]))
    got: list[dict] = []

    async def run() -> None:
        gen = hub._batches()
        first = await gen.__anext__()  # the snapshot: nothing held yet
        assert b'"events": []' in first
        e.kept = SimpleNamespace(keys=(b"\x01" * 32, b"\x02" * 32), ends=(10, 20))
        hub.ram_changed()
        e.kept = SimpleNamespace(keys=(b"\x03" * 32,), ends=(7,))  # another prompt replaced the cells
        hub.ram_changed()
        hub.stored([b"\x01" * 32], ["a" * 64], None, 10)
        for _ in range(3):
            got.append(json.loads((await gen.__anext__())[6:]))
        await gen.aclose()

    asyncio.run(run())
    events = [ev for batch in got for ev in batch["events"]]
    assert [(ev["type"], ev["medium"]) for ev in events] == [
        ("BlockStored", "ram"), ("BlockRemoved", "ram"), ("BlockStored", "ram"), ("BlockStored", "store")]
    assert events[0]["block_hashes"] == ["01" * 32, "02" * 32] and events[0]["token_count"] == 20
    assert events[1]["block_hashes"] == ["01" * 32, "02" * 32] and events[3]["block_ids"] == ["a" * 64]
    assert not hub._subs  # the closed stream unsubscribed


def test_the_stream_is_refused_to_a_tenant():
    hub = KvEvents()

    async def as_tenant(scope, receive, send):
        scope.setdefault("state", {})[TENANT_STATE] = "alice"
        await app(scope, receive, send)

    app = Starlette(routes=hub.endpoints())
    r = TestClient(as_tenant).get("/v1/kv_events")
    assert r.status_code == 403 and "tenants" in r.text
