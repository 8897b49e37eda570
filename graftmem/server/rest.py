"""REST endpoints for the memory itself, so agents in any language (and ``graftmem --url``) can manage
it without loading a model::

    GET    /v1/memory/blocks[?kind=K]       summaries (id, name, kind, tokens, parent, labels)
    GET    /v1/memory/blocks/<id>           one block's manifest (id or unique prefix)
    DELETE /v1/memory/blocks/<id>[?cascade=true]
    POST   /v1/memory/learn                 {"text", "name"?, "kind"?, "chat"?, "when_to_use"?, "parent"?, "metadata"?}
    POST   /v1/memory/ask                   {"id", "question", "max_tokens"?, "raw"?, "stop"?, "allow_unverified"?}
    POST   /v1/memory/search                {"query", "top_k"?}            (the router)
    POST   /v1/memory/recall                {"task", "max_tokens"?, "min_score"?, "stop"?, "allow_unverified"?}

Each verb calls the same object [`Memory`][graftmem.Memory] calls (`graftmem.memory.verbs.MemoryVerbs`)
with an engine from the pool, so an answer through the server is the answer ``Memory.recall`` gives,
receipt included, after the same argument checks (a `ConfigError` is a 400) and the same consent rule
(an ``unverified`` block is refused, 400 ``UnverifiedBlock``, unless ``allow_unverified``). Errors are
in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..core.blocks import Block
from ..core.errors import (AccessDenied, BlockNotFound, ConfigError, GraftmemError, IncompatibleBlock, StoreLocked,
                           UnverifiedBlock)
from ..memory import validate as check
from ..memory.verbs import MemoryVerbs
from .http import HTTPError, Limits, client_gone, guarded, json_object, off_loop, public_message, read_body
from .pool import EnginePool
from .routing import RouterRef
from .tenants import tenant_of, visible

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.local import Store

__all__ = ["MemoryRoutes"]

T = TypeVar("T")

log = logging.getLogger("graftmem")


def _summary(b: Block) -> dict[str, Any]:
    return {"id": b.id, "name": b.name, "kind": b.kind, "n_tokens": b.n_tokens, "parent": b.parent,
            "created_at": b.created_at.isoformat(), "when_to_use": b.metadata.get("when_to_use"),
            "state_size": b.state_size}


class MemoryRoutes:
    """The memory's verbs over HTTP, on the server's pool, store and router."""

    def __init__(self, pool: EnginePool, store: "Store", router: RouterRef, *,
                 limits: Limits | None = None) -> None:
        self.pool, self.store, self.router = pool, store, router
        self.limits = limits or Limits()
        self.home = str(store.home)

    def routes(self) -> list[BaseRoute]:
        g = lambda h: guarded(self._translated(h), self.home)  # noqa: E731
        return [Route("/v1/memory/blocks", g(self.list), methods=["GET"]),
                Route("/v1/memory/blocks/{bid}", g(self.get), methods=["GET"]),
                Route("/v1/memory/blocks/{bid}", g(self.delete), methods=["DELETE"]),
                Route("/v1/memory/learn", g(self.learn), methods=["POST"]),
                Route("/v1/memory/search", g(self.search), methods=["POST"]),
                Route("/v1/memory/recall", g(self.recall), methods=["POST"]),
                Route("/v1/memory/ask", g(self.ask), methods=["POST"])]

    def _translated(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """graftmem errors as HTTP statuses (the message without local paths)."""
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except GraftmemError as exc:
                status = (404 if isinstance(exc, BlockNotFound) else 403 if isinstance(exc, AccessDenied)
                          else 503 if isinstance(exc, StoreLocked)
                          else 400 if isinstance(exc, (ConfigError, IncompatibleBlock, UnverifiedBlock)) else 500)
                raise HTTPError(status, public_message(str(exc), self.home), name=type(exc).__name__,
                                param=getattr(exc, "param", None), code=type(exc).__name__) from exc
        return run

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.limits.max_body_bytes, self.limits.body_timeout)
        return await off_loop(len(raw), json_object, raw, self.limits.max_json_depth)

    async def _on_engine(self, fn: Callable[["Engine"], T], request: Optional[Request] = None,
                         cancel: Optional[threading.Event] = None) -> T:
        """``fn(engine)`` in a worker thread on an engine of the pool. With ``request``: a client that goes
        away while waiting for an engine gives up its place, and one that goes away while ``fn`` runs
        sets ``cancel`` (an answer's decode stops at its next token; it used to run to ``max_tokens``)."""
        gone = asyncio.ensure_future(client_gone(request)) if request is not None else None
        try:
            acquire = asyncio.ensure_future(self.pool.acquire())
            if gone is not None:
                await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not acquire.done():
                    acquire.cancel()
                    raise HTTPError(499, "the client went away", code="client_closed_request")
            engine = await acquire
            try:
                work = asyncio.ensure_future(asyncio.to_thread(fn, engine))
                if gone is not None:
                    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not work.done() and cancel is not None:
                        cancel.set()
                result = await work
                if getattr(result, "finish_reason", None) == "cancelled":
                    log.info("serve: a request was cancelled (its client went away) after %d token(s)",
                             len(getattr(result, "tokens", [])))
                return result
            finally:
                self.pool.release(engine)
        finally:
            if gone is not None:
                gone.cancel()

    def _router(self) -> Any:
        if not self.router.available:
            raise HTTPError(400, "this server was started without a router", code="router_unavailable")
        return self.router.get()

    def _descendants(self, bid: str) -> list[str]:
        out, todo = [], list(self.store.children(bid))
        while todo and len(out) < 100_000:
            c = todo.pop()
            out.append(c)
            todo += self.store.children(c)
        return out

    # ------------------------------------------------------------------ verbs
    def _desk(self, engine: "Engine") -> MemoryVerbs:
        """The verbs of this pooled engine: every check, consent and stamp is theirs, as for `Memory`."""
        return MemoryVerbs(engine, self.store)

    def _visible(self, request: Request, bid: str) -> Block:
        """The block ``bid`` (id or prefix) if the request's tenant may see it; else as if missing."""
        check.text("block id", bid)
        tenant = tenant_of(request.scope)
        try:
            block = self.store.get(bid)
        except ConfigError:  # an ambiguous prefix could tell that another tenant's block exists
            block = None
        if block is None or not visible(block, tenant):
            raise BlockNotFound(f"no block {bid[:64]!r} in this store")
        return block

    async def list(self, request: Request) -> Response:
        kind = request.query_params.get("kind") or None
        tenant = tenant_of(request.scope)
        return JSONResponse({"blocks": [_summary(b) for b in self.store.list(kind=kind) if visible(b, tenant)]})

    async def get(self, request: Request) -> Response:
        return Response(self._visible(request, request.path_params["bid"]).model_dump_json(),
                        media_type="application/json")

    async def delete(self, request: Request) -> Response:
        cascade = request.query_params.get("cascade", "").lower() in ("1", "true", "yes")
        bid = self._visible(request, request.path_params["bid"]).id
        tenant = tenant_of(request.scope)
        if cascade and any(not visible(self.store.get(c), tenant) for c in self._descendants(bid)):
            raise BlockNotFound(f"block {bid[:12]} has descendants this key may not delete")
        gone = self.store.delete(bid, cascade=cascade)
        self.router.removed(gone)
        return JSONResponse({"deleted": gone})

    async def learn(self, request: Request) -> Response:
        """``Memory.learn``: the same checks (`graftmem.memory.validate`: ``name: 5``, ``kind: ""``, a lone
        surrogate are 400s), the same learn path."""
        body = await self._body(request)
        args = _fields(body, ("name", "kind", "chat", "when_to_use", "parent", "metadata"))
        text = body.get("text")
        self._desk(self.pool.engines[0]).prepare_learn(text, **args)  # the checks, before queueing
        if "parent" in args:  # chaining on another tenant's automatic block would graft its state here
            self._visible(request, args["parent"])
        block, changed = await self._on_engine(lambda e: self._desk(e).learn(text, **args))
        if changed:
            self.router.added([block])
        return JSONResponse({"block": _summary(block), "new": changed})

    async def search(self, request: Request) -> Response:
        body = await self._body(request)
        query, top_k = body.get("query"), body.get("top_k", 5)
        check.text("query", query)
        check.integer("top_k", top_k, lo=1, hi=100)
        desk = self._desk(self.pool.engines[0])
        router = self._router
        hits = await anyio.to_thread.run_sync(lambda: desk.search(router(), query, top_k=top_k))
        return JSONResponse({"hits": [h.model_dump(mode="json") for h in hits]})

    async def recall(self, request: Request) -> Response:
        """``Memory.recall``: route, ask the routed block's consent (``allow_unverified``) before it is
        grafted, answer; the receipt names the provenance of what was grafted."""
        body = await self._body(request)
        args = _fields(body, ("max_tokens", "min_score", "stop", "allow_unverified"))
        task = body.get("task")
        self._desk(self.pool.engines[0]).prepare_recall(self._router, task, **args)  # the checks, before queueing
        router = await anyio.to_thread.run_sync(self._router)
        cancel = threading.Event()
        r = await self._on_engine(lambda e: self._desk(e).prepare_recall(lambda: router, task, **args)(
            lambda _: cancel.is_set()), request, cancel)
        return Response(r.model_dump_json(), media_type="application/json")

    async def ask(self, request: Request) -> Response:
        """``Memory.ask``: graft one block (by id or unique prefix) and answer ``question`` after it (as the
        next chat turn for a chat block, unless ``raw``), greedily, up to ``stop`` strings if given. A block
        that nothing here vouches for is refused unless ``allow_unverified``."""
        body = await self._body(request)
        args = _fields(body, ("max_tokens", "stop", "allow_unverified"))
        bid, question, raw = body.get("id"), body.get("question"), body.get("raw", False)
        check.flag("raw", raw)
        check.text("question", question, empty=True)
        if isinstance(bid, str) and bid.strip():
            self._visible(request, bid)  # another tenant's automatic block is not there for this key
        self._desk(self.pool.engines[0]).prepare_ask(bid, question, turn=not raw, **args)  # checks, consent
        cancel = threading.Event()
        r = await self._on_engine(lambda e: self._desk(e).prepare_ask(bid, question, turn=not raw, **args)(
            lambda _: cancel.is_set()), request, cancel)
        return Response(r.model_dump_json(), media_type="application/json")


def _fields(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The given fields of a JSON body, as keyword arguments (absent or null: the verb's default)."""
    return {k: body[k] for k in names if body.get(k) is not None}
