"""``GET /health`` and ``GET /metrics``: what an orchestrator probes and what Prometheus scrapes.

``/health`` is public even on a server with an API key (a load balancer's probe carries no key, and
the answer says nothing but that the server serves): ``200 {"status": "ok"}``. ``graftmem serve``
binds its socket before it loads its engines; until they are loaded and warmed the socket's loading
gate (`graftmem.server.app.Gate`) answers ``503 {"status": "loading"}`` here.

``/metrics`` is behind the key like every other route (token counts and queue depth tell a
neighbour how busy the server is), in Prometheus' text exposition format 0.0.4. Names carry no
colons (colons are reserved for recording rules). Counters live in this process only: a restart
starts them at zero, which Prometheus' ``rate()`` handles.

Requests are counted by an ASGI middleware outside the API key's, so refused requests (401) are
counted too; the route label is the route's path template (``/v1/blocks/{block_id}``) or ``other``
for a path no route serves, so a client cannot grow the label set by sending random paths.

With tenants (``serve --api-key-file``) every counter is kept per tenant and a tenant's key reads its
own only (requests, tokens, seconds, its automatic blocks' bytes) plus the load gauges (queue depth,
busy engines: a busy server shows as latency anyway). Server-wide counts (every tenant's, refused
requests, blocks refused, deferred writes) go to the operator's key (``serve --metrics-key``), which
reads ``/metrics`` and ``/v1/info`` and nothing else. Why: a global ``graftmem_cached_tokens_total``
moved by 36 on each of tenant A's calls told tenant B that A's prompt had matched a block B shared
(issue 37). Without tenants (no key, or one ``--api-key``) every key reads the whole server's, as before.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any, Optional, Sequence

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .fleet import kv_usage
from .http import PUBLIC_PATHS
from .prefix import AUTO_KIND
from .tenants import owner_of, tenant_of

if TYPE_CHECKING:
    from ..store.protocol import BlockStore
    from .generate import Result
    from .pool import EnginePool
    from .prefix import PrefixCache

__all__ = ["Metrics", "MetricsMiddleware", "HEALTH_PATH", "METRICS_PATH", "PUBLIC_PATHS"]

log = logging.getLogger("graftmem")

HEALTH_PATH = "/health"  #: in `PUBLIC_PATHS`: the API key does not guard it
METRICS_PATH = "/metrics"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: Where a request's restored prompt prefix came from: cells kept in RAM, a graft from the store, a graft
#: whose block was fetched from a fleet store's bucket (a cache miss: the receipt has ``fetch_ms``).
SOURCES = ("bucket", "ram", "store")


def source_of(result: "Result") -> str:
    """The `SOURCES` entry of a request's restored prefix (``store`` when nothing was restored)."""
    r = result.receipt
    if r.source == "store" and r.fetch_ms:
        return "bucket"
    return r.source or "store"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Counts:
    """The counters of one tenant (None: requests without one: no tenants, refused, ``/health``)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens: Counter[str] = Counter()  #: by source: ram, store, bucket
        self.created_tokens = 0
        self.generated_tokens = 0
        # seconds are floats: a Counter is typed (and meant) for int counts
        self.restore_seconds: defaultdict[str, float] = defaultdict(float)  #: by source: ram, store, bucket
        self.prefill_seconds: defaultdict[str, float] = defaultdict(float)  #: by source of the restored prefix (none: cold)
        self.decode_seconds = 0.0

    def add(self, other: "_Counts") -> None:
        self.requests.update(other.requests)
        self.cached_tokens.update(other.cached_tokens)
        for mine, theirs in ((self.restore_seconds, other.restore_seconds), (self.prefill_seconds, other.prefill_seconds)):
            for source, seconds in theirs.items():
                mine[source] += seconds
        self.prompt_tokens += other.prompt_tokens
        self.created_tokens += other.created_tokens
        self.generated_tokens += other.generated_tokens
        self.decode_seconds += other.decode_seconds


#: `Metrics.render`'s view of the whole server (every tenant's counters and the server-wide ones)
WHOLE = "\0whole"


class Metrics:
    """The server's counters and gauges. Counters are updated from the event loop and from request
    workers, so one lock guards them; gauges are read when scraped (nothing to keep in step). Each
    tenant's counters are kept apart (`render` shows a tenant its own)."""

    def __init__(self, pool: Optional["EnginePool"] = None, store: Optional["BlockStore"] = None,
                 cache: Optional["PrefixCache"] = None) -> None:
        self.pool, self.store, self.cache = pool, store, cache
        self._lock = threading.Lock()
        self._by: dict[Optional[str], _Counts] = {}
        self.routes: list[BaseRoute] = []  #: set by `build_app`: the templates requests are labelled by

    def _of(self, tenant: Optional[str]) -> _Counts:
        """``tenant``'s counters (the caller holds the lock)."""
        c = self._by.get(tenant)
        if c is None:
            c = self._by[tenant] = _Counts()
        return c

    # ------------------------------------------------------------------ recording
    def route_of(self, scope: Scope) -> str:
        """The path template of the route that serves ``scope`` (``other`` when none does)."""
        for route in self.routes:
            if isinstance(route, Route):
                match, _ = route.matches(scope)
                if match == Match.FULL:
                    return route.path
        return "other"

    def request(self, route: str, status: int, tenant: Optional[str] = None) -> None:
        with self._lock:
            self._of(tenant).requests[(route, status)] += 1

    def served(self, result: "Result", tenant: Optional[str] = None) -> None:
        """One answered request's tokens (called once per request that decoded, streamed or not), counted
        for ``tenant``, the requester."""
        r = result.receipt
        source = source_of(result)
        with self._lock:
            c = self._of(tenant)
            c.prompt_tokens += result.prompt_tokens
            c.generated_tokens += len(result.tokens)
            c.created_tokens += result.created_tokens
            if result.cached_tokens:
                c.cached_tokens[source] += result.cached_tokens
            if r.source:
                c.restore_seconds[source] += r.restore_ms / 1e3
            c.prefill_seconds[source if r.source else "none"] += r.prefill_ms / 1e3
            c.decode_seconds += r.decode_ms / 1e3

    # ------------------------------------------------------------------ exposition
    def auto_block_bytes(self, tenant: Optional[str] = WHOLE) -> Optional[int]:
        """State bytes of the automatic prefix blocks in the store (what ``max_auto_bytes`` bounds):
        ``tenant``'s (None: those no tenant owns), or every block's (`WHOLE`)."""
        if self.store is None:
            return None
        return sum(b.state_size for b in self.store.list(kind=AUTO_KIND) if tenant == WHOLE or owner_of(b) == tenant)

    def render(self, auto_bytes: Optional[int] = None, tenant: Optional[str] = WHOLE) -> str:
        """The Prometheus text format of every metric: the whole server's (`WHOLE`), or ``tenant``'s
        view (its own counters and the load gauges; None: the requests without a tenant)."""
        whole = tenant == WHOLE
        with self._lock:
            c = _Counts()
            for who, counts in self._by.items():
                if whole or who == tenant:
                    c.add(counts)
        requests = sorted(c.requests.items())
        prompt, generated, created = c.prompt_tokens, c.generated_tokens, c.created_tokens
        cached, restore, prefill, decode = dict(c.cached_tokens), dict(c.restore_seconds), dict(c.prefill_seconds), \
            c.decode_seconds
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: Sequence[tuple[str, Any]]) -> None:
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        metric("graftmem_requests_total", "counter", "HTTP requests answered, by route template and status.",
               [(f'{{route="{_label(r)}",status="{s}"}}', n) for (r, s), n in requests])
        metric("graftmem_rate_limited_total", "counter", "Requests refused with 429 (engine queue full).",
               [("", sum(n for (_, s), n in requests if s == 429))])
        metric("graftmem_prompt_tokens_total", "counter", "Prompt tokens of answered requests.", [("", prompt)])
        sources = sorted({*SOURCES, *cached, *restore})
        metric("graftmem_cached_tokens_total", "counter",
               "Prompt tokens not prefilled: kept in RAM, grafted from the store or fetched from the bucket, by source.",
               [(f'{{source="{_label(s)}"}}', cached.get(s, 0)) for s in sources])
        metric("graftmem_created_tokens_total", "counter",
               "Prompt tokens written to new prefix blocks (Anthropic's cache_creation_input_tokens).", [("", created)])
        metric("graftmem_generated_tokens_total", "counter", "Tokens generated.", [("", generated)])
        metric("graftmem_restore_seconds_total", "counter",
               "Seconds spent restoring prompt prefixes (trim of kept cells, or graft: read, check, set), by source.",
               [(f'{{source="{_label(s)}"}}', round(restore.get(s, 0.0), 6)) for s in sources])
        metric("graftmem_prefill_seconds_total", "counter",
               "Seconds spent prefilling prompt tokens, by source of the restored prefix (none: served cold).",
               [(f'{{source="{_label(s)}"}}', round(prefill.get(s, 0.0), 6)) for s in sorted({"none", *sources, *prefill})])
        metric("graftmem_decode_seconds_total", "counter", "Seconds spent generating tokens.", [("", round(decode, 6))])
        if self.cache is not None and whole:  # server-wide: any tenant's blocks and learning
            metric("graftmem_verify_failures_total", "counter",
                   "Stored blocks refused because a check failed (digest, fingerprint, llama.cpp refusing the bytes); "
                   "the request was served cold.", [("", self.cache.refusals)])
            metric("graftmem_learn_writes_deferred_total", "counter",
                   "Learned prompt prefixes whose cut, hash and write waited for the requests computing to finish.",
                   [("", self.cache.deferred_writes)])
        if self.pool is not None:
            metric("graftmem_queue_depth", "gauge", "Requests waiting for an engine.", [("", self.pool.waiting)])
            metric("graftmem_engines_busy", "gauge", "Engines serving a request.", [("", self.pool.in_use)])
            metric("graftmem_engines", "gauge", "Engines in the pool.", [("", self.pool.size)])
            # 0..1, the name vLLM's is read by (the Kubernetes inference gateway's endpoint picker takes
            # the name as a flag: --kv-cache-usage-percentage-metric; docs/fleet.md)
            metric("graftmem_kv_cache_usage_perc", "gauge",
                   "Fraction (0-1) of the engines' KV cells held by the requests being served now.",
                   [("", kv_usage(self.pool))])
        if auto_bytes is not None:
            metric("graftmem_auto_block_bytes", "gauge", "State bytes of automatic prefix blocks in the store.",
                   [("", auto_bytes)])
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ routes
    def endpoints(self) -> list[BaseRoute]:
        return [Route(HEALTH_PATH, self.health, methods=["GET"]),
                Route(METRICS_PATH, self.metrics, methods=["GET"])]

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        # a tenant reads its own counters; no tenant (no keys, one shared key, the operator's key): all
        view = WHOLE if tenant_of(request.scope) is None else tenant_of(request.scope)
        # the store's listing reads its index: off the event loop
        auto = await anyio.to_thread.run_sync(self.auto_block_bytes, view)
        return Response(self.render(auto, view), media_type=None, headers={"Content-Type": CONTENT_TYPE})


class MetricsMiddleware:
    """Counts every HTTP request by route template and the status it was answered with."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # a handler that raised before answering: the 500 the error middleware sends

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.request(self.metrics.route_of(scope), status[0], tenant_of(scope))

