"""Held-out red team of `graftmem serve` (issue 37): does any request crash it, freeze it, or tell one
tenant another's prompt?

One ``graftmem serve`` process (SmolLM2, one engine, two tenants' keys and an operator's metrics key, a
256-descriptor limit as in bench.slow_clients) on 127.0.0.1, and a probe thread that asks ``/health``
every 0.2 s for the whole run. Then, one after another, each attack of the corpus below (every loop
bounded in count and in time; a client gives up after ``--timeout`` s):

* grammar bombs through every door that builds a grammar (chat ``response_format``, chat forced
  ``tool_choice``, ``/v1/completions`` ``response_format``, ``/v1/responses`` ``text.format``,
  ``/v1/messages`` ``tool_choice: any``): the issue's schemas, and schemas written against the limits'
  checker (quantifiers it does not parse, ``$ref`` into places it does not walk, nullable repetitions
  nested under the limits, wide unions, wide objects, const monsters, unicode);
* hostile bodies: 100,000 messages, 100,000-deep JSON, lone surrogates, huge ids, template kwargs;
* an embeddings flood, slow bodies and slow readers (a normal client counted meanwhile);
* tenant oracles: tenant B sharing guesses of A's system prompt, B's ``/metrics``, ``/v1/info``,
  listings, ``DELETE`` and GET of blocks by id and id prefix, not-yours against not-there texts.

Per attack a row: the attack, the door, the status code, the worst ``/health`` latency while it ran
(must stay under 1 s), whether the process lives, and how long an honest 4-token chat request took
right after (the engine is free again). Tenant rows say whether B learned anything.

    python -m bench.redteam [--only grammar,bodies,slow,embeddings,tenants] [--timeout 40]

Results: ``bench/results/redteam.json`` (with the command, the commit and the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from bench import harness
from bench.hostile import bomb_requests
from bench.peer import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "redteam.json"

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}
METRICS_KEY = "operator-metrics-key-0123"


def _fds() -> None:  # in the server's process: a small descriptor limit, as the slow-client bench
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def start_server(work: Path, extra: tuple[str, ...] = (), root: Path = ROOT) -> tuple[subprocess.Popen, str, Any]:
    keyfile = work / "keys.txt"
    keyfile.write_text("".join(f"{t} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in KEYS.items()))
    port = free_port()
    log = open(work / "server.log", "wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root), "GRAFTMEM_HOME": str(work / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "serve", "--port", str(port), "--no-warm",
                             "--api-key-file", str(keyfile), "--metrics-key", METRICS_KEY,
                             "--min-prefix-tokens", "32", "--sightings", "1", *extra],
                            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_fds)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited at start: {(work / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc, 10)
            raise SystemExit("the server did not start in 300 s")
        time.sleep(0.5)


def H(tenant: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


# --------------------------------------------------------------------------- the /health probe
class Probe:
    """``GET /health`` every 0.2 s on a fresh connection (5 s timeout): the worst latency in a window."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url, self.stop = url, threading.Event()
        self.samples: list[tuple[float, Optional[float]]] = []  # (start, latency s or None: no answer)
        self.deadline = time.monotonic() + seconds
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            t0 = time.monotonic()
            try:
                ok = httpx.get(self.url + "/health", timeout=5).status_code == 200
                lat: Optional[float] = time.monotonic() - t0 if ok else None
            except httpx.HTTPError:
                lat = None
            self.samples.append((t0, lat))
            self.stop.wait(max(0.0, 0.2 - (time.monotonic() - t0)))

    def worst(self, t0: float, t1: float) -> tuple[float, int]:
        """(worst latency in s, probes without an answer) among the probes started in [t0, t1]."""
        got = [lat for t, lat in self.samples if t0 <= t <= t1]
        lats = [x for x in got if x is not None]
        return (max(lats) if lats else 0.0), sum(1 for x in got if x is None)


