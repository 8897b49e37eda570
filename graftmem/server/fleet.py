"""What a gateway in front of several workers can read from one (issue 42): which worker answered, a
stream of KV events (which prompt prefixes this worker holds in RAM, stored, evicted), and how full
its KV cells are (the ``graftmem_kv_cache_usage_perc`` gauge, rendered by `graftmem.server.metrics`).

Why these and not another runtime's: a gateway that knows vLLM or SGLang asks for their endpoints
(``/server_info``, ``/version``, ``owned_by: "vllm"``) and speaks their wire formats (vLLM's KV
events are msgpack over ZMQ, SGLang's and SMG's gRPC); a graftmem worker answering those would claim
to be what it is not, and the gateway would send it that runtime's private calls. A graftmem worker is
an OpenAI-compatible backend with its own identity (``owned_by: "graftmem"``); SMG registers it as
``generic`` and routes it with its own (request-text) cache-aware tree; docs/fleet.md has the recipes.

* ``X-Graftmem-Worker``: a response header naming the process that answered (host and pid), on every
  response: a client or a bench sees where a gateway sent each request without asking the gateway.
* ``GET /v1/kv_events``: Server-Sent Events, one ``data:`` line of JSON per batch, in the shape of
  vLLM's ``KVEventBatch`` (``{"ts", "events": [...]}``) with its event names: ``BlockStored``
  (``block_hashes``, ``parent_block_hash``, ``token_count``, ``medium``, ``block_ids``),
  ``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``. A "block hash" is graftmem's
  prefix key (hex; `graftmem.server.prefix.prefix_keys`: a salted SHA-256 of the token ids of the
  prompt's first k segments, cut where graftmem cuts, not vLLM's fixed 16-token pages), so a router
  matches a request's keys with the same function. ``medium`` is ``ram`` (the cells an engine kept after
  a request: the next request with that prefix skips its prefill there and only there) or ``store``
  (a block written to the store: any worker of the fleet grafts it). The stream is behind the API key
  like every route but ``/health`` (it tells which prefixes are hot), and off (403) on a server with
  tenants (``--api-key-file``: one tenant would see another's prefixes come and go). A subscriber that cannot keep up
  loses the oldest batches (``MAX_QUEUED_BATCHES``) and is told how many with a ``dropped`` field:
  events are hints for routing, never the truth about a block (a lookup is).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .http import HTTPError, error_response
from .tenants import tenant_of

if TYPE_CHECKING:
    from .pool import EnginePool

__all__ = ["KvEvents", "WorkerHeader", "WORKER_HEADER", "KV_EVENTS_PATH", "worker_name", "kv_usage"]

log = logging.getLogger("graftmem")

WORKER_HEADER = "X-Graftmem-Worker"
KV_EVENTS_PATH = "/v1/kv_events"
#: Batches a slow subscriber may have waiting before the oldest are dropped (and counted to it).
MAX_QUEUED_BATCHES = 256
#: Seconds between two keep-alive comments on an idle stream (a proxy's idle timeout stays unexpired).
KEEPALIVE_S = 15.0


def worker_name() -> str:
    """This process, as a gateway's logs would name it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def kv_usage(pool: "EnginePool") -> float:
    """The fraction (0..1) of the pool's KV cells held by the requests being served now: what vLLM's
    ``vllm:kv_cache_usage_perc`` measures (cells kept for reuse between requests are a cache, free to
    be overwritten, as vLLM's cached-but-unreferenced blocks count free)."""
    total = sum(e.n_ctx for e in pool.engines)
    used = sum(e.n_past for e in pool.busy)
    return round(min(1.0, used / total), 6) if total else 0.0


