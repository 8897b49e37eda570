"""Honest agents beside a hostile mix (issue 37's "must show"): does an attack with a valid key slow
or refuse the honest clients?

One ``graftmem serve`` process (SmolLM2, a chat template that loops ~10^10 times when a user writes
TRIGGER, the server's default limits). First the honest workload alone: ``--agents`` agents (default 8),
each a short support conversation of ``--turns`` streamed, greedy turns of ``--max-tokens`` tokens through
the official ``openai`` client, all at once. Then the same workload again while the attackers run,
each bounded in count and in time (they stop when the honest agents are done, or at ``--attack-s``):

* slow bodies: ``--slow`` sockets that announce a 10 kB JSON body and send one byte every 0.5 s;
* slow readers: ``--slow`` sockets with a 4 kB receive buffer that ask for a stored block's bytes (MBs)
  and never read;
* grammar bombs: the issue's schemas (``maxLength: 30000``, ``maxItems: 100000``, the pattern
  ``(a|b){0,100000}``, a 100,000-value enum) through the five doors, one after another;
* the template trigger: chat requests whose user message says TRIGGER, two at a time;
* an embeddings flood: 4 clients sending ``/v1/embeddings`` requests of 256 inputs each.

A warm-up run first (its prefixes learned, as a server in use has them), then per rep the workload
alone, each attack phase, and the workload alone again. Per phase: the honest turns' p50 / p95 time to first token, how many honest requests failed or were
refused, and what each attacker got back (status counts). The claim under test: p95 with the attack
within 2x of p95 alone, no honest request refused or failed, the server alive at the end. Everything is
on 127.0.0.1, on the port this script's server opened.

    python -m bench.hostile [--agents 8] [--turns 3] [--slow 40] [--reps 1]

Results: ``bench/results/hostile.json`` (with the command, the commit and the machine).
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import openai

from bench import harness
from bench import serve as agent

RESULTS = Path(__file__).resolve().parent / "results" / "hostile.json"

SYSTEM = ("You are the support agent of Northwind Outfitters. Orders have numbers like NW-12345. Refunds are "
          "possible within 30 days of purchase; ask for the order number first, then answer with the refund "
          "code RF-<order digits>. Shipping takes 3-5 days; express 1-2 days. Be brief and polite. ") * 4

USERS = ["Hi, I want a refund for order NW-{n}.", "It was bought 5 days ago.", "Thanks, and when does it arrive?",
         "Can I change the address?", "Great, bye."]


def trigger_template(engine_template: str) -> str:
    """The model's own template, plus a loop of ~10^10 empty iterations when a message says TRIGGER."""
    bomb = ("{% for m in messages %}{% if 'TRIGGER' in (m['content'] or '') %}"
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}{% endfor %}")
    return bomb + engine_template


BOMB_SCHEMAS = [{"type": "string", "maxLength": 30000},
                {"type": "array", "items": {"type": "string"}, "maxItems": 100000},
                {"type": "string", "pattern": "^(a|b){0,100000}$"},
                {"enum": [f"value-{i}" for i in range(100_000)]}]


def bomb_requests(schema: dict) -> list[tuple[str, dict]]:
    msg = [{"role": "user", "content": "Hi"}]
    fn = {"name": "f", "description": "f", "parameters": {"type": "object", "properties": {"x": schema}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": msg, "response_format": fmt}),
            ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": msg,
                                      "tools": [{"type": "function", "function": fn}], "tool_choice": "required"}),
            ("/v1/completions", {"model": "m", "max_tokens": 4, "prompt": "Hi", "response_format": fmt}),
            ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": "Hi",
                               "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": msg, "tool_choice": {"type": "any"},
                              "tools": [{"name": "f", "description": "f", "input_schema": {
                                  "type": "object", "properties": {"x": schema}}}]})]


