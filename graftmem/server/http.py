"""What every route of the server shares: error bodies, the API key, strict request bodies.

Three error shapes live on one server. The block-sharing routes answer ``{"error": "<GraftmemError class>",
"message": ...}``, which `graftmem.share.client` turns back into the same exception; the
OpenAI-compatible routes answer OpenAI's ``{"error": {"message", "type", "param", "code"}}``, which the
``openai`` package turns into its own exceptions; the Anthropic Messages routes answer Anthropic's
``{"type": "error", "error": {"type", "message"}}``. `error_response()` picks the shape by path, so a
refusal made before any route runs (API key, body size) still reads right to the client that asked.

Bodies are read strictly: a POST must say its ``Content-Length`` (missing, negative or not a number is
a 411 / 400), a length over the route's limit is a 413 before one byte is read, and the bytes are
counted as they arrive (a client that sends more than it announced is cut off, never buffered), within
a deadline, so a slow client cannot hold a worker forever.

Messages that leave the server never carry a local path: `public_message()` replaces the store's
home with ``<home>``.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core import jsontext
from ..core.errors import (AccessDenied, BlockCorrupted, BlockNotFound, BundleRejected, ClosedError, ConfigError,
                           EngineError, GraftmemError, IncompatibleBlock, ModelNotFound, StoreFull, StoreLocked,
                           StoreReadOnly, TransferError, UnverifiedBlock)
from ..core.grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from .tenants import TENANT_STATE, ApiKeys

#: paths the API key does not guard: the health probe (`graftmem.server.metrics`), and the web page's
#: markup and code (`graftmem.server.ui`: no data in them; the page asks for the key and sends it)
PUBLIC_PATHS = frozenset({"/health", "/ui", "/ui/"})
PUBLIC_PREFIXES = ("/ui/static/",)
#: the only paths the operator's metrics key opens (`ApiKeyMiddleware`): counters and store totals
OPERATOR_PATHS = frozenset({"/metrics", "/v1/info"})

__all__ = ["HTTPError", "Limits", "RefusalDelay", "error_response", "status_of", "as_http", "in_band", "read_json", "sse", "public_message", "read_body", "body_length",
           "ApiKeyMiddleware", "is_block_path", "is_anthropic_path", "anthropic_error", "PUBLIC_PATHS", "PUBLIC_PREFIXES", "OPERATOR_PATHS", "bearer", "guarded", "json_object", "json_depth", "client_gone",
           "off_loop", "OFF_LOOP_BYTES"]

log = logging.getLogger("graftmem")

#: Paths of the block-sharing API (graftmem's own error shape); everything else is OpenAI's.
_BLOCK_PREFIXES = ("/v1/info", "/v1/blocks", "/v1/push", "/v1/bundles")

#: Paths of the Anthropic Messages API (Anthropic's error shape, `graftmem.server.anthropic`).
_ANTHROPIC_PREFIXES = ("/v1/messages",)

_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 408: "timeout_error", 411: "invalid_request_error",
                 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 503: "server_error"}


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may cost the server."""

    max_body_bytes: int = 8 << 20  #: JSON bodies (chat requests); a pushed bundle has its own limit
    body_timeout: float = 60.0  #: seconds a request body may take to arrive, in all
    #: bytes per second a request body must arrive at, on average from its headers on (`body_lag`): a
    #: body that falls ``body_grace`` seconds behind it is a 408, and one behind it at all is evictable
    #: when the connections are at their cap (100 sockets trickling bodies held every slot for 60 s)
    min_body_rate: int = 1024
    body_grace: float = 10.0  #: seconds a body may fall behind ``min_body_rate`` before it is a 408
    #: seconds a response's writes may make no progress (the client does not read: the server's send
    #: buffer stays full) before its connection is aborted; it was never, and 100 such sockets held
    #: every slot. A client that reads slower than about 2 KB/s is cut by it
    write_timeout: float = 30.0
    keep_alive: float = 5.0  #: seconds an idle keep-alive connection stays open
    graceful_shutdown: float = 10.0  #: seconds running requests get to finish on close
    #: seconds a connection may take to send a request's headers (from its opening, or from the end of
    #: the previous response): an idle or slow-header socket is closed after it, never held forever
    header_timeout: float = 10.0
    #: open connections at most; past it the oldest ones without a request in flight are closed to
    #: make room (idle sockets must not exhaust the process's file descriptors: 420 idle sockets once
    #: left nobody served); also the listen backlog. None: a quarter of the process's descriptor limit,
    #: at most 1,000 (`graftmem.server.runner.default_max_connections`)
    max_connections: Optional[int] = None
    #: open connections one client address may hold (its own oldest idle or stalled ones are closed to
    #: make room, as for the cap); None: half of ``max_connections``, so one address (every local agent
    #: of a single-host deployment shares 127.0.0.1) never holds them all
    max_connections_per_client: Optional[int] = None
    #: the JSON nesting a request body may have (deeper is a 400 before it is parsed)
    max_json_depth: int = jsontext.MAX_DEPTH
    #: the messages a chat request may hold, at every door (chat completions, /v1/responses' input items
    #: and the conversation they re-render, /v1/messages), checked before anything renders or tokenizes
    #: them; the engine's ``n_ctx`` lowers it (every message takes at least a token of the context). The
    #: cuts between turns are found by rendering each prefix of the conversation: 100,000 tiny messages
    #: once burned minutes of CPU before their 400 (`graftmem.server.chat.bound_messages`)
    max_messages: int = 4096
    #: the content parts (text parts, Anthropic content blocks) and tool calls one message may hold
    max_message_parts: int = 1024
    #: what a ``response_format`` schema or a forced tool call's schemas may cost once made a grammar
    #: (repetitions, enum sizes, properties, the grammar's size and nesting; `graftmem.core.grammar_limits`)
    grammar: GrammarLimits = DEFAULT_GRAMMAR_LIMITS
    #: seconds a request's prompt may take to render, tokenize and cut into segments (in a worker
    #: thread; past it the work is stopped and the request is a 400: `graftmem.core.budget`)
    render_timeout: float = 10.0
    #: texts one ``/v1/embeddings`` request may embed (OpenAI's own limit is 2,048)
    max_embedding_inputs: int = 2048
    #: characters of all the texts of one ``/v1/embeddings`` request together: 2,048 long texts cost 108
    #: CPU-seconds; 256 Ki characters are at most about 256 texts of the embedder's full 256 word pieces,
    #: about 10 s of one core (`graftmem.server.embeddings`)
    max_embedding_chars: int = 256 << 10
    #: a refused request's answer (400, 401, 403, 413, 422, 431) is held this many times as long as the
    #: request took to refuse, at most ``refusal_delay_max`` seconds (`RefusalDelay`); 0: answered at once.
    #: One client looping on requests the server refuses (a 1.5 MB schema refused 20 times a second)
    #: otherwise takes a core of parsing from the honest ones: held, its loop gets 1/(1 + delay) of it
    refusal_delay: float = 3.0
    refusal_delay_max: float = 2.0

    def body_lag(self, elapsed: float, got: int) -> float:
        """Seconds a body is behind ``min_body_rate``: ``elapsed`` seconds after it began with ``got``
        bytes arrived (negative: ahead). One rule for the 408 (`read_body`: past ``body_grace``) and for
        the connection cap (`graftmem.server.runner`: a body behind at all may be evicted)."""
        return elapsed - got / max(1, self.min_body_rate)