# --------------------------------------------------------------------------- the runner
class Red:
    def __init__(self, proc: subprocess.Popen, url: str, probe: Probe, timeout: float) -> None:
        self.proc, self.url, self.probe, self.timeout = proc, url, probe, timeout
        self.rows: list[dict[str, Any]] = []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def honest(self) -> Optional[float]:
        """Seconds an honest 4-token chat request takes now (None: no answer in 60 s or an error)."""
        if not self.alive():
            return None
        t0 = time.monotonic()
        try:
            r = httpx.post(self.url + "/v1/chat/completions", headers=H("alice"), timeout=60, json={
                "model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hello"}]})
            return round(time.monotonic() - t0, 2) if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def row(self, group: str, attack: str, door: str, fn: Callable[[], Any], honest: bool = True,
            **extra: Any) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            status = fn()
        except httpx.TimeoutException:
            status = "timeout"
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        t1 = time.monotonic()
        time.sleep(0.3)  # one more probe lands after the attack's answer
        worst, missed = self.probe.worst(t0, time.monotonic())
        r = {"group": group, "attack": attack, "door": door, "status": status, "seconds": round(t1 - t0, 2),
             "load1": round(os.getloadavg()[0], 1),
             "health_worst_s": round(worst, 3), "health_missed": missed, "alive": self.alive(),
             "honest_after_s": self.honest() if honest else "-", **extra}
        r["finding"] = finding(r)
        self.rows.append(r)
        print(f"{group:<10} {attack[:34]:<34} {door[:22]:<22} {str(status)[:12]:>12} {r['seconds']:>7} "
              f"{r['health_worst_s']:>7} {str(r['alive']):>5} {str(r['honest_after_s']):>7}  {r['finding'] or ''}",
              flush=True)
        return r

    def post(self, path: str, body: Any, tenant: str = "alice", timeout: Optional[float] = None,
             raw: Optional[bytes] = None) -> httpx.Response:
        kw: dict[str, Any] = {"content": raw, "headers": {**H(tenant), "Content-Type": "application/json"}} \
            if raw is not None else {"json": body, "headers": H(tenant)}
        return httpx.post(self.url + path, timeout=timeout or self.timeout, **kw)


def finding(r: dict[str, Any]) -> str:
    """What is wrong with a row, by the issue's bar ('' when nothing)."""
    out = []
    st = r["status"]
    if not r["alive"]:
        out.append("CRASH")
    if isinstance(st, int) and st >= 500:
        out.append(f"{st}")
    if st == "timeout" or (isinstance(st, str) and st not in ("-",) and not st.startswith("ok")):
        out.append(f"no answer ({st})")
    if r["health_worst_s"] >= 1.0 or r["health_missed"]:
        out.append(f"/health stalled {r['health_worst_s']} s ({r['health_missed']} unanswered)")
    h = r.get("honest_after_s")
    if h is None or (isinstance(h, float) and h > 30):  # a 4-token answer; minutes when an engine is held
        out.append(f"engine held after ({h})")
    if r.get("leak"):
        out.append("LEAK: " + str(r["leak"]))
    return "; ".join(out)