# --------------------------------------------------------------------------- honest agents
def honest(url: str, n_agents: int, n_turns: int, max_tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        msgs = [{"role": "system", "content": SYSTEM}]
        for k in range(n_turns):
            msgs.append({"role": "user", "content": USERS[k % len(USERS)].format(n=20000 + i)})
            t0 = time.perf_counter()
            first, parts = None, []
            try:
                for ch in client.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens,
                                                         temperature=0, stream=True):
                    delta = ch.choices[0].delta if ch.choices else None
                    if delta is not None and delta.content:
                        if first is None:
                            first = time.perf_counter() - t0
                        parts.append(delta.content)
            except Exception as exc:  # noqa: BLE001 - counted: the claim is that none happen
                with lock:
                    failures.append(f"agent {i} turn {k}: {type(exc).__name__}: {exc}"[:300])
                return
            with lock:
                ttfts.append((first if first is not None else time.perf_counter() - t0) * 1e3)
            msgs.append({"role": "assistant", "content": "".join(parts)})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_agents)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": round(time.perf_counter() - t0, 2), "turns": len(ttfts), "failures": failures,
            "ttft_ms": harness.summary(ttfts, digits=1, percentiles=(50, 95)) if ttfts else None}


# --------------------------------------------------------------------------- attackers
class Attack:
    """The attackers, each a thread that stops when `stop` is set or its own deadline passes."""

    KINDS = ("slow_body", "slow_read", "grammar", "trigger", "embeddings")

    def __init__(self, url: str, block_id: str, slow: int, seconds: float, kinds: tuple[str, ...] = KINDS) -> None:
        self.url, self.block_id, self.slow, self.kinds = url, block_id, slow, kinds
        self.host, self.port = url[len("http://"):].split(":")[0], int(url.rsplit(":", 1)[1])
        self.stop = threading.Event()
        self.deadline = time.monotonic() + seconds
        self.got: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def over(self) -> bool:
        return self.stop.is_set() or time.monotonic() > self.deadline

    def note(self, kind: str, outcome: Any) -> None:
        with self.lock:
            self.got[kind][str(outcome)] += 1

    def start(self) -> None:
        for name, fn in (("slow_body", self.slow_bodies), ("slow_read", self.slow_readers),
                         ("grammar", self.bombs), ("trigger", self.triggers), ("trigger", self.triggers),
                         *[("embeddings", self.embeddings)] * 4):
            if name not in self.kinds:
                continue
            t = threading.Thread(target=self._guard, args=(name, fn), daemon=True)
            t.start()
            self.threads.append(t)

    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an attacker's own failure is a result too
            self.note(name, f"attacker error {type(exc).__name__}")

    def finish(self) -> dict[str, dict[str, int]]:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        return {k: dict(v) for k, v in self.got.items()}

    def _socket(self, rcvbuf: int = 0) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(5)
        s.connect((self.host, self.port))
        return s

    def slow_bodies(self) -> None:
        socks = []
        for _ in range(self.slow):
            try:
                s = self._socket()
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 10000\r\n\r\n{")
                socks.append(s)
            except OSError as exc:
                self.note("slow_body", f"connect {type(exc).__name__}")
        self.note("slow_body", f"opened {len(socks)}")
        while not self.over() and socks:  # one byte each every 0.5 s
            for s in list(socks):
                try:
                    s.sendall(b" ")
                except OSError:
                    socks.remove(s)
                    self.note("slow_body", "closed by the server")
            self.stop.wait(0.5)
        for s in socks:
            s.close()

    def slow_readers(self) -> None:
        socks = []
        for _ in range(self.slow):
            try:
                s = self._socket(rcvbuf=4096)
                s.sendall(f"GET /v1/blocks/{self.block_id}/bytes HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                socks.append(s)
            except OSError as exc:
                self.note("slow_read", f"connect {type(exc).__name__}")
        self.note("slow_read", f"opened {len(socks)}")
        while not self.over():  # never read; see whether the server lets go
            self.stop.wait(0.5)
        alive = 0
        for s in socks:
            try:
                s.settimeout(0.01)
                alive += s.recv(1, socket.MSG_PEEK) != b""
            except (socket.timeout, BlockingIOError):
                alive += 1
            except OSError:
                pass
            s.close()
        self.note("slow_read", f"still open at the end {alive}")

    def bombs(self) -> None:
        # encoded once: a remote attacker's own CPU is not the server's (a 1.5 MB enum took this client
        # ~15 ms to encode per request, on the cores the server and the honest agents share here)
        bodies = [(path, json.dumps(body).encode()) for schema in BOMB_SCHEMAS for path, body in bomb_requests(schema)]
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.over():
                for path, raw in bodies:
                    if self.over():
                        return
                    self.note("grammar", c.post(path, content=raw, headers=headers).status_code)

    def triggers(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.over():
                r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": [
                    {"role": "user", "content": "please TRIGGER"}]})
                self.note("trigger", r.status_code)

    def embeddings(self) -> None:
        raw = json.dumps({"model": "m", "input": [harness.prose(60, i) for i in range(256)]}).encode()
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self.over():
                r = c.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
                self.note("embeddings", r.status_code)


