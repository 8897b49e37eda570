"""The ASGI app: the routes of each API on one Starlette app, behind the optional API key.

Unknown paths and wrong methods answer in the error shape of the API they were aimed at
(`error_response()`), so an ``openai`` client gets an OpenAI error and a
``graftmem pull`` gets a graftmem one.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from .http import ApiKeyMiddleware, HTTPError, error_response
from .metrics import Metrics, MetricsMiddleware
from .tenants import ApiKeys

__all__ = ["build_app"]

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
              push_token: Optional[str] = None, metrics: Optional[Metrics] = None) -> Starlette:
    """One app over ``routes``; every request needs ``api_key`` (one key, or the tenants' keys) when one
    is given (``/health`` excepted). With ``metrics``, its ``/health`` and ``/metrics`` are served and
    every request is counted, refused ones too (its middleware runs outside the key's)."""
    for name in _FIRST_REQUEST_IMPORTS:  # private names of anyio: a version without them changes nothing
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key, push_token=push_token)] if api_key else []
    if metrics is not None:
        routes = routes + metrics.endpoints()
        metrics.routes = routes
        middleware.insert(0, Middleware(MetricsMiddleware, metrics=metrics))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_exception})
