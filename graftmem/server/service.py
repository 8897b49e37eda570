"""The whole server in one call: block sharing and the OpenAI-compatible API over one store, one
engine pool and its prefix cache, on one uvicorn socket (what ``graftmem serve`` runs)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from starlette.routing import Route

from ..core.errors import GraftmemError
from ..share.admission import BlockCheck
from .anthropic import AnthropicRoutes
from .app import Gate
from .blocks import BlockServer
from .embeddings import EmbeddingRoutes
from .fleet import KvEvents
from .generate import warm_engines
from .http import Limits
from .config import ServeConfig
from .metrics import Metrics
from .openai import OpenAIRoutes
from .pipeline import ChatPipeline
from .pool import EnginePool
from .prefix import PrefixCache
from .responses import ResponsesRoutes
from .rest import MemoryRoutes
from .routing import RouterRef
from .runner import ServerThread
from .tenants import ApiKeys
from .ui import UiRoutes

if TYPE_CHECKING:
    from ..core.blocks import Fingerprint
    from ..core.engine import Engine
    from ..memory.router import Router
    from ..store.protocol import BlockStore

__all__ = ["api_server", "bind", "block_server"]

log = logging.getLogger("graftmem")


#: Seconds a closing server waits for the prefix cache's writer after its requests have finished.
STORE_FLUSH_S = 120.0


def bind(host: str = "127.0.0.1", port: int = 0, limits: Optional[Limits] = None) -> ServerThread:
    """A socket bound now, serving a loading gate (`graftmem.server.app.Gate`: ``/health`` answers
    ``503 {"status": "loading"}``, every API path a 503) until the server built on it
    (``api_server(..., runner=...)``) starts. ``graftmem serve`` binds first and loads its engines
    after, so an orchestrator's first probe reads "loading", not "connection refused". Start it
    (``.start()``, or ``.serve_forever()`` in the thread that handles signals) before loading."""
    return ServerThread(Gate(), host=host, port=port, limits=limits)


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def api_server(store: "BlockStore", engines: Sequence["Engine"], config: Optional[ServeConfig] = None, *,
               check: Optional[BlockCheck] = None, router: Optional[Callable[[], "Router"]] = None,
               runner: Optional[ServerThread] = None, **options: Any) -> BlockServer:
    """A `BlockServer` that also answers ``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``, the Responses API ``/v1/responses`` (`graftmem.server.responses`: stored responses
    are KV chains, kept ``responses_ttl`` seconds at most, None: until evicted), Anthropic's
    ``/v1/messages`` (`graftmem.server.anthropic`), ``/health`` and
    ``/metrics`` (`graftmem.server.metrics`) with ``engines`` (one request per engine at a time, ``max_queue`` waiting), grafting
    stored prompt prefixes and learning those seen ``sightings`` times with at least
    ``min_prefix_tokens`` tokens (automatic blocks kept under ``max_auto_bytes``, least recently used
    evicted first; blocks a user learned are never evicted). ``router`` (called on the first routed
    request) enables ``"graftmem": {"recall": true}``, ``/v1/memory/search|recall`` and
    ``/v1/embeddings`` (its embedder, `graftmem.server.embeddings`).
    ``auto_storage``: ``"full"`` (fast grafts, the default) or ``"delta"`` (less disk) for chained
    automatic blocks (`PrefixCache`). ``warm``: before serving, graft the most recently learned
    automatic prefixes into the engines and keep them in RAM (`warm_engines`: what a restarted agent
    sends first is found there; ``srv.warm`` says what each engine got). ``chat_template``: a template
    file that renders chat requests instead of the GGUF's own (llama-server's ``--chat-template-file``).
    ``allow_unverified``: the
    operator's consent to graft blocks nothing here vouches for (imported without re-derivation,
    dropped into the store) for every request and the warm start; without it they are grafted only
    for a request that sends ``"graftmem": {"allow_unverified": true}`` (or REST's
    ``allow_unverified``), and the receipt names their provenance. Not started: use it as a
    context manager or call ``start()``.

    ``api_key``: one key (every client the same tenant) or `ApiKeys` (``serve --api-key-file``): each
    key names a tenant, whose automatic blocks, cached prefixes and receipts no other tenant reaches
    (`graftmem.server.tenants`); each keeps its automatic blocks under its share of ``max_auto_bytes``.
    Without a key the server is one local trust domain, said in the log at start-up (a warning when it
    listens beyond loopback). With tenants, a block a tenant learns through REST is its own unless it
    sends ``"shared": true``; ``shared_learned`` (``serve --shared-learned``) makes sharing the default
    (the clients are one team that keeps automatic blocks apart but learns together). The operator's
    blocks (learned into the home with the SDK or the CLI) are shared with every tenant either way
    (`graftmem.memory.access`).

    ``runner``: a socket bound before the engines were loaded (`bind()`), answering 503 until this server
    starts on it; ``host`` and ``port`` are then its own.

    The options are ``config`` (a `ServeConfig`: the defaults when None) with ``options`` applied, so
    ``api_server(store, engines, min_prefix_tokens=16)`` still works; an unknown option is a
    `ConfigError`. ``config.engines`` is not read here: the server answers with the ``engines`` it is
    given (`Memory.serve` opens that many). ``check`` vets pushed blocks (`Memory.vetting`)."""
    cfg = ServeConfig.of(config, **options)
    host, api_key, max_queue, learn = cfg.host, cfg.api_key, cfg.max_queue, cfg.learn
    allow_unverified, limits = cfg.allow_unverified, cfg.limits
    keys = ApiKeys.single(api_key) if isinstance(api_key, str) else api_key
    tenants = len(keys.entries) if keys is not None and keys.named else 1
    if keys is None or not keys.named:
        level = logging.INFO if _loopback(host) else logging.WARNING
        log.log(level, "serve: %s on %s: one trust domain, every client shares the prompt cache, its "
                "automatic blocks and their receipts%s", "no API key file" if keys else "no API key", host,
                "" if _loopback(host) else " (listening beyond loopback: give --api-key-file, one key per tenant)")
    pool = EnginePool(engines, max_queue=max_queue)
    cache = PrefixCache(store, engines[0].fingerprint, min_tokens=cfg.min_prefix_tokens, sightings=cfg.sightings,
                        learn=learn, max_auto_bytes=cfg.max_auto_bytes, auto_storage=cfg.auto_storage, tenants=tenants)
    ref = RouterRef(router)
    if cfg.preload_router and ref.available:
        ref.get()  # before serving: its first routed or embedding request must not stall the others
    pipe = ChatPipeline(pool, store, cache, model_id=cfg.model_id, limits=limits, router=ref,
                        allow_unverified=allow_unverified, chat_template=cfg.chat_template)
    desks = [pipe.desks[id(e)] for e in engines]
    warmed = warm_engines(desks, cache, allow_unverified=allow_unverified, tokens=pipe.tokens,
                          run=lambda e, fn: pool.run(e, fn).result()) if cfg.warm else []
    responses = ResponsesRoutes(pipe, ttl=cfg.responses_ttl)
    responses.stored.sweep()  # what expired while the server was down
    rest = MemoryRoutes(pool, store, ref, limits=limits, shared_learned=cfg.shared_learned)
    page = UiRoutes(rest, pool, cache).routes() if cfg.ui else []  # the web page: only when asked for
    metrics = Metrics(pool, store, cache)
    pipe.on_result.append(metrics.served)
    kv_events = cache.events = KvEvents(pool)  # GET /v1/kv_events (graftmem.server.fleet)
    pipe.on_result.append(kv_events.ram_changed)
    srv = BlockServer(store, host=host, port=cfg.port, push_token=cfg.push_token, fingerprint=engines[0].fingerprint,
                      sign_key=cfg.sign_key, check=check, api_key=keys, metrics_key=cfg.metrics_key, limits=limits,
                      extra=OpenAIRoutes(pipe).routes() + responses.routes() + AnthropicRoutes(pipe).routes() + EmbeddingRoutes(pipe).routes()
                      + rest.routes() + kv_events.endpoints() + page + [Route(path, endpoint=app) for path, app in cfg.mounts],
                      metrics=metrics, runner=runner)
    srv.pool, srv.cache, srv.pipeline, srv.warm = pool, cache, pipe, warmed  # type: ignore[attr-defined]
    srv.metrics, srv.responses, srv.config = metrics, responses, cfg  # type: ignore[attr-defined]

    def forget() -> None:
        # running requests finish (what they learn is stored), bounded like uvicorn's graceful shutdown
        if not pipe.wait_idle(pipe.limits.graceful_shutdown):
            log.warning("serve: closed with requests still running; what they learn may not be stored")
        # the prefixes they learned are written after them (a bounded backlog of local writes, which
        # a loaded machine may take longer than the requests' grace to finish): wait for those too
        if not cache.flush(STORE_FLUSH_S):
            log.warning("serve: closed before every learned prefix was stored (%.0f s)", STORE_FLUSH_S)
        for e in engines:  # the engines may outlive the server (Memory.serve): leave them empty
            try:
                with e.session():
                    pass
            except GraftmemError:  # closed already: nothing kept
                pass
        rest.close()
        pool.close()  # the engines' threads end (nothing runs on them any more)
        pipe.close()  # the render processes end

    srv.on_close.append(forget)
    return srv


def block_server(store: "BlockStore | str | os.PathLike[str]", config: Optional[ServeConfig] = None, *,
                 fingerprint: Optional["Fingerprint"] = None, check: Optional[BlockCheck] = None,
                 **options: Any) -> BlockServer:
    """A `BlockServer` (block sharing only: listings, pulls, and pushes when ``push_token`` is set) over
    ``store`` (a path: opened here, closed with the server) with ``config``'s host, port, keys and
    limits; ``fingerprint`` and ``check`` (`Memory.vetting`) are what pushes need. The options nobody
    reads without an engine (learning, engines, warm start) are ignored: `api_server` takes them."""
    cfg = ServeConfig.of(config, **options)
    return BlockServer(store, host=cfg.host, port=cfg.port, push_token=cfg.push_token, fingerprint=fingerprint,
                       sign_key=cfg.sign_key, check=check, api_key=cfg.api_key, metrics_key=cfg.metrics_key,
                       limits=cfg.limits)
