"""A fleet of `graftmem serve` workers behind the gateways people run (issue 42), on loopback: one
SeaweedFS, 3 workers (1 llama.cpp thread each) sharing its bucket, in front of them the Shepherd Model
Gateway (``smg``, cache-aware policy) or HAProxy (round-robin, or a hash of a session header), against
one worker alone. 8 agents x 5 turns, the agents sharing 2 system prompts; per turn: the worker that
answered (``X-Graftmem-Worker``), the receipt's source (ram / store / bucket / cold), cached tokens, TTFT
(first content chunk of a streamed answer). After the agents' ``--kill-after`` turns one worker (the
one that served most of them) is killed with -9: the gateway's retry has to carry every request on,
and every answer is compared with the single worker's.

    python -m bench.fleet_gateway [--model smollm2] [--agents 8] [--turns 5] [--engines 1] [--out bench/results/fleet_gateway.json]

Each arrangement gets workers started afresh on a bucket prefix of its own (nothing learned in one
run helps another). Afterwards every block of every prefix is read and verified (`FleetStore.read_state`:
header, trailer, id, fingerprint, BLAKE3). The gateways' command lines are in the results (``commands``),
as docs/fleet.md copies them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from bench.harness import RESULTS, summary, write_results
from graftmem import FleetStore
from tests.conftest import long_text
from tests.seaweed import BUCKET, Seaweed, free_port

ROOT = Path(__file__).resolve().parent.parent
SESSION_HEADER = "X-Session-Id"
WORKER_HEADER = "X-Graftmem-Worker"  #: the answering worker, on every response (docs/fleet.md)
QUESTIONS = ["What should I check first?", "And after that?", "Which of those matters most?",
             "What could go wrong there?", "Summarise it in one line."]

HAPROXY_CFG = """global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
frontend rr
    bind 127.0.0.1:{rr}
    default_backend workers_rr
frontend hash
    bind 127.0.0.1:{hash}
    default_backend workers_hash