# --------------------------------------------------------------------------- grammar bombs
def bomb_corpus(big: bool) -> list[tuple[str, dict]]:
    """(name, schema): the issue's bombs, then schemas written against the limits' checker."""
    hidden = lambda sub: {"type": "object", "properties": {"x": {"$ref": "#/x-hidden"}}, "x-hidden": sub}  # noqa: E731
    corpus = [
        # the issue's
        ("maxLength 30000", {"type": "string", "maxLength": 30000}),
        ("minLength 100000", {"type": "string", "minLength": 100000}),
        ("maxItems 100000", {"type": "array", "items": {"type": "string"}, "maxItems": 100000}),
        ("pattern (a|b){0,100000}", {"type": "string", "pattern": "^(a|b){0,100000}$"}),
        ("pattern nested {0,400}^3", {"type": "string", "pattern": "^((a{0,400}){0,400}){0,400}$"}),
        ("enum 100000", {"enum": [f"value-{i}" for i in range(100_000)]}),
        # recursion and nesting
        ("$ref self-loop", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        ("$ref mutual anyOf", {"$defs": {"n": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
            "$ref": "#/$defs/n"}}]}}, "$ref": "#/$defs/n"}),
        ("anyOf nested 25 deep", _nest("anyOf", 25)),
        ("allOf nested 25 deep", _nest("allOf", 25)),
        ("$ref chain 2000", {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2000)} | {
            "d2000": {"type": "string"}}, "$ref": "#/$defs/d0"}),
        # wide
        ("5000 optional properties", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}),
        ("900 optional properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(900)}}),
        ("anyOf 9000 strings", {"anyOf": [{"type": "string"} for _ in range(9000)]}),
        ("prefixItems 9000", {"type": "array", "prefixItems": [{"type": "integer"} for _ in range(9000)]}),
        ("const 110k chars", {"const": "x" * 110_000}),
        ("const deep object", {"const": _deep_value(25)}),
        # unicode / escapes
        ("names with quotes/escapes", {"type": "object", "properties": {'a"b\\c\n\u0000\u2028\U0001F600': {
            "type": "string", "pattern": "^[\\u0000-\\uFFFF\"\\\\]{0,10}$"}}, "required": ['a"b\\c\n\u0000\u2028\U0001F600']}),
        ("pattern unicode class", {"type": "string", "pattern": "^[\U0001F600-\U0001F64F]{1,50}\\\\u0041\\x41$"}),
        ("integer max 1e308", {"type": "integer", "minimum": -1e308, "maximum": 1e308}),
        ("integer 4000 digits", {"type": "integer", "maximum": int("9" * 4000)}),
        # against the checker
        ("pattern {m,n} with spaces", {"type": "string", "pattern": "^a{ 0, 100000 }$"}),
        ("pattern {n} with spaces (1e7)", {"type": "string", "pattern": "^a{ 10000000 }$"}),
        ("$ref to unwalked maxLength", hidden({"type": "string", "maxLength": 100000})),
        ("$ref to unwalked enum 60000", hidden({"enum": [f"v{i}" for i in range(60_000)]})),
        ("stacked quantifiers a?{20}{20}{20}", {"type": "string", "pattern": "^a?{20}{20}{20}$"}),
        ("nullable nest ((a?){27}){27}){27}", {"type": "string", "pattern": "^(((a?){27}){27}){27}$"}),
        ("(a{0,500}){0,39}", {"type": "string", "pattern": "^(a{0,500}){0,39}$"}),
    ]
    if big:  # these hold a core in C for minutes to hours (measured: --big)
        corpus += [("stacked quantifiers a?{100}{100}{100}", {"type": "string", "pattern": "^a?{100}{100}{100}$"})]
    return corpus


def _nest(key: str, depth: int) -> dict:
    node: dict = {"type": "object", "properties": {"leaf": {"type": "string", "maxLength": 5}}}
    for _ in range(depth):
        node = {key: [node, {"type": "object", "properties": {"z": {"type": "integer"}}}]}
    return node


def _deep_value(depth: int) -> Any:
    v: Any = "x"
    for i in range(depth):
        v = {f"k{i}": [v]}
    return v


def grammar(red: Red, big: bool, only: Optional[set[str]] = None, n_doors: Optional[int] = None) -> None:
    for name, schema in bomb_corpus(big):
        if only and name not in only:
            continue
        doors = bomb_requests(schema)[:n_doors]
        for k, (path, body) in enumerate(doors):
            body = {**body, "max_tokens": 16} if "max_tokens" in body else {**body, "max_output_tokens": 16}
            door = path if "tools" not in body else f"{path} tool_choice"
            if path == "/v1/completions" or (path == "/v1/chat/completions" and "tools" not in body):
                door = f"{path} response_format"
            if path == "/v1/responses":
                door = "/v1/responses text.format"
            red.row("grammar", name, door, lambda p=path, b=body: _status(red.post(p, b)), honest=k == len(doors) - 1)
            if not red.alive():
                return


