"""REST endpoints for the memory itself, so agents in any language (and ``graftmem --url``) can manage
it without loading a model::

    GET    /v1/memory/blocks[?kind=K]       summaries (id, name, kind, tokens, parent, labels)
    GET    /v1/memory/blocks/<id>           one block's manifest (id or unique prefix)
    DELETE /v1/memory/blocks/<id>[?cascade=true]
    POST   /v1/memory/learn                 {"text", "name"?, "kind"?, "chat"?, "when_to_use"?, "parent"?}
    POST   /v1/memory/ask                   {"id", "question", "max_tokens"?, "raw"?}
    POST   /v1/memory/search                {"query", "top_k"?}            (the router)
    POST   /v1/memory/recall                {"task", "max_tokens"?, "min_score"?}  (route, graft, answer)

Each verb calls the same feature function [`Memory`][graftmem.Memory] calls (``memory.learn.learn``,
``memory.recall.search`` / ``recall``) with an engine from the pool, so an answer through the server is
the answer ``Memory.recall`` gives, receipt included. Errors are in OpenAI's shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..core.blocks import Block
from ..core.decoding import check_stops
from ..core.errors import (AccessDenied, BlockNotFound, ConfigError, GraftmemError, IncompatibleBlock, StoreLocked,
                           UnverifiedBlock)
from ..memory.learn import learn
from ..memory.answer import ask as ask_block
from ..memory.recall import continuation_for, recall, search
from ..store.chain import chain_of
from .http import HTTPError, Limits, guarded, json_object, public_message, read_body
from .pool import EnginePool
from .routing import RouterRef

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.local import Store

__all__ = ["MemoryRoutes"]

T = TypeVar("T")


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
                                code=type(exc).__name__) from exc
        return run

    async def _body(self, request: Request) -> dict[str, Any]:
        return json_object(await read_body(request, self.limits.max_body_bytes, self.limits.body_timeout))

    async def _on_engine(self, fn: Callable[["Engine"], T]) -> T:
        engine = await self.pool.acquire()
        try:
            return await anyio.to_thread.run_sync(fn, engine)
        finally:
            self.pool.release(engine)

    def _router(self) -> Any:
        if not self.router.available:
            raise HTTPError(400, "this server was started without a router", code="router_unavailable")
        return self.router.get()

    # ------------------------------------------------------------------ verbs
    async def list(self, request: Request) -> Response:
        kind = request.query_params.get("kind") or None
        return JSONResponse({"blocks": [_summary(b) for b in self.store.list(kind=kind)]})

    async def get(self, request: Request) -> Response:
        return Response(self.store.get(request.path_params["bid"]).model_dump_json(), media_type="application/json")

    async def delete(self, request: Request) -> Response:
        cascade = request.query_params.get("cascade", "").lower() in ("1", "true", "yes")
        bid = self.store.resolve(request.path_params["bid"])
        gone = self.store.delete(bid, cascade=cascade)
        self.router.removed(gone)
        return JSONResponse({"deleted": gone})

    async def learn(self, request: Request) -> Response:
        body = await self._body(request)
        text = body.get("text")
        if not isinstance(text, str) or not text:
            raise HTTPError(400, "text must be a non-empty string", param="text")
        opts = {k: body.get(k) for k in ("name", "when_to_use", "parent") if body.get(k) is not None}
        kind, chat = body.get("kind", "manual"), body.get("chat", False)
        if not isinstance(kind, str) or not isinstance(chat, bool):
            raise HTTPError(400, "kind must be a string and chat a boolean", param="kind")
        block, changed = await self._on_engine(lambda e: learn(e, self.store, text, kind=kind, chat=chat, **opts))
        if changed:
            self.router.added([block])
        return JSONResponse({"block": _summary(block), "new": changed})

    async def search(self, request: Request) -> Response:
        body = await self._body(request)
        query, top_k = body.get("query"), body.get("top_k", 5)
        if not isinstance(query, str) or not query.strip():
            raise HTTPError(400, "query must be a non-empty string", param="query")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 100:
            raise HTTPError(400, "top_k must be an integer in [1, 100]", param="top_k")
        digest = self.pool.engines[0].fingerprint.digest()
        router = self._router
        hits = await anyio.to_thread.run_sync(lambda: search(router(), self.store, digest, query, top_k=top_k))
        return JSONResponse({"hits": [h.model_dump(mode="json") for h in hits]})

    async def recall(self, request: Request) -> Response:
        body = await self._body(request)
        task, max_tokens, min_score = body.get("task"), body.get("max_tokens", 64), body.get("min_score")
        if not isinstance(task, str) or not task.strip():
            raise HTTPError(400, "task must be a non-empty string", param="task")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HTTPError(400, "max_tokens must be a positive integer", param="max_tokens")
        if min_score is not None and not isinstance(min_score, (int, float)):
            raise HTTPError(400, "min_score must be a number", param="min_score")
        stops = check_stops(body.get("stop"))
        router = await anyio.to_thread.run_sync(self._router)
        r = await self._on_engine(lambda e: recall(e, self.store, router, task, max_tokens=max_tokens,
                                                   min_score=min_score, stops=stops))
        return Response(r.model_dump_json(), media_type="application/json")

    async def ask(self, request: Request) -> Response:
        """``Memory.ask``: graft one block (by id or unique prefix) and answer ``question`` after it (as the
        next chat turn for a chat block, unless ``raw``), greedily, up to ``stop`` strings if given. A block
        that nothing here vouches for is refused."""
        body = await self._body(request)
        bid, question, max_tokens = body.get("id"), body.get("question"), body.get("max_tokens", 64)
        raw = body.get("raw", False)
        if not isinstance(bid, str) or not bid or not isinstance(question, str) or not question:
            raise HTTPError(400, "id and question must be non-empty strings", param="question")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1 or not isinstance(raw, bool):
            raise HTTPError(400, "max_tokens must be a positive integer and raw a boolean", param="max_tokens")
        stops = check_stops(body.get("stop"))
        block = self.store.get(bid)
        for b in chain_of(self.store, block):
            if not b.trusted:
                raise UnverifiedBlock(f"block {block.short_id}: {b.short_id} is {b.provenance}: nothing here "
                                      "proved that its state is its text's; re-derive it first")
        query = question if raw else continuation_for(block, question)
        r = await self._on_engine(lambda e: ask_block(e, self.store, block, query, max_tokens=max_tokens,
                                                      stops=stops))
        r = r.model_copy(update={"receipt": r.receipt.model_copy(update={"provenance": block.provenance})})
        return Response(r.model_dump_json(), media_type="application/json")
