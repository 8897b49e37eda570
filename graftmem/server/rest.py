"""REST endpoints for the memory itself, so agents in any language (and ``graftmem --url``) can manage
it without loading a model::

    GET    /v1/memory/blocks[?kind=K&SCOPE]  summaries (id, name, kind, tokens, parent, labels, shared, model,
                                             verified, provenance)
    GET    /v1/memory/blocks/<id>[?SCOPE]    one block's manifest (id or unique prefix)
    DELETE /v1/memory/blocks/<id>[?cascade=true&SCOPE]
    POST   /v1/memory/learn                 {"text", "name"?, "kind"?, "chat"?, "when_to_use"?, "parent"?, "metadata"?,
                                             "shared"?, SCOPE}
    POST   /v1/memory/ask                   {"id", "question", "max_tokens"?, "raw"?, "stop"?, "allow_unverified"?, SCOPE}
    POST   /v1/memory/search                {"query", "top_k"?, SCOPE}            (the router)
    POST   /v1/memory/recall                {"task", "max_tokens"?, "min_score"?, "stop"?, "allow_unverified"?, SCOPE}
    POST   /v1/memory/verify                {"id", "samples"?, "allow_unverified"?, SCOPE} (graft == fresh prefill)

SCOPE is ``user_id`` / ``agent_id`` / ``session_id`` (any of them), as `Memory` takes them: a learn records
the scope, the other verbs see only the blocks learned in it (``get`` / ``ask`` / ``delete`` of a block
outside it: 404). Who sees which block is `graftmem.memory.access.Access`'s rule, the same for every door:
with tenants (``serve --api-key-file``) a block a tenant learns is its own unless it asks ``"shared":
true`` (or the server runs with ``--shared-learned``); the operator's blocks are shared; scopes live inside
a tenant.

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
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..core.blocks import Block, Scope
from ..memory import validate as check
from ..memory.access import Access, owner_of, reserved_metadata
from ..memory.exactness import record_verification
from ..memory.verbs import MemoryVerbs
from ..store.scopes import ScopeIndex
from .http import HTTPError, Limits, client_gone, guarded, read_json
from .pool import EnginePool
from .routing import RouterRef
from .tenants import tenant_of

if TYPE_CHECKING:
    from ..core.blocks import VerifyReport
    from ..core.engine import Engine
    from ..store.protocol import BlockStore

__all__ = ["MemoryRoutes"]

T = TypeVar("T")

log = logging.getLogger("graftmem")


def _summary(b: Block) -> dict[str, Any]:
    """One listing line (`graftmem.api.BlockSummary`): what ``graftmem ls`` shows, remote or local."""
    return {"id": b.id, "name": b.name, "kind": b.kind, "n_tokens": b.n_tokens, "parent": b.parent,
            "created_at": b.created_at.isoformat(), "when_to_use": b.metadata.get("when_to_use"),
            "state_size": b.state_size, "shared": owner_of(b) is None, "model": b.fingerprint.model_name,
            "settings": b.fingerprint.settings, "verified": b.verified_here, "provenance": b.provenance,
            "labels_trusted": b.labels_trusted}


_SCOPE = ("user_id", "agent_id", "session_id")


class MemoryRoutes:
    """The memory's verbs over HTTP, on the server's pool, store and router."""

    def __init__(self, pool: EnginePool, store: "BlockStore", router: RouterRef, *,
                 limits: Limits | None = None, shared_learned: bool = False) -> None:
        self.pool, self.store, self.router = pool, store, router
        self.limits = limits or Limits()
        self.home = str(store.home)
        #: ``serve --shared-learned``: a tenant's learn is shared unless it sends ``"shared": false``
        self.shared_learned = shared_learned
        self._scopes: Optional[ScopeIndex] = None
        self._scopes_lock = threading.Lock()

    def scopes(self) -> ScopeIndex:
        """The home's scope index (the one `Memory.scopes` opens), opened on the first scoped request."""
        with self._scopes_lock:
            if self._scopes is None:
                self._scopes = ScopeIndex(self.store.home, timeout=self.store.lock_timeout,
                                          read_only=self.store.read_only)
            return self._scopes

    def close(self) -> None:
        with self._scopes_lock:
            if self._scopes is not None:
                self._scopes.close()
                self._scopes = None

    def access(self, request: Request) -> Access:
        """What this request's tenant may see (`graftmem.memory.access`): the one rule of every door."""
        return Access(self.store, tenant_of(request.scope), scopes=self.scopes)

    def handler(self, h: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """``h`` as a route of the memory: graftmem errors as HTTP statuses (`http.status_of`, the one map),
        messages without local paths (the web page's routes, `graftmem.server.ui`, answer the same way)."""
        return guarded(h, self.home)

    def routes(self) -> list[BaseRoute]:
        g = self.handler
        return [Route("/v1/memory/blocks", g(self.list), methods=["GET"]),
                Route("/v1/memory/blocks/{bid}", g(self.get), methods=["GET"]),
                Route("/v1/memory/blocks/{bid}", g(self.delete), methods=["DELETE"]),
                Route("/v1/memory/learn", g(self.learn), methods=["POST"]),
                Route("/v1/memory/search", g(self.search), methods=["POST"]),
                Route("/v1/memory/recall", g(self.recall), methods=["POST"]),
                Route("/v1/memory/ask", g(self.ask), methods=["POST"]),
                Route("/v1/memory/verify", g(self.verify), methods=["POST"])]

    async def _body(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.limits)

    async def _on_engine(self, fn: Callable[["Engine"], T], request: Optional[Request] = None,
                         cancel: Optional[threading.Event] = None) -> T:
        """``fn(engine)`` on an engine of the pool, on that engine's thread, admitted as every request is (`EnginePool.on_engine`). With ``request``: a client that goes
        away while waiting for an engine gives up its place, and one that goes away while ``fn`` runs
        sets ``cancel`` (an answer's decode stops at its next token; it used to run to ``max_tokens``)."""
        gone = asyncio.ensure_future(client_gone(request)) if request is not None else None
        try:
            result = await self.pool.on_engine(fn, gone, cancel)
            if getattr(result, "finish_reason", None) == "cancelled":
                log.info("serve: a request was cancelled (its client went away) after %d token(s)",
                         len(getattr(result, "tokens", [])))
            return result
        finally:
            if gone is not None:
                gone.cancel()

    def _router(self) -> Any:
        if not self.router.available:
            raise HTTPError(400, "this server was started without a router", code="router_unavailable")
        return self.router.get()

    # ------------------------------------------------------------------ verbs
    def _desk(self, engine: "Engine") -> MemoryVerbs:
        """The verbs of this pooled engine: every check, consent and stamp is theirs, as for `Memory`."""
        return MemoryVerbs(engine, self.store)

    async def list(self, request: Request) -> Response:
        kind = request.query_params.get("kind") or None
        scope = _scope(request.query_params)
        blocks = await anyio.to_thread.run_sync(lambda: self.access(request).list(kind, scope))
        return JSONResponse({"blocks": [_summary(b) for b in blocks]})

    async def get(self, request: Request) -> Response:
        block = self.access(request).get(request.path_params["bid"], _scope(request.query_params))
        return Response(block.model_dump_json(), media_type="application/json")

    async def delete(self, request: Request) -> Response:
        """Delete a block this tenant owns (a shared one: only the tenant that shared it; 403 otherwise),
        within the scope if one is given; its scope rows go with it. Another tenant's block is a 404 like
        a missing one, and the answer never names nor counts another tenant's blocks (`Access.delete`)."""
        cascade = request.query_params.get("cascade", "").lower() in ("1", "true", "yes")
        access = self.access(request)
        bid, gone, shown = await anyio.to_thread.run_sync(
            lambda: access.delete(request.path_params["bid"], _scope(request.query_params), cascade))
        self.router.removed(gone)
        access.forget(gone, cascade_from=bid)
        return JSONResponse({"deleted": shown})

    async def learn(self, request: Request) -> Response:
        """``Memory.learn``: the same checks (`graftmem.memory.validate`: ``name: 5``, ``kind: ""``, a lone
        surrogate are 400s), the same learn path, the scope recorded. With tenants the block is the
        requester's own (another tenant's learn of the same text is another block) unless ``shared``."""
        body = await self._body(request)
        args = _fields(body, ("name", "kind", "chat", "when_to_use", "parent", "metadata"))
        text: Any = body.get("text")  # JSON as sent: prepare_learn checks it
        shared = body.get("shared", self.shared_learned)
        check.flag("shared", shared)
        scope = _scope(body)
        reserved_metadata(args.get("metadata"))
        access = self.access(request)
        owner, shared_by = access.owns(shared)
        self._desk(self.pool.engines[0]).prepare_learn(text, **args)  # the checks, before queueing
        if "parent" in args:  # chaining on a block this key may not see would graft its state here
            pblock = access.get(args["parent"])
            if owner is None and owner_of(pblock) is not None:  # every tenant would read its parent's text
                raise check._error("parent", "a shared block cannot be chained on a tenant's own block: learn "
                                   "it unshared, or chain it on a shared parent")
            args["parent"] = pblock.id
        started = datetime.now(timezone.utc)

        def learn(e: "Engine") -> tuple[Block, bool]:
            block, changed = self._desk(e).learn(text, owner=owner, shared_by=shared_by,
                                                 may_relabel=access.may_delete, **args)
            access.own(block, scope, changed, started)
            return block, changed
        block, changed = await self._on_engine(learn)
        if changed:
            self.router.added([block])
        return JSONResponse({"block": _summary(block), "new": changed})

    async def search(self, request: Request) -> Response:
        body = await self._body(request)
        query: Any = body.get("query")  # JSON as sent, checked below
        top_k = body.get("top_k", 5)
        check.text("query", query)
        check.integer("top_k", top_k, lo=1, hi=100)
        desk = self._desk(self.pool.engines[0])
        router = self._router
        allow = self.access(request).allow(_scope(body))
        hits = await anyio.to_thread.run_sync(lambda: desk.search(router(), query, top_k=top_k, allow=allow))
        return JSONResponse({"hits": [h.model_dump(mode="json") for h in hits]})

    async def recall(self, request: Request) -> Response:
        """``Memory.recall``: route, ask the routed block's consent (``allow_unverified``) before it is
        grafted, answer; the receipt names the provenance of what was grafted."""
        body = await self._body(request)
        args = _fields(body, ("max_tokens", "min_score", "stop", "allow_unverified"))
        task: Any = body.get("task")  # JSON as sent: prepare_recall checks it
        args["allow"] = self.access(request).allow(_scope(body))  # this tenant's blocks, in the scope
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
        # JSON as sent, checked below and by prepare_ask
        bid: Any = body.get("id")
        question: Any = body.get("question")
        raw = body.get("raw", False)
        check.flag("raw", raw)
        check.text("question", question, empty=True)
        scope = _scope(body)
        if isinstance(bid, str) and bid.strip():
            bid = self.access(request).get(bid, scope).id  # another tenant's block is not there for this key
        self._desk(self.pool.engines[0]).prepare_ask(bid, question, turn=not raw, **args)  # checks, consent
        cancel = threading.Event()
        r = await self._on_engine(lambda e: self._desk(e).prepare_ask(bid, question, turn=not raw, **args)(
            lambda _: cancel.is_set()), request, cancel)
        return Response(r.model_dump_json(), media_type="application/json")

    async def verify(self, request: Request) -> Response:
        """``Memory.verify`` of one block this tenant sees: graft it and prefill it fresh on ``samples``
        queries (default `VERIFY_SAMPLES`, at most `MAX_VERIFY_SAMPLES`: each is a prefill of the block on
        the engine a chat request would use) and compare the logits byte for byte, in this process (the
        cross-process graft is the operator's ``graftmem verify``), after the consent of a graft (an ``unverified``
        block needs ``allow_unverified``, as for ``ask``: `MemoryVerbs.verify`). The report is returned, not recorded
        in the block's manifest: a tenant's check is not the operator's stamp on a shared block."""
        body = await self._body(request)
        rep = await self.run_verify(request, body, default=VERIFY_SAMPLES, most=MAX_VERIFY_SAMPLES, record=False)
        return Response(rep.model_dump_json(), media_type="application/json")

    async def run_verify(self, request: Request, body: dict[str, Any], *, default: int, most: int,
                         record: bool) -> "VerifyReport":
        """The one verify of a door (this route's and the web page's, `graftmem.server.ui`): ``body``'s
        ``id`` (a block this tenant sees), ``samples`` (``default``, at most ``most``) and
        ``allow_unverified`` checked; the consent of a graft before it queues; `MemoryVerbs.verify` on a
        pooled engine (a client that leaves gives up its place); with ``record``, the report is kept as
        ``graftmem verify`` keeps it (`record_verification`)."""
        bid: Any = body.get("id")
        samples = body.get("samples", default)
        allow = body.get("allow_unverified", False)
        check.text("id", bid)
        check.integer("samples", samples, lo=1, hi=most)
        check.flag("allow_unverified", allow)
        block = self.access(request).get(bid, _scope(body))  # another tenant's block: a 404
        self._desk(self.pool.engines[0]).consent(block, allow)  # a verify grafts: refused before it queues

        def run(e: "Engine") -> "VerifyReport":
            rep = self._desk(e).verify(block.id, samples=samples, cross_process=False, allow_unverified=allow)
            if record:
                record_verification(self.store, self.scopes(), rep)
            return rep

        return await self._on_engine(run, request)


#: Queries a REST verify samples by default, and at most (``POST /v1/memory/verify``; docs/security.md).
VERIFY_SAMPLES = 8
MAX_VERIFY_SAMPLES = 200


def _scope(fields: Any) -> Scope:
    """The scope a request names (a JSON body or the query string), checked (`ConfigError`: a 400)."""
    return check.scope(*(fields.get(k) for k in _SCOPE))


def _fields(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The given fields of a JSON body, as keyword arguments (absent or null: the verb's default)."""
    return {k: body[k] for k in names if body.get(k) is not None}
