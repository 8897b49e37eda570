"""No client can hold the server (issue 24, red team): idle and slow-header sockets, a request whose
client left, an 8 MB body. Every loop here is bounded in count and time, everything is on 127.0.0.1 and
on ports these tests opened. No timing asserts: "not held" is shown by an answer that comes while the
attack is still under way (a client timeout shorter than the trickle; the big body's work held in its
worker thread until the other answer came)."""

from __future__ import annotations

import json
import logging
import re
import resource
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from graftmem import Memory
from graftmem.server import api_server
from graftmem.store.local import Store

from .served import serve_process

ROOT = Path(__file__).resolve().parents[1]


def _limit_fds() -> None:  # in the server's child process: the limit the red team's server had
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@pytest.fixture
def blocks_server(tmp_path):
    """``graftmem serve --blocks-only`` (no model: only the HTTP layer) in a process with 256 fds."""
    with serve_process("--blocks-only", home=tmp_path / "home", preexec_fn=_limit_fds) as (_, url):
        yield url


def test_idle_and_slow_header_sockets_do_not_stop_a_normal_client(blocks_server):
    url = blocks_server
    host, port = url[len("http://"):].split(":")
    assert httpx.get(url + "/v1/info", timeout=10).status_code == 200
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(400)]
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(30)]
    stop = threading.Event()

    def trickle() -> None:  # one header byte per socket every 50 ms, for at most 10 s
        head = b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        for i in range(200):
            if stop.is_set():
                return
            for s in slow:
                try:
                    s.send(head[i:i + 1])
                except OSError:
                    pass
            stop.wait(0.05)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        stop.wait(0.3)  # the trickle is under way (not an ordering sleep: the attack lasts as long as it wants)
        # the client gives up after 5 s, the trickle lasts 10 s: an answer at all is an answer during the attack
        r = httpx.get(url + "/v1/info", timeout=5)
        assert r.status_code == 200
    finally:
        stop.set()
        t.join(timeout=10)
        for s in idle + slow:
            s.close()


@pytest.fixture
def served(smol, tmp_path):
    with Memory(engine=smol, home=tmp_path / "home") as m:
        block = m.learn("Refunds: the refund code is 4417; ask for the order number first.", chat=True,
                        name="refunds")
        with api_server(m.store, [smol], learn=False) as srv:
            yield srv, block


def _post_and_leave(url: str, path: str, body: dict, srv) -> None:
    """Send a request on a raw socket, wait (bounded) until an engine is busy with it, then go away."""
    host, port = url[len("http://"):].split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    deadline = time.monotonic() + 60
    while srv.pool.in_use == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.pool.in_use == 1
    s.close()


def _freed(srv) -> bool:
    deadline = time.monotonic() + 60
    while srv.pool.in_use and time.monotonic() < deadline:
        time.sleep(0.02)
    return srv.pool.in_use == 0


@pytest.mark.parametrize("door", ["chat", "rest-ask"])
def test_an_abandoned_non_streamed_request_frees_its_engine(served, door, caplog):
    srv, block = served
    caplog.set_level(logging.INFO, logger="graftmem")
    n = 4000  # far more than the client will wait for
    if door == "chat":
        _post_and_leave(srv.url, "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "Tell a long story."}],
                         "max_tokens": n, "temperature": 0}, srv)
    else:
        _post_and_leave(srv.url, "/v1/memory/ask", {"id": block.id, "question": "Tell a long story.",
                                                    "max_tokens": n}, srv)
    assert _freed(srv), "the abandoned request kept its engine"
    cancelled = [r.getMessage() for r in caplog.records if "cancelled (its client went away)" in r.getMessage()]
    assert cancelled, [r.getMessage() for r in caplog.records]
    decoded = int(re.search(r"after (\d+) token", cancelled[-1]).group(1))  # type: ignore[union-attr]
    assert decoded < n
    # the engine serves the next client at once
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=120)
    assert r.status_code == 200


def test_max_tokens_is_bounded_on_every_door(served):
    srv, block = served
    n_ctx = srv.pool.engines[0].n_ctx
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"model": "m", "prompt": "Hi"}),
                       ("/v1/memory/ask", {"id": block.id, "question": "Hi"}),
                       ("/v1/memory/recall", {"task": "Hi"})):
        r = httpx.post(srv.url + path, json={**body, "max_tokens": 10 ** 9}, timeout=60)
        assert r.status_code == 400 and "max_tokens" in r.text and str(n_ctx) in r.text, (path, r.text)


