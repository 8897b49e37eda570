"""Sharing a store over HTTP: the block routes of the graftmem server, and `BlockServer`.

Routes (Starlette, served by uvicorn; bound to 127.0.0.1 unless told otherwise)::

    GET  /v1/info                     version, block count and bytes (with tenants: what the key sees),
                                      whether pushes are accepted
    GET  /v1/blocks[?kind=K]          listing: a BundleManifest (ids, sizes, digests, fingerprints),
                                      signed in the X-Graftmem-Signature header when a key is given
    GET  /v1/blocks/<id>/manifest     one block's manifest (text, tokens, fingerprint)
    GET  /v1/blocks/<id>              the block file; Range (one range) and If-Range are honoured,
                                      the ETag is the block file's trailer digest
    POST /v1/push                     auth check only (Authorization: Bearer <token>): 204 or 401/403
    POST /v1/bundles                  a pushed bundle (needs the token); imported all or nothing

The server never trusts what it serves to be checked by itself: clients verify every byte as it
arrives (`BlockChecker`) against the digests the listing announced, and
only move blocks into their store once every selected block has arrived and checked. An interrupted
download leaves its bytes in ``<home>/.incoming`` and the next pull resumes it with a Range request
(the bytes already there are re-hashed first, so a resumed file is checked end to end).

Pushes are off unless a token is set, the token is compared in constant time, and a pushed bundle
goes through the same import as a file: digests, strict member checks, the server's engine
fingerprint (required to enable pushes) and its trust policy. The bundle streams from the socket into
the import (counted against its Content-Length and the size limit, within the body deadline); it is
never buffered whole.

A block whose file disappeared (deleted by another process after the index said it exists) is a 404
for that block, and the listing leaves it out with a log line, rather than failing the whole listing.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from typing import TYPE_CHECKING, AsyncIterator, BinaryIO, Callable, Optional

import anyio
import anyio.from_thread
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..core.blocks import Block, Fingerprint
from ..core.errors import ConfigError, GraftmemError, StoreError
from ..core.version import __version__
from ..share.admission import DEFAULT_MAX_ENTRY_BYTES, BlockCheck
from ..share.bundle import import_stream
from ..share.client import LISTING_DOMAIN, SIGNATURE_HEADER
from ..share.manifest import BundleManifest, entry_for
from ..share.trust import SigningKey, TrustPolicy
from ..store.local import Store
from ..store.protocol import BlockStore
from .http import HTTPError, Limits, body_length, guarded, public_message
from .metrics import Metrics
from ..memory.access import Access
from .tenants import ApiKeys, check_metrics_key, tenant_of

if TYPE_CHECKING:
    from .runner import ServerThread

__all__ = ["BlockRoutes", "BlockServer"]

log = logging.getLogger("graftmem")

_ID = re.compile(r"([0-9a-f]{64})(/manifest)?")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CHUNK = 1 << 20


class BlockRoutes:
    """The block-sharing routes over one store. Subclass `listing_body()` or `file_chunks()` to
    test clients against a misbehaving server (a cut connection, a hostile listing)."""

    def __init__(self, store: BlockStore, *, push_token: Optional[str] = None,
                 fingerprint: Optional[Fingerprint] = None, policy: Optional[TrustPolicy] = None,
                 sign_key: Optional[SigningKey] = None, max_push_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 check: Optional[BlockCheck] = None, limits: Optional[Limits] = None) -> None:
        if push_token is not None and fingerprint is None:
            raise ConfigError("accepting pushes needs the engine fingerprint of this store "
                              "(Memory.serve passes it; the CLI loads the model)")
        if push_token is not None and len(push_token) < 8:
            raise ConfigError("the push token is too short: use at least 8 characters")
        self.store = store
        self.push_token = push_token
        self.fingerprint = fingerprint
        self.policy = policy if policy is not None else TrustPolicy.load(store.home)
        self.sign_key = sign_key
        self.max_push_bytes = max_push_bytes
        self.check = check
        self.limits = limits or Limits()
        self.home = str(store.home)

    def routes(self) -> list[BaseRoute]:
        g = lambda h: guarded(h, self.home)  # noqa: E731
        return [Route("/v1/info", g(self.info), methods=["GET"]),
                Route("/v1/blocks", g(self.blocks), methods=["GET"]),
                Route("/v1/blocks/{rest:path}", g(self.block), methods=["GET"]),
                Route("/v1/push", g(self.push_probe), methods=["POST"]),
                Route("/v1/bundles", g(self.push_bundle), methods=["POST"])]

    # ------------------------------------------------------------------ hooks
    def listing_body(self, blocks: list[Block]) -> bytes:
        """The listing's JSON: a block whose file is gone is left out (and logged), not an error."""
        entries, shown = [], []
        for b in blocks:
            try:
                entries.append(entry_for(self.store, b))
                shown.append(b)
            except StoreError:
                log.warning("serve: block %s is indexed but its file is missing; left out of the listing "
                            "(run `graftmem doctor`)", b.short_id)
        man = BundleManifest(graftmem_version=__version__,
                             fingerprints={b.fingerprint.digest(): b.fingerprint for b in shown},
                             blocks=entries)
        return man.model_dump_json().encode()

    async def file_chunks(self, request: Request, f: BinaryIO, start: int, count: int) -> AsyncIterator[bytes]:
        """The ``count`` bytes of ``f`` from ``start``: the only place block bytes leave the server."""
        f.seek(start)
        left = count
        while left > 0:
            chunk = await anyio.to_thread.run_sync(f.read, min(_CHUNK, left))
            if not chunk:
                raise OSError(f"block file ended {left} bytes early")
            left -= len(chunk)
            yield chunk

    # ------------------------------------------------------------------ GET
    async def info(self, request: Request) -> Response:
        """Version, blocks and bytes: the store's (no tenants, the operator's key); with tenants, the blocks
        this key sees and their state bytes (the store's totals moved with every other tenant's learning)."""
        tenant = tenant_of(request.scope)
        if tenant is None:
            st = self.store.stats()
            blocks, size = st.blocks, st.bytes_on_disk
        else:
            seen = await anyio.to_thread.run_sync(Access(self.store, tenant).list)
            blocks, size = len(seen), sum(b.state_size for b in seen)
        return JSONResponse({"graftmem": __version__, "api": 1, "blocks": blocks, "bytes": size,
                             "push": self.push_token is not None, "signed": self.sign_key is not None})

    async def blocks(self, request: Request) -> Response:
        kind = request.query_params.get("kind") or None
        access = Access(self.store, tenant_of(request.scope))  # another tenant's blocks are never listed
        body = await anyio.to_thread.run_sync(lambda: self.listing_body(access.list(kind)))
        headers = {}
        if self.sign_key is not None:
            headers[SIGNATURE_HEADER] = self.sign_key.sign(LISTING_DOMAIN, body).to_header()
        return Response(body, media_type="application/json", headers=headers)

    async def block(self, request: Request) -> Response:
        m = _ID.fullmatch(request.path_params["rest"])
        if m is None or not self.store.contains(m.group(1)) or not Access(
                self.store, tenant_of(request.scope)).sees(self.store.get(m.group(1))):
            # another tenant's automatic block answers exactly as a missing one: its existence is not told
            raise HTTPError(404, f"no block {request.path_params['rest'][:64]!r} on this server",
                            name="BlockNotFound")
        bid = m.group(1)
        if m.group(2):
            return Response(self.store.get(bid).model_dump_json(), media_type="application/json")
        try:
            f = open(self.store.path_of(bid), "rb")
        except FileNotFoundError:
            log.warning("serve: block %s is indexed but its file is missing (deleted?)", bid[:12])
            raise HTTPError(404, f"block {bid[:12]} was just deleted", name="BlockNotFound") from None
        try:
            return self._file_response(request, bid, f)
        except BaseException:
            f.close()
            raise

    def _file_response(self, request: Request, bid: str, f: BinaryIO) -> Response:
        entry = entry_for(self.store, self.store.get(bid))
        etag = f'"{entry.etag}"'
        size = os.fstat(f.fileno()).st_size
        start, end, status = 0, size - 1, 200
        rng, if_range = request.headers.get("range"), request.headers.get("if-range")
        unsatisfiable = Response(b"", status_code=416, headers={"Content-Range": f"bytes */{size}"})
        if rng and (if_range is None or if_range == etag):
            m = _RANGE.fullmatch(rng.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                f.close()
                return unsatisfiable
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:  # suffix range: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= size or start > end:
                f.close()
                return unsatisfiable
            status = 206
        headers = {"Content-Length": str(end - start + 1), "Accept-Ranges": "bytes", "ETag": etag}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if request.method == "HEAD":
            f.close()
            return Response(b"", status_code=status, headers=headers, media_type="application/octet-stream")

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in self.file_chunks(request, f, start, end - start + 1):
                    yield chunk
            finally:
                f.close()

        return StreamingResponse(body(), status_code=status, headers=headers,
                                 media_type="application/octet-stream")

    # ------------------------------------------------------------------ POST (push)
    def _authorize(self, request: Request) -> None:
        if self.push_token is None:
            raise HTTPError(403, "this server does not accept pushes (start it with a push token)",
                            name="AccessDenied")
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), self.push_token.encode()):
            raise HTTPError(401, "push refused: " + ("wrong token" if given else "no token")
                            + "; pass the server's push token", name="AccessDenied")

    async def push_probe(self, request: Request) -> Response:
        self._authorize(request)
        return Response(status_code=204)

    async def push_bundle(self, request: Request) -> Response:
        self._authorize(request)
        length = body_length(request, self.max_push_bytes)
        body = _StreamBody(request, length, self.limits)
        who = request.client.host if request.client else "?"
        try:
            report = await anyio.to_thread.run_sync(lambda: import_stream(
                self.store, body, where=f"push from {who}", fingerprint=self.fingerprint,  # type: ignore[arg-type]
                policy=self.policy, incompatible="refuse", max_entry_bytes=self.max_push_bytes,
                check=self.check))
        except HTTPError:
            raise
        except GraftmemError as exc:
            log.warning("refused a push from %s: %s", who, exc)
            if body.error is not None:
                raise body.error from exc
            raise HTTPError(422, public_message(str(exc), self.home), name=type(exc).__name__) from exc
        return Response(report.model_dump_json(), media_type="application/json")


