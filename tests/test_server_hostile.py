"""No client can hold the server (issue 24, red team): idle and slow-header sockets, a request whose
client left, an 8 MB body. Every loop here is bounded in count and time, everything is on 127.0.0.1 and
on ports these tests opened. No timing asserts: "not held" is shown by an answer that comes while the
attack is still under way (a client timeout shorter than the trickle; the big body's work held in its
worker thread until the other answer came)."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from graftmem import Memory
from graftmem.server import api_server

ROOT = Path(__file__).resolve().parents[1]


def _limit_fds() -> None:  # in the server's child process: the limit the red team's server had
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@pytest.fixture
def blocks_server(tmp_path):
    """``graftmem serve --blocks-only`` (no model: only the HTTP layer) in a process with 256 fds."""
    env = {**os.environ, "GRAFTMEM_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "serve", "--blocks-only", "--port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_limit_fds)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        yield m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


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
    from graftmem.server import openai as openai_routes

    srv, _ = served
    if chars == 8_000_000:
        held = _Held(openai_routes.json_object, 1 << 20)
        monkeypatch.setattr(openai_routes, "json_object", held)
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