#: the statuses `RefusalDelay` holds: what a client's own request got wrong (a bad body, a wrong key, a
#: body too large); not 404 (a poll for a block that is not there yet), 408, 409, 429 (its own Retry-After)
REFUSED = frozenset({400, 401, 403, 413, 422, 431})


class RefusalDelay:
    """ASGI middleware: a refused request's answer is held ``factor`` times as long as the request took
    (at most ``cap`` seconds) before it is sent.

    Why: refusing a request costs the server the reading and checking that found it wrong, and a client
    that loops on refused requests (the issue-37 grammar bombs: a 1.5 MB enum refused in ~20 ms, a
    200-byte schema in ~2 ms) took that much of a core from the honest clients for as long as it
    looped. Held, a client that waits for its answers (every HTTP/1.1 client on one connection) spends
    at most 1/(1 + factor) of its time costing the server anything. Nothing is held but a timer; an
    honest client's mistake costs it ``factor`` times a few milliseconds. It does not throttle a
    client that opens a new connection per request without waiting for the answers (the per-address
    connection limit bounds that one)."""

    def __init__(self, app: ASGIApp, factor: float, cap: float,
                 clock: Callable[[], float] = anyio.current_time,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self.app, self.factor, self.cap, self.clock, self.sleep = app, factor, cap, clock, sleep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.factor <= 0:
            await self.app(scope, receive, send)
            return
        began = self.clock()

        async def held(message: Any) -> None:
            if message["type"] == "http.response.start" and message["status"] in REFUSED:
                delay = min(self.cap, self.factor * (self.clock() - began))
                if delay > 0:
                    await self.sleep(delay)
            await send(message)

        await self.app(scope, receive, held)


class HTTPError(Exception):
    """A refusal with its status; ``name`` is the graftmem error class the block client maps it to."""

    def __init__(self, status: int, message: str, *, name: str = "TransferError", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.name = status, message, name
        self.param, self.code, self.headers = param, code, headers or {}


#: A graftmem error's HTTP status, by what its caller does next (`graftmem.core.errors`): the one map of every
#: door (block routes, memory REST, OpenAI, Responses, Anthropic, embeddings), most specific class first. The
#: class travels as the error's name / ``code`` (`graftmem.core.errors.from_response` turns it back).
_STATUS: tuple[tuple[type[GraftmemError], int], ...] = (
    (BlockNotFound, 404),        # no such block: list the store, check the id
    (AccessDenied, 403),         # the key's tenant may not do that
    (StoreLocked, 503),          # another process holds the store: retry
    (StoreReadOnly, 503),        # the server's home cannot be written: the operator's to fix
    (StoreFull, 507),            # the server's disk is full
    (ClosedError, 503),          # the server is shutting down
    (ConfigError, 400),          # a wrong argument (UnsupportedFeature too): the caller's to fix
    (IncompatibleBlock, 400),    # a block of another fingerprint: not for this server
    (UnverifiedBlock, 400),      # consent missing: re-derive it or allow_unverified
    (BlockCorrupted, 500),       # a stored block failed its check: the server's store is damaged
    (BundleRejected, 422),       # a malformed or untrusted upload: nothing was written
    (TransferError, 502),        # a transfer this server made (a fleet bucket) failed
    (ModelNotFound, 500),
    (EngineError, 500),          # llama.cpp refused an operation
    (GraftmemError, 500),
)


def status_of(exc: GraftmemError) -> int:
    """The HTTP status of a graftmem error (`_STATUS`)."""
    return next(status for cls, status in _STATUS if isinstance(exc, cls))


def as_http(exc: BaseException, home: Optional[str] = None) -> HTTPError:
    """Any failure as the refusal a door sends: an `HTTPError` as it is; a graftmem error with its status
    (`status_of`), its class as name and code and its ``param``; anything else a 500 that names only the
    exception's class (the caller logs the details). Messages name no local path (`public_message`)."""
    if isinstance(exc, HTTPError):
        exc.message = public_message(exc.message, home)
        return exc
    if isinstance(exc, GraftmemError):
        name = type(exc).__name__
        return HTTPError(status_of(exc), public_message(str(exc), home), name=name,
                         param=getattr(exc, "param", None), code=name,
                         headers={"Retry-After": "1"} if isinstance(exc, StoreLocked) else None)
    return HTTPError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                     code="internal_error")


def in_band(exc: BaseException, home: Any = None) -> HTTPError:
    """A failure after a stream has started (its status line is sent): `as_http`'s refusal, logged here,
    for the door to send as its protocol's in-band error event."""
    err = as_http(exc, None if home is None else str(home))
    if not isinstance(exc, (HTTPError, GraftmemError)):
        log.warning("serve: a streamed request failed: %r", exc)
    return err


def is_block_path(path: str) -> bool:
    return path.startswith(_BLOCK_PREFIXES)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(err: HTTPError) -> dict[str, Any]:
    """``err`` as Anthropic's error body (what the ``anthropic`` package turns into its exceptions)."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def public_message(message: str, home: Optional[str] = None) -> str:
    """``message`` without the server's local paths (the store's home becomes ``<home>``)."""
    if home:
        message = message.replace(home, "<home>")
    return message


def sse(data: Any, *, event: Optional[str] = None) -> bytes:
    """One server-sent event: an ``event:`` line when named (Anthropic's and the Responses streams name
    every event), then ``data:`` with the JSON (OpenAI's chat stream sends data lines only)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def error_response(path: str, err: HTTPError, *, close: bool = False) -> Response:
    """``err`` in the shape the client of ``path`` expects (graftmem's for blocks, Anthropic's for
    ``/v1/messages``, OpenAI's otherwise)."""
    headers = dict(err.headers)
    # a message quoting what the client sent may hold a lone surrogate, which the JSON body (UTF-8) cannot
    # carry: escaped, the refusal is still sent (it was a 500)
    err.message = err.message.encode("utf-8", "backslashreplace").decode("utf-8")
    if err.param is not None:
        err.param = err.param.encode("utf-8", "backslashreplace").decode("utf-8")
    if close:
        headers["Connection"] = "close"
    if is_block_path(path):
        body: dict[str, Any] = {"error": err.name, "message": err.message}
    elif is_anthropic_path(path):
        body = anthropic_error(err)
    else:
        body = {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "server_error"),
                          "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=headers)


def bearer(request_headers: Any) -> str:
    auth = request_headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def body_length(request: Request, limit: int) -> int:
    """The announced ``Content-Length``, checked: present, a non-negative integer, within ``limit``."""
    raw = request.headers.get("content-length")
    if raw is None:
        raise HTTPError(411, "this endpoint needs a Content-Length header (chunked bodies are not accepted)",
                        code="length_required")
    if not raw.isdigit():  # rejects "", "-1", "1e3", " 12"
        raise HTTPError(400, f"Content-Length {raw[:32]!r} is not a non-negative integer",
                        code="bad_content_length")
    n = int(raw)
    if n > limit:
        raise HTTPError(413, f"request body of {n} bytes is over this server's {limit}-byte limit",
                        name="BundleRejected", code="body_too_large")
    return n


async def read_body(request: Request, limit: int, timeout: float, limits: Optional[Limits] = None) -> bytes:
    """The whole body (for JSON requests), counted as it streams and bounded in size and time: all of it
    within ``timeout``, and never more than ``limits.body_grace`` seconds behind ``limits.min_body_rate``
    (`Limits.body_lag`; a body trickled a few bytes a second used to hold its connection the whole
    ``timeout``). A client that leaves mid-body is a 499 (nobody reads the answer)."""
    rules = limits or Limits()
    n = body_length(request, limit)
    parts: list[bytes] = []
    got = 0
    start = anyio.current_time()
    chunks = request.stream().__aiter__()
    while True:
        now = anyio.current_time()
        # the next bytes are due when the body falls body_grace behind the rate, or at the total deadline
        due = min(start + timeout, start + rules.body_grace + got / max(1, rules.min_body_rate))
        with anyio.move_on_after(max(0.0, due - now)) as scope:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except ClientDisconnect:
                raise HTTPError(499, "the client went away while sending its body",
                                code="client_closed_request") from None
        if scope.cancelled_caught:
            waited = anyio.current_time() - start
            if waited >= timeout:
                raise HTTPError(408, f"the request body did not arrive within {timeout:.0f} s", code="timeout")
            raise HTTPError(408, f"the request body did not arrive at {rules.min_body_rate} bytes/s or faster: "
                                 f"{got} of {n} bytes after {waited:.0f} s", code="timeout")
        got += len(chunk)
        if got > n or got > limit:
            raise HTTPError(413, f"request body is longer than its Content-Length ({n})",
                            name="BundleRejected", code="body_too_large")
        parts.append(chunk)
    if got != n:
        raise HTTPError(400, f"request body ended after {got} of {n} bytes", code="truncated_body")
    return b"".join(parts)


class ApiKeyMiddleware:
    """Every request (but ``/health`` and the web page's static files, `PUBLIC_PATHS`) needs ``Authorization: Bearer <key>`` (or ``X-Api-Key``), compared in constant time
    (`graftmem.server.tenants.ApiKeys`); the key's tenant goes into the request's scope state, where the
    routes read it (`tenant_of`): the server derives who is asking, the request never says. The block
    push routes also accept their push token there, since a push sends that instead. The operator's
    ``metrics_key`` (``serve --metrics-key``) opens `OPERATOR_PATHS` only, with no tenant: the whole
    server's counters and totals, never a block nor a model."""

    def __init__(self, app: ASGIApp, api_key: "str | ApiKeys", push_token: Optional[str] = None,
                 metrics_key: Optional[str] = None) -> None:
        self.app, self.push_token, self.metrics_key = app, push_token, metrics_key
        self.keys = api_key if isinstance(api_key, ApiKeys) else ApiKeys.single(api_key)

    def _ok(self, scope: Scope) -> bool:
        if scope["path"] in PUBLIC_PATHS or scope["path"].startswith(PUBLIC_PREFIXES):  # a probe, a browser: no key
            return True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        for given in (bearer(headers), headers.get("x-api-key", "")):
            ok, tenant = self.keys.tenant(given)
            if ok:
                state = scope.setdefault("state", {})
                state[TENANT_STATE] = tenant
                return True
        if self.metrics_key and scope["path"] in OPERATOR_PATHS:
            given = bearer(headers) or headers.get("x-api-key", "")
            if given and hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                             self.metrics_key.encode("utf-8", "surrogatepass")):
                scope.setdefault("state", {})[TENANT_STATE] = None  # no tenant: the whole server's view
                return True
        if self.push_token and scope["path"] in ("/v1/push", "/v1/bundles"):
            given = bearer(headers)
            return bool(given) and hmac.compare_digest(given.encode(), self.push_token.encode())
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._ok(scope):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        sent = bearer(headers) or headers.get("x-api-key")  # a wrong key and no key are two different fixes
        err = HTTPError(401, "the API key sent is not one this server accepts: check the key (the one `graftmem "
                        "serve --api-key` or its --api-key-file names; $GRAFTMEM_API_KEY for the CLI)" if sent else
                        "this server needs an API key: send Authorization: Bearer <key> (or X-Api-Key: <key>; "
                        "$GRAFTMEM_API_KEY for the CLI and RemoteMemory)",
                        name="AccessDenied", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
        await error_response(scope["path"], err, close=True)(scope, receive, send)


Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler, home: Optional[str] = None) -> Handler:
    """``handler`` with every failure turned into the path's error shape (`as_http`: a graftmem error with
    its own status and type, anything else a 500 naming no local path; the details go to the log)."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:  # the boundary: nothing escapes as a traceback to the client
            err = as_http(exc, home)
            if not isinstance(exc, (HTTPError, GraftmemError)):
                log.exception("serve: %s %s failed", request.method, request.url.path)
            elif err.status >= 500:
                log.warning("serve: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
            return error_response(request.url.path, err, close=isinstance(exc, HTTPError) and err.status in (400, 408, 411, 413))

    return run


def json_depth(raw: bytes, limit: int = jsontext.MAX_DEPTH) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text, read without parsing (`graftmem.core.jsontext`,
    the one reading of it): 100,000 nested lists made the parser raise RecursionError, a 500."""
    return jsontext.json_depth(raw, limit=limit)