backend workers_rr
    balance roundrobin
{servers}
backend workers_hash
    balance hdr({header})
    hash-type consistent
{servers}
"""


class Worker:
    def __init__(self, root: Path, name: str, url: str, model: str, env: dict[str, str], min_prefix: int,
                 engines: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = root / f"{name}.log"
        wenv = {**env, "XDG_CACHE_HOME": str(root / f"cache-{name}"), "GRAFTMEM_HOME": str(root / f"home-{name}"),
                "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        self.cmd = [sys.executable, "-m", "graftmem", "serve", "--port", str(self.port), "--store", url, "--model", model,
                    "--config", '{"n_threads": 1, "n_ctx": 4096}', "--no-warm",
                    "--min-prefix-tokens", str(min_prefix), "--engines", str(engines)]
        self.proc = subprocess.Popen(self.cmd, env=wenv, cwd=ROOT, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.id: Optional[str] = None

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200:
                    self.id = r.headers[WORKER_HEADER]
                    self.model_id = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"worker {self.name} not ready in {timeout} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_smg(root: Path, workers: list[Worker], sticky: bool = False) -> tuple[subprocess.Popen, str, list[str]]:
    """SMG's cache-aware policy; ``sticky``: round-robin for a session's first request, then every request
    with its ``X-Session-Id`` pinned to that worker (SMG's sticky sessions)."""
    port, prom = free_port(), free_port()
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    policy = ["--policy", "round_robin", "--sticky-sessions", "--routing-key-headers", SESSION_HEADER] if sticky \
        else ["--policy", "cache_aware"]
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[w.url for w in workers],
           *policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
           "--health-check-interval-secs", "2", "--retry-max-retries", "3"]
    proc = subprocess.Popen(cmd, stdout=open(root / "smg.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until every worker is registered (GET /workers lists them)
        try:
            r = httpx.get(f"{url}/workers", timeout=2)
            if r.status_code == 200 and len(r.json().get("workers", [])) >= len(workers):
                return proc, url, cmd
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"smg did not register the workers:\n{(root / 'smg.log').read_text()[-3000:]}")


def start_haproxy(root: Path, workers: list[Worker]) -> tuple[subprocess.Popen, dict[str, str], str]:
    rr, hsh = free_port(), free_port()
    servers = "\n".join(f"    server {w.name} 127.0.0.1:{w.port} check inter 1s fall 2 rise 2" for w in workers)
    cfg = HAPROXY_CFG.format(rr=rr, hash=hsh, servers=servers, header=SESSION_HEADER)
    path = root / "haproxy.cfg"
    path.write_text(cfg)
    proc = subprocess.Popen(["haproxy", "-f", str(path), "-db"], stdout=open(root / "haproxy.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    urls = {"rr": f"http://127.0.0.1:{rr}", "hash": f"http://127.0.0.1:{hsh}"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if all(httpx.get(f"{u}/health", timeout=2).status_code == 200 for u in urls.values()):
                return proc, urls, cfg
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("haproxy did not come up")


def source_of(receipt: dict[str, Any]) -> str:
    if receipt.get("source") == "store" and receipt.get("fetch_ms"):
        return "bucket"
    return receipt.get("source") or "cold"


def turn(client: httpx.Client, url: str, model: str, messages: list[dict], session: str, max_tokens: int) -> dict[str, Any]:
    """One streamed turn: answer, TTFT, worker, receipt; ``error`` instead when it failed."""
    t0 = time.perf_counter()
    ttft, text, receipt, usage = None, [], {}, {}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", headers={SESSION_HEADER: session},
                           json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                 "stream": True, "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
            worker = r.headers.get(WORKER_HEADER)
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = (time.perf_counter() - t0) * 1e3
                        text.append(piece)
                receipt = chunk.get("graftmem") or receipt
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"answer": "".join(text), "ttft_ms": round(ttft if ttft is not None else (time.perf_counter() - t0) * 1e3, 1),
            "worker": worker, "source": source_of(receipt),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens")}


def run_agents(url: str, model: str, systems: list[str], args: argparse.Namespace, on_kill=None) -> list[dict[str, Any]]:
    """Every agent's turn t, agent by agent, then turn t + 1; after turn ``kill_after``, ``on_kill(rows)``."""
    convs = {a: [{"role": "system", "content": systems[a % len(systems)]}] for a in range(args.agents)}
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=600) as client:
        for t in range(args.turns):
            if on_kill is not None and t == args.kill_after:
                rows.append({"event": "kill", **on_kill(rows)})
            for a in range(args.agents):
                convs[a].append({"role": "user", "content": f"Agent {a}: {QUESTIONS[t % len(QUESTIONS)]}"})
                got = turn(client, url, model, convs[a], f"agent-{a}", args.max_tokens)
                rows.append({"agent": a, "turn": t + 1, **got})
                print(f"  agent {a} turn {t + 1}: {got.get('worker', '-')} {got.get('source', got.get('error'))} "
                      f"cached {got.get('cached_tokens')} ttft {got.get('ttft_ms')} ms", flush=True)
                convs[a].append({"role": "assistant", "content": got.get("answer", "")})
    return rows


def kill_busiest(workers: list[Worker]):
    def kill(rows: list[dict[str, Any]]) -> dict[str, Any]:
        served = collections.Counter(r.get("worker") for r in rows if r.get("worker"))
        victim = max(workers, key=lambda w: served.get(w.id, 0))
        victim.kill()
        print(f"  killed {victim.name} ({victim.id}), which served {served.get(victim.id, 0)} turns", flush=True)
        return {"worker": victim.id, "served_before": served.get(victim.id, 0)}
    return kill


def verify(url: str, root: Path) -> dict[str, Any]:
    store = FleetStore(url, cache_dir=root / "verify", poll_interval=0)
    try:
        blocks = store.list()
        bad = []
        for b in blocks:
            try:
                store.read_state(b.id, lambda n: memoryview(bytearray(n)))
            except Exception as exc:  # noqa: BLE001 - reported, counted
                bad.append(f"{b.short_id}: {exc}")
        return {"blocks": len(blocks), "damaged": bad}
    finally:
        store.close()


def table(rows: list[dict[str, Any]], reference: Optional[dict[tuple[int, int], str]]) -> dict[str, Any]:
    turns = [r for r in rows if "agent" in r]
    later = [r for r in turns if r["turn"] >= 2]
    failed = [r for r in turns if "error" in r]
    sources = collections.Counter(r.get("source", "error") for r in later)
    kill = next((i for i, r in enumerate(rows) if r.get("event") == "kill"), None)
    # turns 2..kill_after: a session on its own worker (before the kill)
    before = [r for r in (rows[:kill] if kill is not None else rows) if "agent" in r and r["turn"] >= 2]
    # turns 2+ on the worker that served the agent's previous turn ("on their worker": a turn moved by the
    # gateway or by the kill cannot find its cells in RAM, whatever the worker does)
    last: dict[int, dict[str, Any]] = {}
    stayed, whole = [], 0
    for r in turns:
        prev = last.get(r["agent"], {})
        if r["turn"] >= 2 and r.get("worker") is not None and r.get("worker") == prev.get("worker"):
            stayed.append(r)
        # a RAM hit that restored the agent's previous prompt (all but its last few tokens: the generation
        # header), not only the system prompt the agents share
        if r.get("source") == "ram" and r.get("cached_tokens", 0) >= (prev.get("prompt_tokens") or 1 << 30) - 8:
            whole += 1
        last[r["agent"]] = r
    out = {"turns": len(turns), "failed": len(failed), "sources_turns_2_plus": dict(sources),
           "ram_share_turns_2_plus_before_kill": round(sum(r.get("source") == "ram" for r in before) / max(1, len(before)), 3),
           "turns_2_plus_on_previous_worker": len(stayed),
           "ram_share_turns_2_plus_on_previous_worker": round(sum(r.get("source") == "ram" for r in stayed) / max(1, len(stayed)), 3),
           "ram_with_previous_prompt_turns_2_plus": whole,
           "cold_after_first_sighting": sum(1 for r in later if r.get("source") == "cold"),
           "workers_used": len({r.get("worker") for r in turns if r.get("worker")}),
           "ttft_ms": summary([r["ttft_ms"] for r in turns if "ttft_ms" in r] or [float("nan")], digits=1),
           "ttft_ms_turns_2_plus": summary([r["ttft_ms"] for r in later if "ttft_ms" in r] or [float("nan")], digits=1),
           "cached_tokens_turns_2_plus": sum(r.get("cached_tokens", 0) for r in later)}
    if reference is not None:
        same = [reference.get((r["agent"], r["turn"])) == r.get("answer") for r in turns]
        out["answers_equal_single"] = f"{sum(same)}/{len(same)}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=3, help="kill a worker after this many turns of every agent")
    ap.add_argument("--system-words", type=int, default=300, help="words per system prompt (~1.3 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--engines", type=int, default=1,
                    help="engine contexts per worker (serve --engines; each 1 thread): the sessions whose cells stay in RAM")
    ap.add_argument("--min-prefix-tokens", type=int, default=256, help="the workers' serve --min-prefix-tokens")
    ap.add_argument("--only", nargs="*", default=["single", "smg", "haproxy-rr", "haproxy-hash"])
    ap.add_argument("--out", default=str(RESULTS / "fleet_gateway.json"))
    args = ap.parse_args()
    if shutil.which("haproxy") is None:
        print("haproxy is missing: apt-get install haproxy", file=sys.stderr)
        return 2
    systems = [f"You are support agent {i} of the fleet. " + long_text(args.system_words, seed=700 + i) for i in range(2)]
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="graftmem-fleet-gw-"))
    results: dict[str, Any] = {"runs": {}, "commands": {}}
    sw = Seaweed(tmp / "seaweed").start()
    env = {**os.environ, **sw.env()}
    os.environ.update(sw.env())
    reference: Optional[dict[tuple[int, int], str]] = None
    try:
        for name in args.only:
            root = tmp / name
            root.mkdir()
            url = f"s3://{BUCKET}/{name}"
            n = 1 if name == "single" else args.workers
            workers = [Worker(root, f"w{i}", url, args.model, env, args.min_prefix_tokens, args.engines) for i in range(n)]
            gateway: Optional[subprocess.Popen] = None
            try:
                for w in workers:
                    w.wait()
                results["commands"]["worker"] = " ".join(workers[0].cmd[1:]).replace(str(ROOT), ".")
                if name == "single":
                    target, kill = workers[0].url, None
                elif name in ("smg", "smg-sticky"):
                    gateway, target, cmd = start_smg(root, workers, sticky=name == "smg-sticky")
                    results["commands"][name] = " ".join(["smg", *cmd[1:]])
                    kill = kill_busiest(workers)
                else:
                    gateway, urls, cfg = start_haproxy(root, workers)
                    results["commands"]["haproxy.cfg"] = cfg
                    target, kill = urls["rr" if name == "haproxy-rr" else "hash"], kill_busiest(workers)
                print(f"{name}: {n} worker(s) behind {target}", flush=True)
                t0 = time.perf_counter()
                rows = run_agents(target, workers[0].model_id, systems, args, kill)
                took = time.perf_counter() - t0
            finally:
                if gateway is not None:
                    gateway.terminate()
                    gateway.wait(timeout=20)
                for w in workers:
                    w.stop()
            if name == "single":
                reference = {(r["agent"], r["turn"]): r.get("answer") for r in rows if "agent" in r}
            results["runs"][name] = {"summary": {**table(rows, None if name == "single" else reference),
                                                 "seconds": round(took, 1), **verify(url, root)},
                                     "rows": rows}
            print(json.dumps(results["runs"][name]["summary"]), flush=True)
    finally:
        sw.stop()
    results["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    results["machine"] = {"loadavg_before": load0, "loadavg_after": os.getloadavg()}
    path = write_results(args.out, results, args=args)
    print(f"wrote {path}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
