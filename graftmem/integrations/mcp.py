"""graftmem as an MCP server (the official ``mcp`` Python SDK, extra ``graftmem[mcp]``).

Why: Claude Desktop, Cursor, Codex and every agent framework speak MCP; an agent developer reaches for
an MCP server before reading an SDK. The tools are the memory's verbs (learn, recall with its receipt,
search, ask a block, verify, forget, list, show) and the resources are its blocks and documents.

One path for every door. Each tool is one request to the memory's REST routes (`graftmem.server.rest`)
through `graftmem.api.RemoteJSON`, so an MCP answer is the answer ``POST /v1/memory/recall`` gives,
after the same checks, consent rule, keys and tenants:

* ``graftmem mcp`` (stdio, `run_stdio`) talks to a running ``graftmem serve`` (``--url`` /
  ``$GRAFTMEM_URL``, with ``$GRAFTMEM_API_KEY``), or, without one, to a server it starts in its own
  process on a free loopback port with a random key (the model and the router load there);
* ``graftmem serve --mcp`` mounts `McpDoor` at ``/mcp`` (streamable HTTP, stateless, JSON answers).
  Behind the server's key middleware like every route, it forwards each tool call to the same app
  in-process with the caller's own ``Authorization`` / ``X-Api-Key``: the key is checked again and its
  tenant sees only its own blocks and the shared ones, whatever MCP session id a client sends.

Answers are trimmed for a model's context: a recall's block is its summary (no token ids), a verify
report has no per-sample rows; ``show`` gives a block's manifest and text without its token ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

try:
    import anyio
    import anyio.from_thread
    import anyio.to_thread
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError
    from pydantic import Field
except ImportError as exc:  # the extra is missing: say which one
    raise ImportError("graftmem's MCP server needs the mcp SDK: pip install 'graftmem[mcp]'") from exc

from .. import BlockNotFound, GraftmemError
from ..api import RemoteJSON

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

__all__ = ["McpDoor", "PATH", "build_mcp_server", "run_stdio"]

log = logging.getLogger("graftmem")

#: Where ``graftmem serve --mcp`` answers MCP's streamable HTTP.
PATH = "/mcp"

#: The scope key under which `McpDoor` leaves the outer app for the tools (the server's whole app, its
#: key middleware included).
_APP = "graftmem.mcp.app"

#: Instructions an MCP client shows its model.
INSTRUCTIONS = (
    "graftmem is an agent memory of verified KV-cache blocks. `learn` a text once (a manual, a solution); "
    "`recall` a task: the router picks one block, its KV state is grafted and the model answers after it, "
    "with a receipt (tokens restored, tokens prefilled, exact). `search` ranks blocks without grafting; "
    "`ask` answers after one named block; `verify` proves graft == fresh prefill byte for byte.")

#: Bounds a tool's schema states (a model's forced call is generated within them); the server checks
#: its own limits again
Tokens = Annotated[int, Field(ge=1, le=1024)]
TopK = Annotated[int, Field(ge=1, le=100)]
Samples = Annotated[int, Field(ge=1, le=200)]

#: One client per tool call: for stdio always the same one, over HTTP the caller's own (its key).
ClientFor = Callable[[Context], RemoteJSON]


def _plain(message: str) -> str:
    """A server's error message without the transport's preamble ("the server at URL: server answered
    404: "): the door's internal URL means nothing to the client."""
    head, sep, rest = message.partition(" answered ")
    if sep and head.startswith("the server at ") and rest[:3].isdigit() and rest[3:5] == ": ":
        return rest[5:]
    return message


def _summary(block: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A block as a model should see it in an answer: who it is, not its token ids."""
    if block is None:
        return None
    keep = ("id", "name", "kind", "n_tokens", "parent", "provenance", "created_at", "when_to_use")
    out = {k: block.get(k) for k in keep if k in block}
    meta = block.get("metadata") or {}
    if meta.get("when_to_use") and "when_to_use" not in out:
        out["when_to_use"] = meta["when_to_use"]
    return out


def _answer(recall: dict[str, Any]) -> dict[str, Any]:
    """A `Recall` (JSON) without its token ids: the text, the routed block and the whole receipt."""
    return {"text": recall.get("text", ""), "matched": recall.get("matched", True), "reason": recall.get("reason"),
            "score": recall.get("score"), "finish_reason": recall.get("finish_reason"),
            "block": _summary(recall.get("block")), "receipt": recall.get("receipt")}


def _manifest(block: dict[str, Any]) -> dict[str, Any]:
    """A block's manifest with its text, without its token ids (what ``show`` returns)."""
    return {k: v for k, v in block.items() if k not in ("tokens", "segments")}


def _quietly(make: Callable[[], MCPServer]) -> MCPServer:
    """``make()`` with the root logger left as it was: the SDK's server calls ``logging.basicConfig`` (a
    handler and level INFO on the root logger), which is the application's to decide, not a library's."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return make()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def build_mcp_server(client: ClientFor, *, name: str = "graftmem") -> MCPServer:
    """An `MCPServer` whose tools and resources call ``client(ctx)``'s verbs (a `RemoteJSON`), each
    in a worker thread (a verb is one blocking request; an answer decodes on the server)."""
    server = _quietly(lambda: MCPServer(name, instructions=INSTRUCTIONS))

    async def call(ctx: Context, verb: Callable[[RemoteJSON], Any], resource: bool = False) -> Any:
        """The verb's JSON; a graftmem error reaches the client with its class and message (the SDK hides
        an unexpected exception's text: a missing block or a bad argument is the caller's to fix)."""
        remote = client(ctx)
        try:
            return await anyio.to_thread.run_sync(lambda: verb(remote))
        except GraftmemError as exc:
            msg = f"{type(exc).__name__}: {_plain(str(exc))}"
            if not resource:
                raise ToolError(msg) from exc
            raise (ResourceNotFoundError(msg) if isinstance(exc, BlockNotFound) else ResourceError(msg)) from exc

    @server.tool(description="Learn a text once into a verified block (its KV state stored; deduplicated by "
                             "content). chat=true stores it as a chat turn, for recall; when_to_use says which "
                             "tasks it serves (routing). Returns the block and whether it is new.")
    async def learn(text: str, ctx: Context, name: Optional[str] = None, kind: Optional[str] = None,
                    when_to_use: Optional[str] = None, chat: bool = True,
                    shared: Optional[bool] = None) -> dict[str, Any]:
        got = await call(ctx, lambda r: r.learn(text, name=name, kind=kind, when_to_use=when_to_use, chat=chat,
                                                shared=shared))
        return {"block": got["block"], "new": got["new"]}

    @server.tool(description="Route a task to the one block that serves it, graft its KV state and answer "
                             "greedily after it. Returns the answer, the routed block and the receipt "
                             "(tokens_restored, tokens_prefilled, exact, provenance).")
    async def recall(task: str, ctx: Context, max_tokens: Tokens = 64,
                     min_score: Optional[float] = None) -> dict[str, Any]:
        return _answer(await call(ctx, lambda r: r.recall(task, max_tokens=max_tokens, min_score=min_score)))

    @server.tool(description="Rank the blocks for a task with the router, best first; nothing is grafted.")
    async def search(query: str, ctx: Context, top_k: TopK = 5) -> dict[str, Any]:
        return {"hits": await call(ctx, lambda r: r.search(query, top_k=top_k))}

    @server.tool(description="Graft one block (id or unique prefix) and answer a question after it, as the next "
                             "chat turn. Returns the answer and the receipt.")
    async def ask(block_id: str, question: str, ctx: Context, max_tokens: Tokens = 64) -> dict[str, Any]:
        return _answer(await call(ctx, lambda r: r.ask(block_id, question, max_tokens=max_tokens, turn=True)))

    @server.tool(description="Prove that grafting a block gives the same logits as prefilling its text fresh, "
                             "byte for byte, on `samples` queries. ok=true only if every sample is identical.")
    async def verify(block_id: str, ctx: Context, samples: Optional[Samples] = None) -> dict[str, Any]:
        rep = await call(ctx, lambda r: r.verify(block_id, samples=samples))
        ok = rep["sha_equal"] == rep["samples"] and rep["floor_sha_equal"] == rep["floor_samples"]
        return {"ok": ok, **{k: v for k, v in rep.items() if k != "rows"}}

    @server.tool(description="Delete a block (cascade=true also deletes the blocks chained on it).")
    async def forget(block_id: str, ctx: Context, cascade: bool = False) -> dict[str, Any]:
        return {"deleted": await call(ctx, lambda r: r.delete(block_id, cascade=cascade))}

    @server.tool(name="list", description="List the blocks this memory holds (of `kind` if given): id, name, "
                                          "kind, tokens, provenance, verified.")
    async def list_blocks(ctx: Context, kind: Optional[str] = None) -> dict[str, Any]:
        return {"blocks": await call(ctx, lambda r: r.ls(kind=kind))}

    @server.tool(description="Show one block (id or unique prefix): its manifest and text, without token ids.")
    async def show(block_id: str, ctx: Context) -> dict[str, Any]:
        return _manifest(await call(ctx, lambda r: r.get(block_id)))

    # the listings are templates with an optional query: the SDK hands a Context (the caller, over HTTP)
    # only to templated resources
    @server.resource("graftmem://blocks{?kind}", name="blocks", mime_type="application/json",
                     description="Every block this memory holds (of ?kind= if given), one summary each")
    async def blocks_resource(ctx: Context, kind: Optional[str] = None) -> str:
        return json.dumps(await call(ctx, lambda r: r.ls(kind=kind), True))

    @server.resource("graftmem://blocks/{block_id}", name="block", mime_type="text/plain",
                     description="A block's text: exactly what its KV state was computed from")
    async def block_resource(block_id: str, ctx: Context) -> str:
        return str((await call(ctx, lambda r: r.get(block_id), True))["text"])

    def pages(r: RemoteJSON, document: Optional[str] = None) -> list[dict[str, Any]]:
        out = []
        for s in r.ls(kind="page"):
            meta = r.get(s["id"]).get("metadata") or {}
            if document is None or meta.get("document") == document:
                out.append({"block_id": s["id"], "document": meta.get("document"),
                            "name": meta.get("document_name"), "page": meta.get("page"), "n_tokens": s["n_tokens"],
                            "char_start": meta.get("char_start"), "char_end": meta.get("char_end")})
        return sorted(out, key=lambda p: (str(p["document"]), p["page"] or 0))

    @server.resource("graftmem://documents{?name}", name="documents", mime_type="application/json",
                     description="The long documents learned as pages (learn_document); ?name= narrows them")
    async def documents_resource(ctx: Context, name: Optional[str] = None) -> str:
        docs: dict[str, dict[str, Any]] = {}
        for p in await call(ctx, pages, True):
            if name is not None and p["name"] != name:
                continue
            d = docs.setdefault(str(p["document"]), {"document": p["document"], "name": p["name"], "pages": 0,
                                                     "n_tokens": 0})
            d["pages"] += 1
            d["n_tokens"] += p["n_tokens"]
        return json.dumps(list(docs.values()))

    @server.resource("graftmem://documents/{document}", name="document", mime_type="application/json",
                     description="One document's pages: block id, page number, tokens, character range")
    async def document_resource(document: str, ctx: Context) -> str:
        return json.dumps(await call(ctx, lambda r: pages(r, document), True))

    return server


# ------------------------------------------------------------------------------------------ stdio
def run_stdio(url: Optional[str] = None, *, api_key: Optional[str] = None,
              memory: Optional[Callable[[], Any]] = None) -> None:
    """Serve MCP over stdin/stdout until the client closes it (``graftmem mcp``).

    With ``url``: every tool is a request to that ``graftmem serve`` (with ``api_key``). Without it,
    ``memory()`` (a `Memory`) is served on a free loopback port with a random key for the session
    (`Memory.serve`: the REST routes, with its router), and the tools ask that: the same verbs, checks
    and answers as the HTTP door. Nothing is written to stdout but MCP's messages (logs go to stderr)."""
    if url is not None:
        remote = RemoteJSON(url, api_key=api_key)
        build_mcp_server(lambda _ctx: remote).run("stdio")
        return
    if memory is None:
        raise ValueError("run_stdio needs a server url or a memory to serve")
    key = secrets.token_urlsafe(24)
    with memory() as mem:
        srv = mem.serve(api=True, api_key=key, warm=False, learn=False).start()
        try:
            log.info("mcp: serving %s over stdio through %s", mem.store.home, srv.url)
            remote = RemoteJSON(srv.url, api_key=key)
            build_mcp_server(lambda _ctx: remote).run("stdio")
        finally:
            srv.close()


# ------------------------------------------------------------------------------------------ HTTP
class McpDoor:
    """MCP's streamable HTTP as an ASGI app for ``graftmem serve`` (`ServeConfig.mounts`, at `PATH`).

    Stateless (each POST stands alone: no session table to bound or to hijack) with JSON answers. Each
    tool call is forwarded, in-process, to the server's own memory routes with the caller's key headers,
    through the whole app (its key middleware and metrics included): one rule for who sees what, the
    REST routes'. The SDK's session manager needs a running task group, which uvicorn's missing lifespan
    events never start: the first request starts it in the server's loop (`_started`), and it ends with
    that loop. One door per server: the SDK's session manager runs once."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.server = build_mcp_server(self._client)
        # the SDK guards loopback servers against DNS rebinding (Host / Origin checks); beyond loopback the
        # server's API keys guard it, as every other route
        self.app = self.server.streamable_http_app(streamable_http_path=PATH, stateless_http=True,
                                                   json_response=True, host=host)
        self._task: Optional[asyncio.Task[None]] = None
        self._ready: Optional[asyncio.Event] = None
        self._stop: Optional[asyncio.Event] = None

    async def __call__(self, scope: "Scope", receive: "Receive", send: "Send") -> None:
        if scope["type"] == "http":
            scope[_APP] = scope.get("app")  # the server's app (the inner Starlette sets its own)
            await self._started()
        await self.app(scope, receive, send)

    async def _started(self) -> None:
        if self._ready is None:
            self._ready, self._stop = asyncio.Event(), asyncio.Event()
            ready, stop = self._ready, self._stop

            async def run() -> None:
                async with self.server.session_manager.run():
                    ready.set()
                    await stop.wait()
            self._task = asyncio.get_running_loop().create_task(run(), name="graftmem-mcp")
        await self._ready.wait()

    def _client(self, ctx: Context) -> RemoteJSON:
        """The caller's client: its key headers on requests to the server's app, in-process."""
        request = ctx.request_context.request
        scope = getattr(request, "scope", None)
        app = scope.get(_APP) if isinstance(scope, dict) else None
        if app is None:
            raise RuntimeError("an MCP tool call outside an HTTP request of graftmem serve")
        given = {k.lower(): v for k, v in request.headers.items()}  # type: ignore[union-attr]
        keys = {k: given[k] for k in ("authorization", "x-api-key") if k in given}
        return RemoteJSON("http://graftmem.internal", transport=_in_process(app, keys))


def _in_process(app: Any, keys: dict[str, str]) -> Callable[[str, str, dict, Optional[bytes]], tuple[int, bytes]]:
    """A `RemoteJSON` transport that sends each request to ``app`` in the server's event loop (called from
    the tool's worker thread) with the caller's key headers."""
    import httpx

    async def send(method: str, path: str, headers: dict, body: Optional[bytes]) -> tuple[int, bytes]:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0))
        async with httpx.AsyncClient(transport=transport, base_url="http://graftmem.internal") as c:
            resp = await c.request(method, path, headers={**headers, **keys}, content=body)
            return resp.status_code, resp.content

    return lambda method, path, headers, body: anyio.from_thread.run(send, method, path, headers, body)
