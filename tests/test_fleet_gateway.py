"""A fleet of `graftmem serve` workers on one bucket (a real SeaweedFS, tests/seaweed.py), as a gateway
sees it: a worker killed with -9 in the middle of a session's answer, the session's next try served
by another worker that grafts the conversation from the bucket with the same greedy answer, and no
stored block lost or damaged; and the Shepherd Model Gateway (``smg``, a dev dependency) registering a
worker as a generic OpenAI backend and routing to it. Every process is started and stopped here, on
127.0.0.1 ports of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from shutil import which as shutil_which
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from graftmem import FleetStore
from graftmem.server.fleet import WORKER_HEADER
from tests.seaweed import bucket_url, free_port, seaweed  # noqa: F401 (fixtures)
from tests.served import serve_process, stop
from tests.tiny import tiny_path

SYSTEM = ("You are the fleet test's assistant. You answer every question about the weather, the tides and the "
          "trains in one short sentence, and you never ask a question back.")
TURNS = ["What is the weather like?", "And the tides today?", "When is the next train?", "Is it late?",
         "Thank you."]


def _worker(monkeypatch, tmp_path: Path, name: str, url: str, model: str) -> contextlib.AbstractContextManager:
    """One worker: its own home and its own block cache (another machine), the bucket shared. ``model``
    is found before the cache dir moves: the tiny models are cached in the user's cache dir too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{name}"))
    return serve_process("--store", url, "--model", model, "--config", '{"n_threads": 1}',
                         "--min-prefix-tokens", "16", "--no-warm", home=tmp_path / f"home-{name}")


def _ask(client: httpx.Client, url: str, messages: list[dict], **extra) -> tuple[str, dict, str]:
    r = client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8,
                                                         "temperature": 0, **extra})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["graftmem"], r.headers[WORKER_HEADER]


def _source(receipt: dict) -> str:
    """ram / store / bucket / cold: where the request's restored prefix came from."""
    if receipt.get("source") == "store" and receipt.get("fetch_ms"):
        return "bucket"
    return receipt.get("source") or "cold"


class _Events:
    """The ``/v1/kv_events`` stream of a worker, read on a thread: the blocks it reports stored."""

    def __init__(self, url: str) -> None:
        self.stored: list[dict] = []
        self.cond = threading.Condition()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the kv_events stream did not open"

    def _read(self, url: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # ends when the worker is killed
            with httpx.stream("GET", f"{url}/v1/kv_events", timeout=httpx.Timeout(5, read=120)) as r:
                for line in r.iter_lines():
                    self.ready.set()
                    if not line.startswith("data: "):
                        continue
                    with self.cond:
                        self.stored += [e for e in json.loads(line[6:])["events"]
                                        if e["type"] == "BlockStored" and e["medium"] == "store"]
                        self.cond.notify_all()

    def wait_stored(self, n: int, timeout: float = 60.0) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.stored) >= n, timeout), self.stored
            return list(self.stored)


@pytest.mark.slow
def test_a_session_continues_on_another_worker_when_its_worker_is_killed(bucket_url, tmp_path, monkeypatch):
    model = str(tiny_path("llama31"))
    with _worker(monkeypatch, tmp_path, "a", bucket_url, model) as (a_proc, a_url), \
            _worker(monkeypatch, tmp_path, "b", bucket_url, model) as (_, b_url), httpx.Client(timeout=120) as client:
        events = _Events(a_url)
        messages = [{"role": "system", "content": SYSTEM}]
        sources = []
        for turn in TURNS[:3]:  # the session's first three turns on worker a
            messages.append({"role": "user", "content": turn})
            answer, receipt, _ = _ask(client, a_url, messages)
            sources.append(_source(receipt))
            messages.append({"role": "assistant", "content": answer})
        assert sources[1:] == ["ram", "ram"], sources
        # turn 2 learned the system prompt (its 2nd sighting), turn 3 the conversation up to turn 1's answer
        stored = events.wait_stored(2)
        learned = {bid for e in stored for bid in e["block_ids"]}
        # turn 4: a is killed -9 while it streams the answer (the gateway sees a connection cut)
        messages.append({"role": "user", "content": TURNS[3]})
        with client.stream("POST", f"{a_url}/v1/chat/completions",
                           json={"model": "m", "messages": messages, "max_tokens": 64, "temperature": 0,
                                 "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):  # its first chunk: a is answering
                    a_proc.send_signal(signal.SIGKILL)
                    break
        a_proc.wait(timeout=20)
        # b sees another worker's learn at its next listing (every 2 s): until its block listing names them
        deadline = time.monotonic() + 30
        while not learned <= {b["id"] for b in client.get(f"{b_url}/v1/memory/blocks").json()["blocks"]}:
            assert time.monotonic() < deadline, "b never listed the blocks a stored"
            time.sleep(0.2)
        # the retry lands on b: it grafts the conversation a stored from the bucket, and answers as a cold
        # prefill of the whole conversation does (greedy; the contract: a graft is byte-exact)
        answer, receipt, worker = _ask(client, b_url, messages)
        assert _source(receipt) == "bucket", receipt
        assert receipt["block_id"] in learned and receipt["tokens_restored"] > 0
        cold, cold_receipt, _ = _ask(client, b_url, messages, graftmem={"cache": False})
        assert cold_receipt["tokens_restored"] == 0 and answer == cold
        assert worker == client.get(f"{b_url}/health").headers[WORKER_HEADER]
        # the session goes on on b
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[4]}]
        assert _source(_ask(client, b_url, messages)[1]) in ("ram", "store")

    # no stored block lost or damaged: every block a reported stored is listed, every listed block
    # verifies (header, trailer, manifest id, fingerprint, BLAKE3 of the state)
    check = FleetStore(bucket_url, cache_dir=tmp_path / "check", poll_interval=0)
    try:
        listed = {b.id for b in check.list()}
        assert learned <= listed, learned - listed
        for bid in listed:
            check.read_state(bid, lambda n: memoryview(bytearray(n)))
    finally:
        check.close()