#: A ``\\uD800``..``\\uDFFF`` escape: the only way a lone surrogate gets into a parsed body.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(data: Any) -> Optional[str]:
    """The path (``input[0].call_id``) of the first string (or key) of ``data`` that UTF-8 cannot encode."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            fields = []
            for k, x in v.items():
                at = f"{path}.{k}" if path else k
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return at.encode("utf-8", "backslashreplace").decode("utf-8")
                fields.append((at, x))
            todo.extend(reversed(fields))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def json_object(raw: bytes, max_depth: int = 64) -> dict[str, Any]:
    """The body as a JSON object; anything else (not JSON, nested deeper than ``max_depth``, not an
    object, a string holding a lone surrogate) is a 400.

    Lone surrogates (``"\\ud800"``) are refused here, for every field of every route, naming the field:
    they are valid JSON but no text, and every place that writes one back out in UTF-8 failed with a 500
    (the 404 quoting an unknown ``previous_response_id``, a stored response's input item ids)."""
    if json_depth(raw, max_depth) > max_depth:
        raise HTTPError(400, f"the request body nests JSON deeper than {max_depth} levels", code="invalid_json")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise HTTPError(400, f"the request body is not JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(data)) is not None:
        raise HTTPError(400, f"{where} is not text UTF-8 can encode: it holds a lone surrogate (\\ud800 to "
                        "\\udfff without its pair); fix the text's decoding", param=where, code="invalid_value")
    return data



T = TypeVar("T")

#: Work on a body at least this large (parsing, rendering, tokenizing) runs in a worker thread, so the
#: event loop keeps answering other clients: an 8 MB prompt once held it 6.6 s.
OFF_LOOP_BYTES = 64 << 10


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``size`` (the bytes or characters it works on) is large."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(lambda: fn(*args))


async def read_json(request: Request, limits: Limits) -> dict[str, Any]:
    """A JSON request body as an object, within ``limits`` (`read_body`: size, time, rate; `json_object`:
    depth, lone surrogates; parsed off the event loop when large): the one reading of every JSON door."""
    raw = await read_body(request, limits.max_body_bytes, limits.body_timeout, limits)
    return await off_loop(len(raw), json_object, raw, limits.max_json_depth)


async def client_gone(request: Request) -> None:
    """Returns when the client of ``request`` has gone away (call after the body was read): what a
    non-streamed request waits on beside its answer, to cancel a decode nobody will read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