class _StreamBody:
    """A request body as a blocking file for a worker thread: at most ``n`` bytes, pulled from the event
    loop chunk by chunk, counted as they arrive, within ``limits.body_timeout`` and never
    ``limits.body_grace`` seconds behind ``limits.min_body_rate`` (the rule of `read_body`; the rate counts
    only the time spent waiting for bytes, not the worker's own time between reads, a re-derivation's)."""

    def __init__(self, request: Request, n: int, limits: Limits) -> None:
        self._it = request.stream().__aiter__()
        self.left, self.limits = n, limits
        self.deadline = time.monotonic() + limits.body_timeout
        self.got, self.waited = 0, 0.0
        self._buf = b""
        self._eof = False
        self.error: Optional[HTTPError] = None

    async def _next(self) -> bytes:
        rules = self.limits
        t0 = time.monotonic()
        behind = -rules.body_lag(self.waited, self.got)  # seconds of wait left before the body is behind
        due = min(self.deadline, t0 + rules.body_grace + behind)
        try:
            with anyio.fail_after(max(0.0, due - t0)):
                try:
                    return await self._it.__anext__()
                except StopAsyncIteration:
                    return b""
        finally:
            self.waited += time.monotonic() - t0

    def _fill(self) -> None:
        while not self._buf and not self._eof:
            try:
                chunk = anyio.from_thread.run(self._next)
            except TimeoutError:
                self.error = HTTPError(408, f"the pushed bundle did not arrive in time ({self.limits.body_timeout:.0f} s "
                                            f"in all, {self.limits.min_body_rate} bytes/s at least)", code="timeout")
                raise self.error from None
            if not chunk:
                self._eof = True
            elif len(chunk) > self.left:
                self.error = HTTPError(413, "the pushed body is longer than its Content-Length",
                                       name="BundleRejected", code="body_too_large")
                raise self.error
            else:
                self.left -= len(chunk)
                self.got += len(chunk)
                self._buf = chunk

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            self._fill()
            if not self._buf:
                break
            take = len(self._buf) if n < 0 else min(n - len(out), len(self._buf))
            out += self._buf[:take]
            self._buf = self._buf[take:]
        return bytes(out)

    def readinto(self, view: memoryview) -> int:
        self._fill()
        take = min(len(view), len(self._buf))
        view[:take] = self._buf[:take]
        self._buf = self._buf[take:]
        return take


