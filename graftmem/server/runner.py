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

A request in flight held its slot whatever it did, so 100 sockets that trickled a body under its
Content-Length, or asked for a big answer and never read it, filled the cap and a normal client was
refused 20 times out of 20 for 40 s. Now the cap closes *stalled* requests as it closes idle
connections, those without progress for longest first: a body behind ``Limits.min_body_rate``
(`Limits.body_lag`), an answer whose writes are paused because the client does not read; it refuses a
newcomer only when every other connection makes progress. Whatever the cap, an answer nobody reads is aborted after
``Limits.write_timeout`` seconds without progress (a watchdog on uvicorn's flow control,
``pause_writing`` / ``resume_writing``), and `graftmem.server.http.read_body` answers 408 to a body that
falls ``Limits.body_grace`` seconds behind the rate. One client address holds at most
``Limits.max_connections_per_client`` connections (half the cap by default), its own idle or stalled
ones closed first, so one host never holds them all.
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
    """uvicorn's h11 protocol with deadlines, a write watchdog and connection caps (see the module doc).

    The settings are class attributes: `ServerThread` makes a subclass per server with its `Limits`."""

    header_timeout: float = 10.0
    max_connections: int = 1000
    max_per_client: int = 500
    write_timeout: float = 30.0
    limits: Limits = Limits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        now = self.loop.time()
        self._opened = now
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._write_timer: Optional[asyncio.TimerHandle] = None
        self._paused_at: Optional[float] = None  #: when the writes paused (the client stopped reading)
        self._unsent = 0  #: the send buffer at the watchdog's last look
        self._request_at, self._body_got = now, 0  #: when the request in flight began, its body bytes so far
        self._arm()
        live = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c._open()]
        host = self.client[0] if self.client else None
        mine = [c for c in live if host is not None and c.client is not None and c.client[0] == host]
        if not self._make_room(mine, self.max_per_client, f"client {host}") or \
                not self._make_room(live, self.max_connections, "the server"):
            transport.close()  # every other connection is busy: refuse this one, not theirs

    def _open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def _make_room(self, conns: list["GuardedH11Protocol"], cap: int, whose: str) -> bool:
        """Close the idle and stalled connections of ``conns`` (this one among them), those without
        progress for longest first, until at most ``cap`` stay open; False if that many cannot be closed
        (this newcomer is then refused)."""
        excess = sum(1 for c in conns if c._open()) - cap
        if excess <= 0:
            return True
        now = self.loop.time()
        since = {c: t for c in conns if c is not self and c._open() and (t := c._idle_since(now)) is not None}
        ranked = sorted(since, key=since.__getitem__)
        for c in ranked[:excess]:
            c._drop()
        if len(ranked) < excess:
            log.warning("serve: %d connections open for %s, none idle or stalled: a new one is refused",
                        cap, whose)
            return False
        return True

    def _idle_since(self, now: float) -> Optional[float]:
        """Since when this connection makes no progress, if it makes none (the cap may close it; the
        longest first): idle (no request in flight) since it opened or answered; stalled since its
        answer's writes paused (the client does not read) or since its body fell behind
        ``min_body_rate`` (`Limits.body_lag`). None: a request in flight that makes progress (an answer
        being computed or read, a body arriving in time). A newcomer still sending its first headers is
        idle since now: it goes after every connection that has waited longer."""
        if self.waiting:
            return self._opened
        if self._paused_at is not None:
            return self._paused_at
        cycle = self.cycle
        if cycle.more_body and not cycle.response_started and not self.flow.read_paused:  # paused: the server's wait
            lag = self.limits.body_lag(now - self._request_at, self._body_got)
            if lag > 0:
                return now - lag
        return None

    def _drop(self) -> None:
        """Close the connection; abort it (no flush) when the client left bytes unread, which a close
        would wait on forever."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

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
        if self.waiting and self._open():
            self._drop()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        had = len(cycle.body) if cycle is not None else 0
        super().data_received(data)  # the body's bytes are added to cycle.body (the app takes them later)
        if cycle is not None and self.cycle is cycle:
            self._body_got += len(cycle.body) - had

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers arrived (and the body bytes sent with them)
            self._request_at, self._body_got = self.loop.time(), len(self.cycle.body)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

    # ---- the write watchdog: a response nobody reads must not hold its connection (``write_timeout``)
    def pause_writing(self) -> None:
        super().pause_writing()
        self._paused_at = self.loop.time()
        self._watch(self.write_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._paused_at = None

    def _watch(self, delay: float) -> None:
        if self._write_timer is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(delay, self._check_writes)

    def _check_writes(self) -> None:
        """Abort a connection whose writes made no progress for ``write_timeout`` seconds: paused all that
        time, or (under the pause mark, e.g. the rest of a finished answer) its unsent bytes not fewer."""
        self._write_timer = None
        if self.transport.is_closing() and self.transport.get_write_buffer_size() == 0:
            return  # closed and flushed (or lost)
        now = self.loop.time()
        unsent = self.transport.get_write_buffer_size()
        if self._paused_at is not None:
            stuck_for = now - self._paused_at
        else:
            stuck_for = self.write_timeout if unsent and unsent >= self._unsent else 0.0
        if stuck_for >= self.write_timeout:
            log.info("serve: an answer's writes made no progress for %.0f s (its client does not read): "
                     "its connection is closed", self.write_timeout)
            self.transport.abort()
        elif unsent or self._paused_at is not None:
            self._watch(self.write_timeout - stuck_for)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.get_write_buffer_size():
            self._watch(self.write_timeout)  # the answer's last bytes still wait for the client
        if not self.transport.is_closing() and self.waiting:
            self._opened = self.loop.time()
            self._arm()  # the next request's headers are due within the deadline too

    def connection_lost(self, exc: Optional[Exception]) -> None:
        for name in ("_header_timer", "_write_timer"):
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)
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
        per_client = self.limits.max_connections_per_client or max(1, cap // 2)
        protocol: Any = type("Guarded", (GuardedH11Protocol,), {
            "header_timeout": self.limits.header_timeout, "max_connections": cap,
            "max_per_client": per_client, "write_timeout": self.limits.write_timeout, "limits": self.limits})
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

    def connection_counts(self) -> dict[str, int]:
        """How the open connections stand, a snapshot readable from any thread: ``open``, of which
        ``idle`` (no request in flight), ``stalled`` (a body behind its minimum rate, or an answer the
        client does not read: what the cap closes after the idle ones) and ``busy`` (the rest)."""
        counts = {"open": 0, "idle": 0, "stalled": 0, "busy": 0}
        for _ in range(100):  # the event loop's thread may change the set while it is copied
            try:
                conns = list(self._server.server_state.connections)
                break
            except RuntimeError:
                continue
        else:
            return counts
        for c in conns:
            if not isinstance(c, GuardedH11Protocol) or not c._open():
                continue
            counts["open"] += 1
            counts["idle" if c.waiting else "busy" if c._idle_since(c.loop.time()) is None else "stalled"] += 1
        return counts

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