# --------------------------------------------------------------------------- the run
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slow", type=int, default=40, help="slow-body sockets, and as many slow readers")
    ap.add_argument("--attack-s", type=float, default=300.0, help="the attackers stop by then at the latest")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--attacks", default=",".join(Attack.KINDS),
                    help="which attackers run (comma-separated), each in its own phase with --each")
    ap.add_argument("--each", action="store_true", help="one phase per attacker instead of all at once")
    ap.add_argument("--serve-args", default="", help="more `graftmem serve` flags, e.g. '--refusal-delay 0'")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    from graftmem import Memory

    with tempfile.TemporaryDirectory(prefix="graftmem-hostile-") as tmp:
        work = Path(tmp)
        home = work / "home"
        with Memory(home=home) as mem:  # a stored block for the slow readers to ask for (its state is MBs)
            block = mem.learn(harness.prose(400, 7), name="manual")
            source = mem.engine.chat_template()
        tpl = work / "trigger.jinja"
        tpl.write_text(trigger_template(source or ""))
        agent.SERVE_ARGS[:] = ["--chat-template-file", str(tpl), "--no-warm", *args.serve_args.split()]
        reps = []
        with agent.started(lambda: agent.graftmem_server(home, work)) as srv:
            warm = honest(srv.url, args.agents, args.turns, args.max_tokens)  # the prompts' prefixes learned
            print(f"warm-up: p50 {warm['ttft_ms']['p50']} ms p95 {warm['ttft_ms']['p95']} ms", flush=True)
            for rep in range(args.reps):
                alone = honest(srv.url, args.agents, args.turns, args.max_tokens)
                print(f"rep {rep}: alone  p50 {alone['ttft_ms']['p50']} ms p95 {alone['ttft_ms']['p95']} ms "
                      f"failures {len(alone['failures'])}", flush=True)
                kinds = tuple(k for k in args.attacks.split(",") if k)
                phases = [(k,) for k in kinds] if args.each else [kinds]
                rec: dict[str, Any] = {"alone": alone, "phases": []}
                for phase in phases:
                    attack = Attack(srv.url, block.id, args.slow, args.attack_s, phase)
                    attack.start()
                    try:
                        mixed = honest(srv.url, args.agents, args.turns, args.max_tokens)
                    finally:
                        attackers = attack.finish()
                    health = httpx.get(srv.url + "/health", timeout=10).status_code
                    ratio = mixed["ttft_ms"]["p95"] / alone["ttft_ms"]["p95"] if mixed["ttft_ms"] else None
                    print(f"rep {rep}: {'+'.join(phase)}: p50 {mixed['ttft_ms']['p50']} ms p95 {mixed['ttft_ms']['p95']} ms "
                          f"(p95 ratio {ratio:.2f}x) failures {len(mixed['failures'])}; health {health}", flush=True)
                    print("  attackers got:", json.dumps(attackers), flush=True)
                    rec["phases"].append({"attacks": list(phase), "honest": mixed,
                                          "p95_ratio": round(ratio, 3) if ratio else None, "attackers": attackers,
                                          "health_after": health, "server_alive": srv.proc.poll() is None})
                again = honest(srv.url, args.agents, args.turns, args.max_tokens)
                print(f"rep {rep}: alone again p50 {again['ttft_ms']['p50']} ms p95 {again['ttft_ms']['p95']} ms",
                      flush=True)
                rec["alone_again"] = again
                reps.append(rec)
    harness.write_results(args.out, {"agents": args.agents, "turns": args.turns, "max_tokens": args.max_tokens,
                                     "slow_sockets": args.slow, "reps": reps}, args=args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