class BlockServer:
    """Serve a store over HTTP (read-only unless ``push_token`` is set).

    ``fingerprint`` is required to accept pushes: a pushed block must match the engine that will
    graft it here. ``sign_key`` signs every listing so clients that require signatures can pull.
    ``check(block, staged_path)`` runs on every new pushed block before it is moved in
    (``Memory.serve(rederive=True)`` re-derives each one). ``api_key`` guards every route.
    Use as a context manager, or `start()` (background thread) / `serve_forever()`.
    ``extra`` adds routes (the OpenAI-compatible ones of `OpenAIRoutes`, ...); ``metrics`` adds
    ``/health`` and ``/metrics`` (`graftmem.server.metrics`); ``metrics_key`` (the operator's) opens
    ``/metrics`` and ``/v1/info`` only, with the whole server's view. ``runner``: a socket bound earlier
    (`graftmem.server.service.bind`), serving its loading gate until this server starts on it
    (``host`` and ``port`` are then the runner's).
    """

    def __init__(self, store: BlockStore | str | os.PathLike[str], *, host: str = "127.0.0.1",
                 port: int = 0, push_token: Optional[str] = None,
                 fingerprint: Optional[Fingerprint] = None, policy: Optional[TrustPolicy] = None,
                 sign_key: Optional[SigningKey] = None, max_push_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 check: Optional[BlockCheck] = None, api_key: "str | ApiKeys | None" = None,
                 limits: Optional[Limits] = None, routes: type[BlockRoutes] = BlockRoutes,
                 extra: Optional[list[BaseRoute]] = None, metrics: Optional[Metrics] = None,
                 runner: "Optional[ServerThread]" = None, metrics_key: Optional[str] = None) -> None:
        from .app import Gate, build_app
        from .runner import ServerThread

        if isinstance(api_key, str) and len(api_key) < 8:
            raise ConfigError("the API key is too short: use at least 8 characters")
        check_metrics_key(api_key, metrics_key)
        self.store: BlockStore
        if isinstance(store, (str, os.PathLike)):  # a path: opened here (a FleetStore is a store too)
            self._owns_store, self.store = True, Store(store)
        else:
            self._owns_store, self.store = False, store
        #: called by `close()` after the socket stopped (the API server drops the cells it kept in RAM)
        self.on_close: list[Callable[[], None]] = []
        try:
            self.routes = routes(self.store, push_token=push_token, fingerprint=fingerprint, policy=policy,
                                 sign_key=sign_key, max_push_bytes=max_push_bytes, check=check, limits=limits)
            self.app = build_app(self.routes.routes() + list(extra or []), api_key=api_key,
                                 push_token=push_token, metrics=metrics, metrics_key=metrics_key, limits=limits)
            if runner is not None and not (isinstance(runner.app, Gate) and runner.app.loading):
                raise ConfigError("a runner given to a server must be one bound by bind() and not opened yet")
            self._server = runner if runner is not None else ServerThread(self.app, host=host, port=port,
                                                                          limits=limits)
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise

    push_token = property(lambda self: self.routes.push_token)
    fingerprint = property(lambda self: self.routes.fingerprint)
    sign_key = property(lambda self: self.routes.sign_key)

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def runner(self) -> "ServerThread":
        """The `ServerThread` that serves it (its connections: `ServerThread.connection_counts`)."""
        return self._server

    def start(self) -> "BlockServer":
        self._server.start()
        self._open()
        log.info("serving %s at %s", self.store.home, self.url)
        return self

    def serve_forever(self) -> None:
        self._open()
        self._server.serve_forever()

    def _open(self) -> None:
        """On a runner bound earlier: requests reach this server's routes from now on."""
        from .app import Gate

        if isinstance(self._server.app, Gate):
            self._server.app.open(self.app)

    def close(self) -> None:
        self._server.close()
        for fn in self.on_close:
            fn()
        self.on_close.clear()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "BlockServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
