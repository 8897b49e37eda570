"""``/ui``: a web page that shows what a memory holds, served by ``graftmem serve --ui``.

Why: mem0's OpenMemory and Letta ship a dashboard; without one, nobody could look at a store but through
the CLI. The page shows the blocks (kind, provenance, tenant and scopes, tokens, size, last used), the
chains and the stored conversations as trees, a block's text and receipts, a verify button with its
result, the router's top hits for a typed task, and the metrics.

What is served:

* the page itself (``/ui``) and its static files (``/ui/static/*``: ``index.html``, ``ui.js``, ``ui.css``,
  shipped in the package, plain JS, no build step, nothing fetched from the network), without a key
  (`graftmem.server.http.PUBLIC_PATHS`): they hold no data. A browser cannot send a bearer token on a
  navigation, so the page asks for the key, keeps it in the tab's ``sessionStorage`` (gone when the tab
  closes, never a cookie, so no other site can make the browser send it) and sends it as
  ``Authorization: Bearer`` on each of its calls. Strict headers: a Content-Security-Policy that allows
  the page's own script and style only (a block's text is anybody's prompt; the page writes every value
  as text, and the policy stops a script even where it did not), no framing, no referrer, ``nosniff``.
* the data, behind the same keys as every route, read through the routes that already exist:
  ``/v1/memory/blocks`` (the listing, and one block's manifest: text, tokens, metadata, verification,
  the receipt of a stored response), ``/v1/memory/search`` (the router), ``/metrics``. Two JSON routes
  here serve what those do not reach:

  - ``GET /ui/api/blocks``: per block this key sees, its owner tenant and sharer, the scopes that own it
    (this tenant's rows only), when it was last used (`PrefixCache.used_at`, the time eviction reads),
    and the stored response it holds (id, previous id, the turn's text), with the requester's tenant;
  - ``POST /ui/api/verify`` ``{"id", "samples"?, "allow_unverified"?}``: `MemoryVerbs.verify` on an engine of
    the pool (queued like any request: ``--max-queue``, a 429 past it), graft vs fresh prefill on
    ``samples`` queries (default `DEFAULT_VERIFY_SAMPLES`, at most `MAX_VERIFY_SAMPLES`) in this process;
    the result is kept as the CLI's ``graftmem verify`` keeps it (`record_verification`). A block that
    nothing here vouches for is refused (400 ``UnverifiedBlock``) unless ``allow_unverified``: the same
    consent as a graft for an answer.

Tenants: every answer goes through the requester's `Access` (`graftmem.memory.access`), the one rule of
every door: a tenant's key sees its own blocks and the shared ones, never another tenant's (404 as if
missing). Off unless asked for (``ServeConfig.ui``); docs/ui.md, and docs/security.md's "Web page".
"""

from __future__ import annotations

import importlib.resources
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ...core.blocks import Block
from ...memory.access import SHARED_BY_KEY, Access, owner_of
from ..http import HTTPError, read_json
from ..tenants import tenant_of

if TYPE_CHECKING:
    from ..pool import EnginePool
    from ..prefix import PrefixCache
    from ..rest import MemoryRoutes

__all__ = ["UiRoutes", "DEFAULT_VERIFY_SAMPLES", "MAX_VERIFY_SAMPLES", "PAGE_HEADERS"]

#: queries one click on "verify" proves (graft vs fresh prefill, SHA-256 of the logits)
DEFAULT_VERIFY_SAMPLES = 4
#: the most one request may ask for: each sample holds an engine for a graft and a prefill (the CLI's
#: ``graftmem verify`` defaults to 50, and adds the graft in a new process, which the server does not run)
MAX_VERIFY_SAMPLES = 50
#: characters of a stored turn's text shown in the conversation tree (the whole turn is in the manifest)
TURN_PREVIEW = 200

#: the page's own files, the only names ``/ui/static/`` answers (never a path from the request)
_ASSETS = {"index.html": "text/html; charset=utf-8", "ui.js": "text/javascript; charset=utf-8",
           "ui.css": "text/css; charset=utf-8"}

