"""One ASGI app served by uvicorn, in a background thread or in the foreground.

The socket is bound here, before uvicorn starts, so that port 0 resolves to a real port at once
(`url` is known when the constructor returns), a busy port is a
`ConfigError` raised to the caller rather than a log line in a thread, and
the default host is the loopback interface. uvicorn's own timeouts bound idle keep-alive connections,
and `close()` shuts down gracefully: no new connections, running requests get
``Limits.graceful_shutdown`` seconds to finish.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Optional

import uvicorn
from starlette.types import ASGIApp

from ..core.errors import ConfigError
from .http import Limits

__all__ = ["ServerThread"]

log = logging.getLogger("graftmem")


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
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another "
                              "port (0 picks a free one)") from exc
        self._sock = sock
        bound_host, bound_port = sock.getsockname()[:2]
        self._url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
        self._config = uvicorn.Config(
            app, http="h11", lifespan="off", log_config=None, access_log=False, server_header=False,
            timeout_keep_alive=max(1, int(self.limits.keep_alive)),
            timeout_graceful_shutdown=max(1, int(self.limits.graceful_shutdown)))
        self._server = uvicorn.Server(self._config)
        self._thread: Optional[threading.Thread] = None
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
        if self._thread is not None:
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
        """Serve in this thread until Ctrl-C / SIGTERM (uvicorn's handlers: a graceful shutdown)."""
        self._server.run(sockets=[self._sock])

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