class WorkerHeader:
    """Adds ``X-Graftmem-Worker: host:pid`` to every HTTP response."""

    def __init__(self, app: ASGIApp, name: Optional[str] = None) -> None:
        self.app, self.value = app, (name or worker_name()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (WORKER_HEADER.lower().encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, sending)


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.dropped = 0


class KvEvents:
    """The hub of one server's KV events: `stored` / `removed` publish (from any thread), `ram_changed`
    diffs the engines' kept cells after each request, ``GET /v1/kv_events`` streams to subscribers."""

    def __init__(self, pool: Optional["EnginePool"] = None) -> None:
        self.pool = pool
        self._subs: list[_Subscriber] = []
        self._lock = threading.Lock()
        self._ram: dict[int, tuple[str, ...]] = {}  #: per engine: the prefix keys (hex) its kept cells hold
        self.published = 0  #: batches published (for tests and /metrics)

    # ------------------------------------------------------------------ publishing (any thread)
    def publish(self, events: Sequence[dict[str, Any]]) -> None:
        if not events:
            return
        batch = {"ts": time.time(), "events": list(events)}
        with self._lock:
            subs = list(self._subs)
            self.published += 1
        for sub in subs:
            sub.loop.call_soon_threadsafe(self._offer, sub, batch)

    @staticmethod
    def _offer(sub: _Subscriber, batch: dict[str, Any]) -> None:
        while sub.queue.qsize() >= MAX_QUEUED_BATCHES:
            sub.queue.get_nowait()
            sub.dropped += 1
        sub.queue.put_nowait(batch)

    def stored(self, keys: Sequence[bytes], block_ids: Sequence[str], parent: Optional[bytes], token_count: int) -> None:
        """Blocks written to the store for the prefixes ``keys`` (`PrefixCache` calls it)."""
        self.publish([{"type": "BlockStored", "medium": "store", "block_hashes": [k.hex() for k in keys],
                       "parent_block_hash": parent.hex() if parent else None, "token_count": token_count,
                       "block_ids": list(block_ids)}])

    def removed(self, keys: Sequence[bytes], block_ids: Sequence[str]) -> None:
        """Blocks deleted from the store (evicted, `PrefixCache.evict`)."""
        self.publish([{"type": "BlockRemoved", "medium": "store", "block_hashes": [k.hex() for k in keys],
                       "block_ids": list(block_ids)}])

    def ram_changed(self, *_: Any) -> None:
        """After a request: what each engine's kept cells hold now, against what was published
        (an ``on_result`` hook of the OpenAI routes; its arguments are not needed)."""
        if self.pool is None:
            return
        events: list[dict[str, Any]] = []
        for e in self.pool.engines:
            kept = getattr(e, "kept", None)
            now = tuple(k.hex() for k in getattr(kept, "keys", ()) or ())
            before = self._ram.get(id(e), ())
            if now == before:
                continue
            self._ram[id(e)] = now
            gone = [k for k in before if k not in set(now)]
            new = [k for k in now if k not in set(before)]
            if gone:
                events.append({"type": "BlockRemoved", "medium": "ram", "block_hashes": gone})
            if new:
                ends = getattr(kept, "ends", ()) or ()
                events.append({"type": "BlockStored", "medium": "ram", "block_hashes": new,
                               "parent_block_hash": before[-1] if before and now[:len(before)] == before else None,
                               "token_count": int(ends[-1]) if ends else 0, "block_ids": []})
        self.publish(events)

    # ------------------------------------------------------------------ the stream
    def endpoints(self) -> list[BaseRoute]:
        return [Route(KV_EVENTS_PATH, self.stream, methods=["GET"])]

    async def _batches(self) -> AsyncIterator[bytes]:
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            self._subs.append(sub)
        try:
            # what the engines hold now, first: a subscriber that joins late starts from the truth
            held = [{"type": "BlockStored", "medium": "ram", "block_hashes": list(keys), "parent_block_hash": None,
                     "token_count": 0, "block_ids": []} for keys in list(self._ram.values()) if keys]
            yield f"data: {json.dumps({'ts': time.time(), 'events': held})}\n\n".encode()
            while True:
                try:
                    batch = await asyncio.wait_for(sub.queue.get(), timeout=KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if sub.dropped:
                    batch = {**batch, "dropped": sub.dropped}
                    sub.dropped = 0
                yield f"data: {json.dumps(batch)}\n\n".encode()
        finally:
            with self._lock:
                if sub in self._subs:
                    self._subs.remove(sub)

    async def stream(self, request: Request) -> Response:
        if tenant_of(request.scope) is not None:  # which prefixes are hot would tell one tenant of another's
            return error_response(request.url.path, HTTPError(403, "GET /v1/kv_events is off on a server with tenants (--api-key-file): the "
                            "prefixes every tenant holds are the operator's to see", name="AccessDenied"))
        return StreamingResponse(self._batches(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