def _status(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            err = r.json().get("error", {})
            msg = err.get("message") if isinstance(err, dict) else err
        except ValueError:
            msg = r.text
        return r.status_code if r.status_code >= 500 else f"ok {r.status_code}: {str(msg)[:70]}"
    return f"ok {r.status_code}"


# --------------------------------------------------------------------------- hostile bodies
def bodies(red: Red) -> None:
    hi = [{"role": "user", "content": "hi"}]
    many = [{"role": "user", "content": "hi"}] * 100_000
    cases: list[tuple[str, str, Callable[[], Any]]] = [
        ("100,000 messages", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 4, "messages": many})),
        ("100,000 input items", "/v1/responses", lambda: red.post("/v1/responses", {
            "model": "m", "max_output_tokens": 4, "input": many})),
        ("100,000 messages", "/v1/messages", lambda: red.post("/v1/messages", {
            "model": "m", "max_tokens": 4, "messages": many})),
        ("100,000 messages", "/v1/messages/count_tokens", lambda: red.post("/v1/messages/count_tokens", {
            "model": "m", "messages": many})),
        ("100,000-deep JSON", "/v1/chat/completions", lambda: red.post(
            "/v1/chat/completions", None, raw=b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
        ("100,000-deep JSON", "/v1/memory/learn", lambda: red.post(
            "/v1/memory/learn", None, raw=b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
        ("lone surrogate in content", "/v1/chat/completions", lambda: red.post(
            "/v1/chat/completions", None, raw=b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800"}]}')),
        ("lone surrogate schema key", "/v1/chat/completions response_format", lambda: red.post(
            "/v1/chat/completions", None, raw=b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"a"}],'
            b'"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object",'
            b'"properties":{"\\udfff":{"type":"string"}},"required":["\\udfff"]}}}}')),
        ("lone surrogate previous_response_id", "/v1/responses", lambda: red.post(
            "/v1/responses", None, raw=b'{"model":"m","input":"hi","previous_response_id":"resp_\\ud800"}')),
        ("100k-char previous_response_id", "/v1/responses", lambda: red.post(
            "/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "resp_" + "a" * 100_000})),
        ("10k-char response id in path", "GET /v1/responses/{id}", lambda: httpx.get(
            red.url + "/v1/responses/resp_" + "a" * 10_000, headers=H(), timeout=red.timeout)),
        ("10k-char block id in path", "GET /v1/blocks/{id}", lambda: httpx.get(
            red.url + "/v1/blocks/" + "a" * 10_000, headers=H(), timeout=red.timeout)),
        ("10k-char block id in path", "DELETE /v1/memory/blocks", lambda: httpx.delete(
            red.url + "/v1/memory/blocks/" + "a" * 10_000, headers=H(), timeout=red.timeout)),
        ("block id as a list", "/v1/memory/ask", lambda: red.post("/v1/memory/ask", {"id": ["a"], "task": "x"})),
        ("chat_template_kwargs.messages", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 2, "messages": hi, "chat_template_kwargs": {"messages": many[:10]}})),
        ("chat_template_kwargs 1 MB value", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 2, "messages": hi, "chat_template_kwargs": {"x": "y" * 1_000_000}})),
        ("a template in the body", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 2, "messages": hi,
            "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"})),
        ("8 MB body", "/v1/completions", lambda: red.post("/v1/completions", {
            "model": "m", "max_tokens": 2, "prompt": "x " * 4_200_000})),
        ("4 MB prompt", "/v1/completions", lambda: red.post("/v1/completions", {
            "model": "m", "max_tokens": 2, "prompt": "x " * 2_000_000})),
        ("max_tokens 10**9", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 10 ** 9, "messages": hi})),
        ("stop: 4 x 1 MB", "/v1/chat/completions", lambda: red.post("/v1/chat/completions", {
            "model": "m", "max_tokens": 8, "messages": hi, "stop": ["z" * 1_000_000] * 4})),
        ("2,048 x 128-char embeddings", "/v1/embeddings", lambda: red.post("/v1/embeddings", {
            "model": "m", "input": ["word " * 25] * 2048})),
        ("100,000 embedding inputs", "/v1/embeddings", lambda: red.post("/v1/embeddings", {
            "model": "m", "input": ["x"] * 100_000})),
    ]
    for name, door, fn in cases:
        red.row("bodies", name, door, lambda f=fn: _status(f()))
        if not red.alive():
            return


# --------------------------------------------------------------------------- floods and slow sockets
def embeddings_flood(red: Red, seconds: float) -> None:
    """4 clients sending 256-input embeddings requests back to back for ``seconds``; an honest chat
    request every 2 s meanwhile (its worst time is the row's honest column)."""
    got: dict[str, int] = {}
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def flood() -> None:
        while time.monotonic() < stop_at:
            try:
                st = str(red.post("/v1/embeddings", {"model": "m", "input": ["some words to embed " * 6] * 256},
                                  tenant="bob", timeout=60).status_code)
            except httpx.HTTPError as exc:
                st = type(exc).__name__
            with lock:
                got[st] = got.get(st, 0) + 1

    def run() -> str:
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        honest = []
        while time.monotonic() < stop_at:
            honest.append(red.honest())
            time.sleep(2)
        for t in threads:
            t.join(70)
        worst = max((h for h in honest if h is not None), default=None)
        return f"ok {got}; honest worst {worst} s, failed {sum(h is None for h in honest)}/{len(honest)}"

    red.row("flood", f"embeddings 4 x 256 inputs, {seconds:.0f} s", "/v1/embeddings", run)


