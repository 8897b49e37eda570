"""A non-streamed answer is sent before the request stores the prefix it learned: the client's wait does
not include writing blocks, and the next request on the same engine does not wait for them either (the
prefix cache's writer thread stores them after the engine is released; the next request reuses the
same cells from RAM meanwhile). Plumbing of the server's writer, on the tiny random-weight Llama 3.1 of
tests/tiny.py (`tiny_llama`), ~1/100th of SmolLM2's prefill."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import openai

from graftmem.server import api_server
from graftmem.store.local import Store

from .conftest import long_text

GATE_S = 60.0  # bound on how long a held store waits for the test's signal


def _held_store(cache, monkeypatch) -> tuple[threading.Event, list[bool]]:
    """Make the cache's store step wait for the test's signal: the real store runs only once the test
    has seen the answer. ``released`` records whether it was the signal (True) or the bound (False)
    that let it go: a server that stored before answering would hold the answer until the bound."""
    gate, released = threading.Event(), []
    real = cache.store_captured

    def held(*a, **kw):
        released.append(gate.wait(GATE_S))
        return real(*a, **kw)

    monkeypatch.setattr(cache, "store_captured", held)
    return gate, released


@contextlib.contextmanager
def _held_server(engine, tmp_path, monkeypatch, seed: int) -> Iterator[tuple[Any, Store, Any, threading.Event,
                                                                          list[bool], list[dict]]]:
    """A server on ``engine`` that learns a prompt prefix on its first sighting, its store step held
    (`_held_store`), a client, and a conversation whose system prompt is long enough to be learned;
    the store is closed after the server."""
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [engine], min_prefix_tokens=16, sightings=1) as srv:
            gate, released = _held_store(srv.cache, monkeypatch)
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "system", "content": long_text(40, seed=seed)}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Thanks"}]
            yield srv, store, c, gate, released, msgs
    finally:
        store.close()


def test_answer_comes_before_the_prefix_is_stored(tiny_llama, tmp_path, monkeypatch):
    with _held_server(tiny_llama, tmp_path, monkeypatch, 9) as (srv, store, c, gate, released, msgs):
        c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
        assert store.list(kind="auto") == []  # answered while the store step was still held
        gate.set()
        second = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
        # the writer stores after the engines go quiet: the second answer may come before it took the gate
        assert srv.cache.flush(timeout=GATE_S)
        assert released == [True], "the answer waited for the store step"
        assert second.usage.prompt_tokens_details.cached_tokens > 16  # the kept cells, or the stored prefix


def test_closing_waits_for_what_requests_learn(tiny_llama, tmp_path, monkeypatch):
    """Graceful shutdown covers the learning after the answer: a server closed right after answering
    has stored the prefix when close() returns."""
    with _held_server(tiny_llama, tmp_path, monkeypatch, 10) as (srv, store, c, gate, released, msgs):
        c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
        assert store.list(kind="auto") == []  # answered, not stored yet
        gate.set()  # close() below starts while the store step may still be running
        srv.close()
        assert released == [True]
        assert store.list(kind="auto"), "close() returned before the request stored what it learned"


def test_next_request_on_the_engine_does_not_wait_for_the_store_step(tiny_llama, tmp_path, monkeypatch):
    """The store step runs off the engine: with it held, the next request on the same (only) engine is
    answered, from the cells the first one kept; the blocks are stored once the step is let go, and
    wait_idle() waits for them."""
    with _held_server(tiny_llama, tmp_path, monkeypatch, 11) as (srv, store, c, gate, released, msgs):
        c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
        more = msgs + [{"role": "assistant", "content": "Welcome"}, {"role": "user", "content": "Bye"}]
        second = c.chat.completions.create(model="smollm2", messages=more, max_tokens=2, temperature=0)
        assert released == [], "the second request waited for the first one's store step"
        assert second.usage.prompt_tokens_details.cached_tokens > 16  # the first request's kept cells
        gate.set()
        assert srv.pipeline.wait_idle()
        assert released and all(released)
        assert store.list(kind="auto")


def test_sigterm_closes_serve_through_close(tmp_path):
    """`graftmem serve` stopped by SIGTERM (what a service manager and bench/serve.py send) returns through
    its ``close()``, which waits for the requests and the prefixes they learned; uvicorn re-raises the
    signal after its graceful shutdown, and with the default handler the process died there (exit
    status -SIGTERM), losing whatever the writer had not stored yet."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "--home", str(tmp_path / "home"), "serve", "--port", "0",
                             "--blocks-only"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "serving" in line, proc.stderr.read() if proc.poll() is not None else line  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