#: headers of the page and its files: its own script and style only, no framing, no referrer
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_DATA_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def _asset(name: str) -> bytes:
    return (importlib.resources.files(__name__) / "static" / name).read_bytes()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def _turn(messages: Any) -> list[dict[str, str]]:
    """A stored turn's messages as (role, the start of its text), for the conversation tree."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        text = content if isinstance(content, str) else ""
        if not text and m.get("tool_calls"):
            text = "(tool calls)"
        out.append({"role": str(m.get("role", "")), "text": text[:TURN_PREVIEW]})
    return out


class UiRoutes:
    """The page, its files and its two JSON routes, over the REST routes' store, access rule and pool."""

    def __init__(self, rest: "MemoryRoutes", pool: "EnginePool", cache: "Optional[PrefixCache]" = None) -> None:
        self.rest, self.pool, self.cache, self.store = rest, pool, cache, rest.store
        self.assets = {name: _asset(name) for name in _ASSETS}  # read once: a missing file fails at start

    def routes(self) -> list[BaseRoute]:
        g = self.rest.handler
        return [Route("/ui", self.page, methods=["GET"]),
                Route("/ui/", self.slash, methods=["GET"]),
                Route("/ui/static/{name}", g(self.static), methods=["GET"]),
                Route("/ui/api/blocks", g(self.blocks), methods=["GET"]),
                Route("/ui/api/verify", g(self.verify), methods=["POST"])]

    # ------------------------------------------------------------------ the page
    async def page(self, request: Request) -> Response:
        return Response(self.assets["index.html"], media_type=_ASSETS["index.html"], headers=PAGE_HEADERS)

    async def slash(self, request: Request) -> Response:
        return RedirectResponse("../ui", status_code=307)  # relative: right behind a proxy's path prefix too

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.assets:
            raise HTTPError(404, f"no file {name[:64]!r} in the web page", code="not_found")
        return Response(self.assets[name], media_type=_ASSETS[name], headers=PAGE_HEADERS)

    # ------------------------------------------------------------------ data the REST routes do not serve
    def _extras(self, access: Access) -> list[dict[str, Any]]:
        out = []
        for b in access.list():
            out.append({"id": b.id, "tenant": owner_of(b), "shared_by": b.metadata.get(SHARED_BY_KEY),
                        "scopes": [s.model_dump(exclude_none=True) for s in access.scopes_of(b)],
                        **self._used(b), "response": self._response(b)})
        return out

    def _used(self, b: Block) -> dict[str, Any]:
        if self.cache is None:
            return {"last_used": None, "used_here": False}
        at, here = self.cache.used_at(b)
        return {"last_used": _iso(at), "used_here": here}

    @staticmethod
    def _response(b: Block) -> Optional[dict[str, Any]]:
        rec = b.metadata.get("response")
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            return None
        created = rec.get("created_at")
        return {"id": rec["id"], "previous_response_id": rec.get("previous_response_id"),
                "created_at": _iso(created) if isinstance(created, (int, float)) else None,
                "deleted": bool(rec.get("deleted")), "turn": _turn(rec.get("messages"))}

    async def blocks(self, request: Request) -> Response:
        access = self.rest.access(request)
        rows = await anyio.to_thread.run_sync(lambda: self._extras(access))
        return JSONResponse({"tenant": tenant_of(request.scope), "blocks": rows}, headers=_DATA_HEADERS)

    async def verify(self, request: Request) -> Response:
        """Graft vs fresh prefill of one block this key sees, on ``samples`` queries, on a pooled engine, the
        result recorded (`MemoryRoutes.run_verify`: the REST verify's one rule)."""
        body = await read_json(request, self.rest.limits)
        report = await self.rest.run_verify(request, body, default=DEFAULT_VERIFY_SAMPLES, most=MAX_VERIFY_SAMPLES,
                                            record=True)
        return Response(report.model_dump_json(), media_type="application/json", headers=_DATA_HEADERS)
