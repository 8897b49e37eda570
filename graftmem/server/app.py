"""The ASGI app: the routes of each API on one Starlette app, behind the optional API key.

Unknown paths and wrong methods answer in the error shape of the API they were aimed at
(`error_response()`), so an ``openai`` client gets an OpenAI error and a
``graftmem pull`` gets a graftmem one.

`Gate` is what a socket bound before the engines are loaded serves (`graftmem.server.service.bind`):
``/health`` answers ``503 {"status": "loading"}`` and every other path a 503 in its API's error shape,
until the app is ready and handed over.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from .http import ApiKeyMiddleware, HTTPError, Limits, RefusalDelay, error_response
from .fleet import WorkerHeader
from .metrics import HEALTH_PATH, Metrics, MetricsMiddleware
from .tenants import ApiKeys

__all__ = ["Gate", "build_app"]

#: Seconds a client is told to wait (``Retry-After``) while the server loads.
LOADING_RETRY_S = 1

#: What anyio imports on a server's first streamed response (~7 ms, measured with -X importtime),
#: imported with the app instead, so a restarted server's first request does not pay for it.
_FIRST_REQUEST_IMPORTS = ("anyio._backends._asyncio", "anyio._core._sockets", "anyio._core._streams",
                          "anyio.streams.memory")


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    msg = (f"no such endpoint {request.url.path[:200]!r}" if status == 404
           else f"{request.method} is not allowed on {request.url.path[:200]!r}" if status == 405
           else str(exc.detail))
    return error_response(request.url.path, HTTPError(status, msg, name="BlockNotFound" if status == 404
                                                      else "TransferError", code=f"http_{status}"))


def build_app(routes: list[BaseRoute], *, api_key: "str | ApiKeys | None" = None,
              push_token: Optional[str] = None, metrics: Optional[Metrics] = None,
              metrics_key: Optional[str] = None, limits: Optional[Limits] = None) -> Starlette:
    """One app over ``routes``; every request needs ``api_key`` (one key, or the tenants' keys) when one
    is given (``/health`` excepted; ``metrics_key`` opens ``/metrics`` and ``/v1/info``). With ``metrics``,
    its ``/health`` and ``/metrics`` are served and every request is counted, refused ones too (its
    middleware runs outside the key's). ``limits``: its ``refusal_delay`` holds refused answers
    (`RefusalDelay`, outermost: a wrong key's answer is held too)."""
    for name in _FIRST_REQUEST_IMPORTS:  # private names of anyio: a version without them changes nothing
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key, push_token=push_token,
                             metrics_key=metrics_key)] if api_key else []
    if metrics is not None:
        routes = routes + metrics.endpoints()
        metrics.routes = routes
        middleware.insert(0, Middleware(MetricsMiddleware, metrics=metrics))
    middleware.insert(0, Middleware(WorkerHeader))  # which worker answered, for a fleet behind a gateway
    lim = limits or Limits()
    if lim.refusal_delay > 0:
        middleware.insert(0, Middleware(RefusalDelay, factor=lim.refusal_delay, cap=lim.refusal_delay_max))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_exception})


class Gate:
    """An ASGI app that answers 503 until `open()` hands it the app to serve.

    Why: loading a model and warming its engines takes seconds to minutes, and an orchestrator
    (Kubernetes, a load balancer, a supervisor script) probes ``/health`` from the moment the process
    starts. A socket that is not bound yet refuses the probe's connection, which reads as "dead", not
    "loading". Bound first and gated, the server says what it is doing: ``/health`` answers
    ``503 {"status": "loading"}`` (public, like the ready server's), every other path a 503 in its API's
    error shape with ``Retry-After`` (the ``openai`` and ``anthropic`` packages retry on it), and no
    request reaches a route before the engines are loaded. Nothing is counted in ``/metrics`` meanwhile.
    """

    def __init__(self) -> None:
        self.app: Optional[ASGIApp] = None

    def open(self, app: ASGIApp) -> None:
        """Serve ``app`` from now on (the engines are loaded and warmed)."""
        self.app = app

    @property
    def loading(self) -> bool:
        return self.app is None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":  # uvicorn runs without lifespan events; nothing else to answer
            return
        retry = {"Retry-After": str(LOADING_RETRY_S)}
        response: Response
        if scope["path"] == HEALTH_PATH:
            response = JSONResponse({"status": "loading"}, status_code=503, headers=retry)
        else:
            response = error_response(scope["path"], HTTPError(
                503, "the server is loading its model: retry in a moment (GET /health answers 200 once it "
                "serves)", name="TransferError", code="loading", headers=retry))
        await response(scope, receive, send)