class _Held:
    """Wraps a function the server runs on a big body: the first call with a big enough argument says it
    has started, then waits (bounded) until the test lets it go, so the test can ask the server something
    else while that work is provably still running."""

    def __init__(self, fn, min_size: int) -> None:
        self.fn, self.min_size = fn, min_size
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, big, *args, **kwargs):
        if len(big) >= self.min_size and not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)  # bounded: a server that ran this on its loop is stuck until then
        return self.fn(big, *args, **kwargs)


@pytest.mark.parametrize("chars", [8_000_000, 4_000_000])
def test_an_8mb_body_does_not_stall_the_event_loop(served, chars, monkeypatch):
    """8 MB: parsed off the loop, refused by the text length check; 4 MB: also tokenized off the loop and
    refused on its token count before it is cut into segments. The parse (8 MB) or the tokenization (4 MB)
    is held until /v1/models has answered: on the event loop, that answer could not come (fails so with
    ``OFF_LOOP_BYTES`` raised above the body's size)."""
    from graftmem.server import http as json_door

    srv, _ = served
    if chars == 8_000_000:
        held = _Held(json_door.json_object, 1 << 20)
        monkeypatch.setattr(json_door, "json_object", held)
    else:
        engine = srv.pool.engines[0]
        held = _Held(engine.tokenize, 1 << 20)
        monkeypatch.setattr(engine, "tokenize", held)
    host, port = srv.url[len("http://"):].split(":")
    prompt = ("word " * 1_600_000)[:chars]  # an 8 MB body is under the 8 MiB body limit
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        c.get("/v1/models")  # connection open and warm
        s = socket.create_connection((host, int(port)), timeout=60)
        try:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            assert held.entered.wait(60), "the server never started on the big body"
            try:
                assert c.get("/v1/models").status_code == 200  # while the big body's work is held
            finally:
                held.release.set()
            answer = b""
            while not (b"\r\n\r\n" in answer and answer.endswith(b"}")):  # bounded by the socket's 60 s
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
        finally:
            s.close()
    assert answer.startswith(b"HTTP/1.1 400") and b'"param":"prompt"' in answer, answer[:300]


# ---------------------------------------------------------------- slow clients and the connection cap (issue 37)
def _host_port(url: str) -> tuple[str, int]:
    host, port = url[len("http://"):].split(":")
    return host, int(port)


def _slow_body(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A chat request whose body stops after a few of its announced bytes (the socket is held open)."""
    s = socket.create_connection(_host_port(url), timeout=10, source_address=(source, 0))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 5000\r\n\r\n{\"model\"")
    return s


def _slow_reader(url: str, path: str, source: str = "127.0.0.1") -> socket.socket:
    """A request for a big answer on a socket with a tiny receive window that never reads it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it announces
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(_host_port(url))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Wait (bounded) until ``cond()`` holds: a condition, never a duration, orders the test."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


#: a text whose block is about 5 MB of state (SmolLM2: 23 kB per token): an answer no socket buffer holds
_BIG = " ".join(f"Rule {i}: refunds over {i * 7} dollars need the order number and a manager." for i in range(12))


@pytest.fixture
def capped(smol, tmp_path):
    """A server capped at 8 connections (one client address may hold all 8) with a 5 MB block to download."""
    from graftmem.server import Limits

    with Memory(engine=smol, home=tmp_path / "home") as m:
        block = m.learn(_BIG, name="big")
        limits = Limits(max_connections=8, max_connections_per_client=8)
        with api_server(m.store, [smol], learn=False, limits=limits) as srv:
            yield srv, block


def test_slow_bodies_and_slow_readers_do_not_hold_the_connection_cap(capped):
    """4 bodies trickled (stopped) under their Content-Length and 4 answers nobody reads fill the 8
    connections with requests in flight; a normal client still gets its answer: the cap closes a stalled
    one for it (it used to refuse the newcomer while every connection had a request in flight, 20/20
    for 40 s). Fails so with `GuardedH11Protocol._idle_since` reduced to idle connections."""
    srv, block = capped
    runner = srv.runner
    socks: list[socket.socket] = []
    try:
        socks += [_slow_body(srv.url) for _ in range(4)]
        socks += [_slow_reader(srv.url, f"/v1/blocks/{block.id}") for _ in range(4)]
        # every one has its request in flight and has stalled: a body behind the minimum rate, an answer
        # whose writes are paused because the client does not read
        _until(lambda: runner.connection_counts()["stalled"] == 8, f"not all stalled: {runner.connection_counts()}")
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        assert r.status_code == 200
        assert runner.connection_counts()["stalled"] <= 7  # one of them made room
    finally:
        for s in socks:
            s.close()


def test_an_answer_nobody_reads_is_aborted_after_the_write_timeout(smol, tmp_path, caplog):
    """No cap pressure: a client that stops reading loses its connection after ``write_timeout`` (there
    was no such timeout: the connection stayed, its request in flight, forever). Fails so with the
    watchdog's abort removed (`GuardedH11Protocol._check_writes`)."""
    from graftmem.server import Limits

    caplog.set_level(logging.INFO, logger="graftmem")
    with Memory(engine=smol, home=tmp_path / "home") as m:
        block = m.learn(_BIG, name="big")
        with api_server(m.store, [smol], learn=False, limits=Limits(write_timeout=0.5)) as srv:
            s = _slow_reader(srv.url, f"/v1/blocks/{block.id}")
            try:
                _until(lambda: any("made no progress" in r.getMessage() for r in caplog.records),
                       "the unread answer was never cut")
                _until(lambda: srv.runner.connection_counts()["open"] == 0, "the unread answer kept its connection")
            finally:
                s.close()


def test_a_body_slower_than_the_minimum_rate_is_a_408(smol, tmp_path):
    """A body that falls ``body_grace`` behind ``min_body_rate`` is refused without waiting for the
    60 s ``body_timeout``. Fails so (the client's 30 s timeout) with the rate left out of `read_body`."""
    from graftmem.server import Limits

    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], learn=False, limits=Limits(min_body_rate=1000, body_grace=0.2)) as srv:
            s = _slow_body(srv.url)
            s.settimeout(30)
            try:
                reply = b""
                while chunk := s.recv(4096):  # the server closes the connection after its answer
                    reply += chunk
            finally:
                s.close()
    finally:
        store.close()
    assert reply.startswith(b"HTTP/1.1 408") and b"1000 bytes/s" in reply, reply[:300]


