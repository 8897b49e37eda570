"""One ASGI app served by uvicorn, in a background thread or in the foreground.

The socket is bound here, before uvicorn starts, so that port 0 resolves to a real port at once
(`url` is known when the constructor returns), a busy port is a
`ConfigError` raised to the caller rather than a log line in a thread, and
the default host is the loopback interface. `close()` shuts down gracefully: no new connections,
running requests get ``Limits.graceful_shutdown`` seconds to finish.

No client can hold the server by its connections (`GuardedH11Protocol`): uvicorn's h11 protocol
bounds only the keep-alive wait after a response, so a socket that never sends its headers, or sends
them a byte at a time, stayed open forever, and 420 of them exhausted a 400-descriptor limit (nobody
was served). Here a connection must send a request's headers within ``Limits.header_timeout``, and
past ``Limits.max_connections`` open connections the oldest ones without a request in flight are
closed to make room for the newcomer.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
from typing import Any, Optional

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.errors import ConfigError
from .http import Limits

__all__ = ["ServerThread", "GuardedH11Protocol", "default_max_connections"]

log = logging.getLogger("graftmem")


def default_max_connections() -> int:
    """A quarter of the process's file-descriptor limit, between 16 and 1,000. The listen backlog is the
    same number, and asyncio accepts up to a backlog of connections at once before any of them is seen
    (and the oldest idle ones closed), so open + just accepted stay under half the limit; the rest is
    the store's, the engines', the threads'."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1000
    return max(16, min(1000, soft // 4))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (see the module doc).

    ``header_timeout`` and ``max_connections`` are class attributes: `ServerThread` makes a subclass
    per server with its `Limits`."""

    header_timeout: float = 10.0
    max_connections: int = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._arm()
        live = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
        excess = len(live) - self.max_connections
        if excess > 0:  # closed ones stay in the set until their connection_lost: not counted
            idle = sorted((c for c in live if c is not self and isinstance(c, GuardedH11Protocol) and c.waiting),
                          key=lambda c: c._opened)
            for c in idle[:excess]:
                c.transport.close()
            if len(idle) < excess:  # every other connection is busy: refuse this one, not theirs
                log.warning("serve: %d connections open, all busy: a new one is refused", len(live))
                transport.close()

    @property
    def waiting(self) -> bool:
        """No request in flight: idle, or still sending its headers."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_expired)

    def _header_expired(self) -> None:
        self._header_timer = None
        if self.waiting and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self._header_timer is not None:  # a request's headers arrived
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.waiting:
            self._opened = self.loop.time()
            self._arm()  # the next request's headers are due within the deadline too

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()  # type: ignore[union-attr]
            self._header_timer = None
        super().connection_lost(exc)


class ServerThread:
    """Serve ``app`` on ``host:port`` (127.0.0.1 and a free port by default).

    `start()` runs it in a daemon thread (and waits until it accepts connections);
    `serve_forever()` runs it in the calling thread until Ctrl-C / SIGTERM; `close()` stops
    either. Also a context manager (start on enter, close on exit).
    """

    def __init__(self, app: ASGIApp, *, host: str = "127.0.0.1", port: int = 0,
                 limits: Optional[Limits] = None) -> None:
        self.limits = limits or Limits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family in (socket.AF_INET, socket.AF_INET6):
                # accepted connections inherit it (Linux): a response's headers and body go out at once.
                # Without it, on a kept-alive connection the body waited for the client's delayed ACK of
                # the headers: measured 44 ms per JSON request for 1 ms of work
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((host, port))
            sock.listen(self.limits.max_connections or default_max_connections())
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another "
                              "port (0 picks a free one)") from exc
        self._sock = sock
        bound_host, bound_port = sock.getsockname()[:2]
        self._url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
        cap = self.limits.max_connections or default_max_connections()
        protocol: Any = type("Guarded", (GuardedH11Protocol,), {
            "header_timeout": self.limits.header_timeout, "max_connections": cap})
        self._config = uvicorn.Config(
            app, http=protocol, lifespan="off", log_config=None, access_log=False, server_header=False,
            timeout_keep_alive=max(1, int(self.limits.keep_alive)),
            # requests in flight beyond the cap get uvicorn's 503 (each one holds a task and a socket)
            limit_concurrency=cap + 1, backlog=cap,
            timeout_graceful_shutdown=max(1, int(self.limits.graceful_shutdown)))
        self.app = app  #: what it serves (a `graftmem.server.app.Gate` until the server built on it opens it)
        self._server = uvicorn.Server(self._config)
        self._thread: Optional[threading.Thread] = None
        self._foreground = False  #: `serve_forever()` runs it in some thread: `start()` has nothing to do
        self._closed = False

    @property
    def url(self) -> str:
        """``http://host:port``, known from construction on (and still readable after `close()`)."""
        return self._url

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except Exception:  # a crash of the serving thread is logged, never silent
            log.exception("serve: the server at %s stopped on an error", self.url)

    def start(self) -> "ServerThread":
        if self._thread is not None or self._foreground:
            return self
        # uvicorn installs signal handlers only from the main thread; this one is not
        self._thread = threading.Thread(target=self._run, name="graftmem-serve", daemon=True)
        self._thread.start()
        for _ in range(1000):  # up to 10 s for uvicorn to start accepting
            if self._server.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self._server.started:
            raise ConfigError(f"the server at {self.url} did not start (see the log)")
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl-C / SIGTERM (uvicorn's handlers: a graceful shutdown) or `close()`
        from another thread."""
        self._foreground = True
        self._server.run(sockets=[self._sock])

    def stop(self) -> None:
        """Ask the server to stop (from any thread): `serve_forever()` returns once it has shut down."""
        self._server.should_exit = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.limits.graceful_shutdown + 5)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