def _wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _up(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


@contextlib.contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


@pytest.mark.slow
def test_smg_registers_workers_and_routes_a_session_by_cache_haproxy_by_round_robin_or_session(tmp_path):
    """SMG (its default HTTP mode, no runtime named) registers graftmem workers as generic OpenAI
    backends and sends a session's turns to the worker that holds its prefix; HAProxy alternates
    round-robin and keeps a session on one worker by hashing its session header."""
    haproxy = shutil_which("haproxy")
    if haproxy is None and not os.environ.get("CI"):
        pytest.skip("haproxy is missing: apt-get install haproxy (scripts/dev.sh installs it)")
    assert haproxy is not None, "haproxy is missing on CI: scripts/dev.sh installs it"
    smg = shutil_which("smg") or str(Path(sys.executable).parent / "smg")
    model = str(tiny_path("llama31"))
    args = ("--model", model, "--config", '{"n_threads": 1}', "--min-prefix-tokens", "16", "--no-warm")
    with serve_process(*args, home=tmp_path / "a") as (_, a_url), serve_process(*args, home=tmp_path / "b") as (_, b_url):
        names = {httpx.get(f"{u}/health").headers[WORKER_HEADER] for u in (a_url, b_url)}
        model_id = httpx.get(f"{a_url}/v1/models").json()["data"][0]["id"]
        assert httpx.get(f"{a_url}/v1/models").json()["data"][0]["owned_by"] == "graftmem"  # no other runtime's name
        smg_port, prom, rr, hsh = free_port(), free_port(), free_port(), free_port()
        cfg = tmp_path / "haproxy.cfg"
        servers = "\n".join(f"    server w{i} {u.removeprefix('http://')} check inter 1s" for i, u in enumerate((a_url, b_url)))
        cfg.write_text(f"defaults\n    mode http\n    timeout connect 2s\n    timeout client 60s\n    timeout server 60s\n"
                       f"frontend rr\n    bind 127.0.0.1:{rr}\n    default_backend rr\n"
                       f"frontend hash\n    bind 127.0.0.1:{hsh}\n    default_backend hash\n"
                       f"backend rr\n    balance roundrobin\n{servers}\n"
                       f"backend hash\n    balance hdr(X-Session-Id)\n    hash-type consistent\n{servers}\n")
        with _process([smg, "launch", "--host", "127.0.0.1", "--port", str(smg_port), "--worker-urls", a_url, b_url,
                       "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)],
                      tmp_path / "smg.log"), \
                _process([haproxy, "-f", str(cfg), "-db"], tmp_path / "haproxy.log"), httpx.Client(timeout=60) as client:
            smg_url = f"http://127.0.0.1:{smg_port}"

            def registered() -> bool:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    return len(client.get(f"{smg_url}/workers").json().get("workers", [])) == 2
                return False

            _wait_until(registered, 60, "smg to register both workers")
            _wait_until(lambda: _up(f"http://127.0.0.1:{rr}") and _up(f"http://127.0.0.1:{hsh}"), 30, "haproxy")
            messages = [{"role": "system", "content": SYSTEM}]

            def turns(url: str, n: int, headers: dict | None = None) -> list[str]:
                seen, conv = [], list(messages)
                for t in TURNS[:n]:
                    conv.append({"role": "user", "content": t})
                    r = client.post(f"{url}/v1/chat/completions", headers=headers or {},
                                    json={"model": model_id, "messages": conv, "max_tokens": 4, "temperature": 0})
                    assert r.status_code == 200, r.text
                    seen.append(r.headers[WORKER_HEADER])
                    conv.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                return seen

            # SMG: the session's turns share a growing prefix: every turn on the worker of the first
            by_cache = turns(smg_url, 3)
            assert len(set(by_cache)) == 1 and by_cache[0] in names, by_cache
            # HAProxy round-robin: turns alternate between the two workers
            by_rr = turns(f"http://127.0.0.1:{rr}", 4)
            assert set(by_rr) == names and all(x != y for x, y in zip(by_rr, by_rr[1:])), by_rr
            # HAProxy on a session header: each session stays on one worker
            for s in ("s-1", "s-2", "s-3"):
                assert len(set(turns(f"http://127.0.0.1:{hsh}", 3, {"X-Session-Id": s}))) == 1