def test_one_client_address_holds_at_most_its_share_of_the_connections(smol, tmp_path):
    """``max_connections_per_client``: a third connection from 127.0.0.2 (limit 2) closes that address's
    oldest idle one, and only its own: an older idle connection of 127.0.0.3 stays and is served.
    Fails so without the per-client limit (the first socket stays open: its recv times out, the header
    deadline being longer)."""
    from graftmem.server import Limits

    store = Store(tmp_path / "home")
    limits = Limits(max_connections=8, max_connections_per_client=2, header_timeout=60)
    try:
        with api_server(store, [smol], learn=False, limits=limits) as srv:
            addr = _host_port(srv.url)
            other = socket.create_connection(addr, timeout=10, source_address=("127.0.0.3", 0))
            mine = [socket.create_connection(addr, timeout=10, source_address=("127.0.0.2", 0)) for _ in range(3)]
            try:
                assert mine[0].recv(1) == b""  # closed by the server to make room for the third
                for s in (other, mine[2]):
                    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert s.recv(4096).startswith(b"HTTP/1.1 200")
            finally:
                for s in [other, *mine]:
                    s.close()
    finally:
        store.close()


def test_a_refused_answer_is_held_in_proportion_to_what_refusing_it_cost():
    """Issue 37: one client looping on requests the server refuses (grammar bombs, each read, parsed and
    checked before its 400) took a core from the honest clients. `RefusalDelay` holds a refused answer
    ``factor`` times the time its request took (capped); answers that are not refusals (200, a 404 poll,
    a 429 with its own Retry-After) go at once. The clock and the sleep are the middleware's own
    parameters, so the held time is read, not timed."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from graftmem.server.http import RefusalDelay

    now = [100.0]
    slept: list[float] = []

    def route(status: int, cost: float):
        async def handler(request):
            now[0] += cost  # the request's own work, on the middleware's clock
            return JSONResponse({"status": status}, status_code=status)
        return handler

    app = Starlette(routes=[Route(f"/{s}/{c}", route(s, c)) for s, c in
                            ((400, 0.02), (401, 0.001), (413, 0.5), (200, 0.3), (404, 0.3), (429, 0.3), (422, 2.0))])

    async def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))

    held = RefusalDelay(app, factor=3.0, cap=2.0, clock=lambda: now[0], sleep=sleep)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=held)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.get(p)).status_code for p in ("/400/0.02", "/401/0.001", "/413/0.5", "/200/0.3",
                                                           "/404/0.3", "/429/0.3", "/422/2.0")]

    assert asyncio.run(run()) == [400, 401, 413, 200, 404, 429, 422]
    assert slept == [0.06, 0.003, 1.5, 2.0]  # 3x the cost of each refusal, the last one at the cap
    off = RefusalDelay(app, factor=0.0, cap=2.0, clock=lambda: now[0], sleep=sleep)
    slept.clear()

    async def once() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=off), base_url="http://t") as c:
            return (await c.get("/400/0.02")).status_code

    assert asyncio.run(once()) == 400 and slept == []