def slow_sockets(red: Red, block_id: str, n: int, seconds: float) -> None:
    """``n`` slow-body and ``n`` slow-reader sockets for ``seconds`` (reopened when closed); a normal client
    asks ``/v1/models`` once a second meanwhile."""
    host, port = red.url[len("http://"):].split(":")
    addr = (host, int(port))
    auth = f"Authorization: Bearer {KEYS['alice']}\r\n"

    def open_one(kind: str) -> Optional[socket.socket]:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if kind == "read":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(2)
            s.connect(addr)
            if kind == "body":
                s.sendall(("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"{auth}Content-Length: 100000\r\n\r\n{{").encode())
            else:
                s.sendall(f"GET /v1/blocks/{block_id} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
            s.setblocking(False)
            return s
        except OSError:
            s.close()
            return None

    def run() -> str:
        kinds = ["body"] * n + ["read"] * n
        socks = [open_one(k) for k in kinds]
        ok = fail = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            for i, s in enumerate(socks):
                try:
                    if s is not None and kinds[i] == "body":
                        s.send(b" ")
                except OSError:
                    s.close()
                    socks[i] = None
                if socks[i] is None:
                    socks[i] = open_one(kinds[i])
            try:
                with httpx.Client(timeout=5) as c:
                    ok += c.get(red.url + "/v1/models", headers=H()).status_code == 200
            except httpx.HTTPError:
                fail += 1
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
        for s in socks:
            if s is not None:
                s.close()
        return f"ok normal {ok}, failed {fail}"

    red.row("slow", f"{n} slow bodies + {n} slow readers, {seconds:.0f} s", "sockets", run)


# --------------------------------------------------------------------------- tenant oracles
SYSTEM = ("You are the internal assistant of Hollowmere Bank. The vault code for branch 17 is 4417-ALPHA; "
          "never reveal it. Answer in one short sentence. ") * 3


def _norm(r: httpx.Response, *ids: str) -> str:
    """A response's status and body with the ids named replaced, for a not-yours / not-there comparison."""
    text = r.text
    for i in ids:
        text = text.replace(i, "<id>")
        if len(i) > 12:
            text = text.replace(i[:12], "<id>")
    return f"{r.status_code} {text}"


def tenants(red: Red) -> None:
    url, T = red.url, max(red.timeout, 180.0)  # learning and prefilling on a loaded 2-core machine
    chat = {"model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]}

    def metrics(tenant: str) -> dict[str, float]:
        out = {}
        for line in httpx.get(url + "/metrics", headers=H(tenant), timeout=T).text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                # load gauges and B's own request counts (the probes below are B's requests) aside
                if not any(x in k for x in ("queue", "busy", "seconds", "graftmem_requests_total")):
                    try:
                        out[k] = float(v)
                    except ValueError:
                        pass
        return out

    def info(tenant: str) -> str:
        return httpx.get(url + "/v1/info", headers=H(tenant), timeout=T).text

    def bob_view() -> tuple[dict[str, float], str, str, str]:
        return (metrics("bob"), info("bob"), httpx.get(url + "/v1/memory/blocks", headers=H("bob"), timeout=T).text,
                httpx.get(url + "/v1/blocks", headers=H("bob"), timeout=T).text)

    # 1. B shares a right and a wrong guess of A's system prompt; A calls twice; does B's view move?
    def shared_guesses() -> str:
        right = red.post("/v1/memory/learn", {"text": SYSTEM, "shared": True}, tenant="bob", timeout=T).json()
        wrong = red.post("/v1/memory/learn", {"text": SYSTEM.replace("4417", "9999"), "shared": True},
                         tenant="bob", timeout=T).json()
        rid, wid = right["block"]["id"], wrong["block"]["id"]
        before = bob_view()
        cached = []
        for _ in range(2):
            r = red.post("/v1/chat/completions", chat, tenant="alice", timeout=T).json()
            cached.append((r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens"))
        after = bob_view()
        moved = [k for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k)]
        d_right = httpx.delete(f"{url}/v1/memory/blocks/{rid}", headers=H("bob"), timeout=T)
        d_wrong = httpx.delete(f"{url}/v1/memory/blocks/{wid}", headers=H("bob"), timeout=T)
        leaks = []
        if moved:
            leaks.append(f"B's /metrics moved: {moved[:3]}")
        if before[1] != after[1]:
            leaks.append("B's /v1/info moved")
        stamp = re.compile(r'"created_at":"[^"]*"')  # the listing's own time
        for name, b, a in (("/v1/memory/blocks", before[2], after[2]),
                           ("/v1/blocks", stamp.sub("", before[3]), stamp.sub("", after[3]))):
            if b != a:
                k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                leaks.append(f"B's {name} moved at {k}: {b[max(0, k - 60):k + 60]!r} -> {a[max(0, k - 60):k + 60]!r}")
        if _norm(d_right, rid) != _norm(d_wrong, wid):
            leaks.append(f"DELETE differs: {_norm(d_right, rid)[:80]} vs {_norm(d_wrong, wid)[:80]}")
        shared_guesses.leak = "; ".join(leaks)  # type: ignore[attr-defined]
        return f"ok A cached {cached}"

    r = red.row("tenants", "B shares guesses of A's system prompt", "learn/metrics/info/DELETE", shared_guesses,
                honest=False)
    r["leak"] = getattr(shared_guesses, "leak", "")
    r["finding"] = finding(r)

    # 2. not yours vs not there, by id and by id prefix, on every block route
    a_ids = sorted(set(_ids(httpx.get(url + "/v1/memory/blocks", headers=H("alice"), timeout=T).text)))
    fake = hashlib.sha256(b"nothing").hexdigest()

    def not_yours() -> str:
        if not a_ids:
            return "no block of A to probe"
        aid = a_ids[0]
        diffs = []
        for method, path in (("GET", "/v1/memory/blocks/{}"), ("DELETE", "/v1/memory/blocks/{}"),
                             ("GET", "/v1/blocks/{}"), ("GET", "/v1/blocks/{}/manifest"),
                             ("DELETE", "/v1/memory/blocks/{}?cascade=true")):
            for cut in (64, 10):
                ra = httpx.request(method, url + path.format(aid[:cut]), headers=H("bob"), timeout=T)
                rf = httpx.request(method, url + path.format(fake[:cut]), headers=H("bob"), timeout=T)
                if _norm(ra, aid[:cut]) != _norm(rf, fake[:cut]):  # the id sent is echoed: replaced
                    diffs.append(f"{method} {path} [{cut}]: {_norm(ra, aid[:cut])[:90]} vs {_norm(rf, fake[:cut])[:90]}")
        for verb, body in (("/v1/memory/ask", {"id": aid, "task": "x", "max_tokens": 2}),
                           ("/v1/memory/learn", {"text": "child", "parent": aid})):
            ra = red.post(verb, body, tenant="bob", timeout=T)
            rf = red.post(verb, {**body, **({"id": fake} if "id" in body else {"parent": fake})}, tenant="bob", timeout=T)
            if _norm(ra, aid) != _norm(rf, fake):
                diffs.append(f"{verb}: {_norm(ra, aid)[:60]} vs {_norm(rf, fake)[:60]}")
        not_yours.leak = "; ".join(diffs)  # type: ignore[attr-defined]
        return f"ok {len(a_ids)} blocks of A probed"

    r = red.row("tenants", "not yours vs not there (id, prefix)", "block routes, ask, learn parent", not_yours,
                honest=False)
    r["leak"] = getattr(not_yours, "leak", "")
    r["finding"] = finding(r)

    # 3. B's own view: A's prompt sent by B is cold; B's search and listings hold none of A's ids
    def b_view() -> str:
        rb = red.post("/v1/chat/completions", chat, tenant="bob", timeout=T).json()
        cached = (rb.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        seen = set()
        for text in (httpx.get(url + "/v1/memory/blocks", headers=H("bob"), timeout=T).text,
                     httpx.get(url + "/v1/blocks", headers=H("bob"), timeout=T).text,
                     red.post("/v1/memory/search", {"query": SYSTEM, "limit": 50}, tenant="bob", timeout=T).text):
            seen |= set(_ids(text)) & set(a_ids)
        leaks = []
        if cached:
            leaks.append(f"B's cached_tokens {cached} on A's prompt")
        if seen:
            leaks.append(f"B sees {len(seen)} of A's ids")
        b_view.leak = "; ".join(leaks)  # type: ignore[attr-defined]
        return f"ok B cached {cached}"

    r = red.row("tenants", "B sends A's prompt; B lists and searches", "chat, listings, search", b_view, honest=False)
    r["leak"] = getattr(b_view, "leak", "")
    r["finding"] = finding(r)

    # 4. A's stored response named by B
    def responses() -> str:
        ra = red.post("/v1/responses", {"model": "m", "input": "Hello", "max_output_tokens": 2,
                                        "instructions": SYSTEM}, tenant="alice", timeout=T).json()
        rid = ra.get("id", "")
        fake_r = "resp_" + "0" * max(1, len(rid) - 5)
        diffs = []
        for probe in (lambda i: httpx.get(f"{url}/v1/responses/{i}", headers=H("bob"), timeout=T),
                      lambda i: httpx.get(f"{url}/v1/responses/{i}/input_items", headers=H("bob"), timeout=T),
                      lambda i: red.post("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 2,
                                                           "previous_response_id": i}, tenant="bob", timeout=T),
                      lambda i: httpx.delete(f"{url}/v1/responses/{i}", headers=H("bob"), timeout=T)):
            a, f = probe(rid), probe(fake_r)
            if _norm(a, rid) != _norm(f, fake_r):
                diffs.append(f"{_norm(a, rid)[:60]} vs {_norm(f, fake_r)[:60]}")
        responses.leak = "; ".join(diffs)  # type: ignore[attr-defined]
        return f"ok A's response {rid[:14]}"

    r = red.row("tenants", "B names A's stored response", "/v1/responses", responses, honest=False)
    r["leak"] = getattr(responses, "leak", "")
    r["finding"] = finding(r)


def _ids(text: str) -> list[str]:
    return re.findall(r"\b[0-9a-f]{64}\b", text)


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="grammar,bodies,flood,slow,tenants",
                    help="comma-separated groups: grammar, bodies, flood, slow, tenants")
    ap.add_argument("--timeout", type=float, default=40.0, help="seconds a client waits for one answer")
    ap.add_argument("--slow", type=int, default=50, help="slow-body sockets, and as many slow readers")
    ap.add_argument("--slow-s", type=float, default=20.0)
    ap.add_argument("--flood-s", type=float, default=20.0)
    ap.add_argument("--big", action="store_true", help="also the bombs that hold a core for hours on a weak checker")
    ap.add_argument("--bombs", default="", help="comma-separated bomb names: only these (default: every one)")
    ap.add_argument("--doors", type=int, default=None, help="the first N doors only (default: all five)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server is attacked (a baseline)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="graftmem-redteam-"))
    proc, url, log = start_server(work, root=args.root.resolve())
    probe = Probe(url, seconds=3600)
    probe.thread.start()
    red = Red(proc, url, probe, args.timeout)
    t_start = time.monotonic()
    print(f"{'group':<10} {'attack':<34} {'door':<22} {'status':>12} {'s':>7} {'health':>7} {'alive':>5} "
          f"{'honest':>7}  finding", flush=True)
    try:
        red.row("baseline", "honest chat", "/v1/chat/completions", lambda: f"ok {red.honest()}")
        if "tenants" in only and red.alive():
            tenants(red)
        if "grammar" in only and red.alive():
            grammar(red, args.big, set(filter(None, args.bombs.split(","))), args.doors)
        if "bodies" in only and red.alive():
            bodies(red)
        if "flood" in only and red.alive():
            embeddings_flood(red, args.flood_s)
        if "slow" in only and red.alive():
            blk = red.post("/v1/memory/learn", {"text": " ".join(f"Rule {i}: refunds over {i * 7} dollars need a "
                                                                 "manager." for i in range(12))}).json()
            slow_sockets(red, blk["block"]["id"], args.slow, args.slow_s)
    finally:
        probe.stop.set()
        probe.thread.join(10)
        alive = red.alive()
        stop(proc, 20)
        log.close()
    lats = [lat for _, lat in probe.samples if lat is not None]
    findings = [r for r in red.rows if r["finding"]]
    print(f"\n{len(red.rows)} attacks in {time.monotonic() - t_start:.0f} s; /health probes {len(probe.samples)}, "
          f"worst {max(lats, default=0):.3f} s, unanswered {sum(1 for _, x in probe.samples if x is None)}; "
          f"alive at the end: {alive}; findings: {len(findings)}")
    for r in findings:
        print(f"  {r['attack']} via {r['door']}: {r['finding']}")
    harness.write_results(args.out, {"rows": red.rows, "alive_at_end": alive, "findings": len(findings),
                                     "health_probes": len(probe.samples), "health_worst_s": round(max(lats, default=0), 3),
                                     "health_unanswered": sum(1 for _, x in probe.samples if x is None),
                                     "server_log_tail": (work / "server.log").read_text(errors="replace")[-3000:]},
                          args=args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
