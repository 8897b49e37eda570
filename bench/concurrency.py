"""Many agents at once (issue #26 item 3): N concurrent sessions of bench/serve.py's 5-turn agent,
graftmem serve (``--engines E``) next to llama-server (``-np N``, continuous batching), in the same run,
interleaved.

Each agent is the same support agent (the ~3,000-token system prompt with tools of bench/serve.py)
with its own order number, so the N conversations share the system prompt and differ from the first
user turn on, as N users of one agent do. Agent i starts ``--stagger-ms x i`` after the first and
sends its turns one after another (streaming, greedy, ``--max-tokens`` each), through the official
``openai`` client. Per (server, N): aggregate generated tokens per second (completion tokens of every
turn over the wall time from the first request to the last answer), p50 / p95 time to first token over
every turn, and whether each answer equals the same request served alone (one request at a time on a
one-engine / one-slot server of the same kind, computed once per kind in the same run): graftmem's must,
llama-server's is reported. Each (server, N) runs in a fresh process (graftmem on an empty home); the
order of the two servers alternates per N and rep (the machines are shared and noisy).

    python -m bench.concurrency [--agents 1,4,8,16] [--engines same] [--turns 5] [--words 2000]
    python -m bench.concurrency --agents 1,4 --turns 2 --words 300 --reps 1   # a smoke run
    python -m bench.concurrency --rss 4 --baseline /tmp/before   # RSS of 4 engines, this tree and another

Threads: llama-server runs one process with every usable core (``-t C``); graftmem ``--engines E``
sizes each engine's prefill to ``C // E`` threads and decodes on ``C`` (the pool's rule, logged at start: a
one-token call's bytes depend on its thread count, docs/exactness.md). Results go to
``bench/results/concurrency.json`` with the command, the git commit and the machine (lscpu).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import openai

from bench import harness
from bench import peer as cpp_peer  # builds / finds llama-server
from bench import serve as agent  # the agent, the server processes
from graftmem.core import EngineConfig, resolve_model, usable_cores

ORDER = "48213"  # the order number of bench/serve.py's conversation; agent i uses ORDER + i


def agent_requests(system: str, i: int, n_turns: int) -> list[list[dict[str, str]]]:
    """The first ``n_turns`` requests of agent ``i``: bench/serve.py's conversation with its own order id."""
    own = str(int(ORDER) + i)
    return [[{**m, "content": m["content"].replace(ORDER, own)} for m in msgs]
            for msgs in agent.turns(system)[:n_turns]]


def turn(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int, extra: dict) -> dict[str, Any]:
    """One streamed greedy turn: time to the first content delta, the text, the completion tokens the
    server counted (``stream_options.include_usage``) and graftmem's receipt where there is one."""
    t0 = time.perf_counter()
    first, parts, usage, receipt = None, [], None, None
    for ch in client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=extra):
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        usage = ch.usage or usage
        receipt = (ch.model_extra or {}).get("graftmem") or receipt
    end = time.perf_counter() - t0
    rc = receipt or {}
    return {"t_start": t0, "ttft_ms": round((first if first is not None else end) * 1e3, 2),
            "total_ms": round(end * 1e3, 2), "text": "".join(parts),
            # a server that sends no usage: its content chunks (one token each in both servers' streams)
            "completion_tokens": usage.completion_tokens if usage else len(parts),
            "cached_tokens": rc.get("tokens_restored"), "source": rc.get("source")}


def run_agents(url: str, requests: list[list[list[dict]]], max_tokens: int, stagger_s: float,
               extra: dict) -> dict[str, Any]:
    """Every agent in its own thread, agent i starting ``i x stagger_s`` after the first; its turns in order."""
    results: list[list[dict[str, Any]]] = [[] for _ in requests]
    errors: list[str] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        threading.Event().wait(max(0.0, t0 + i * stagger_s - time.perf_counter()))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        try:
            for msgs in requests[i]:
                results[i].append(turn(client, msgs, max_tokens, extra))
        except Exception as exc:  # reported in the JSON, never hidden
            errors.append(f"agent {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [t for r in results for t in r]
    ttft = harness.summary([t["ttft_ms"] for t in flat], digits=1, percentiles=(50, 95)) if flat else {}
    tokens = sum(t["completion_tokens"] or 0 for t in flat)
    return {"wall_s": round(wall, 2), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 3) if wall else None,
            "ttft_p50_ms": ttft.get("p50"), "ttft_p95_ms": ttft.get("p95"),
            "errors": errors, "agents": results}


def alone(url: str, requests: list[list[list[dict]]], max_tokens: int, extra: dict) -> list[list[str]]:
    """Each request served alone: one at a time, in agent then turn order."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    return [[turn(client, msgs, max_tokens, extra)["text"] for msgs in reqs] for reqs in requests]


_RSS_CHILD = """
import json, sys
from graftmem.core.engine import Engine  # the tree under test: PYTHONPATH

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

base = rss_mb()
engines = [Engine("smollm2", {"probe": False})]
one = rss_mb()
engines += [Engine("smollm2", {"probe": False}) for _ in range(int(sys.argv[2]) - 1)]
for e in engines:
    with e.session():
        e.prefill(e.tokenize("hello world " * 20))
print(json.dumps({"rss_1_engine_mb": round(one - base), "rss_n_engines_mb": round(rss_mb() - base),
                  "model_handles": len({getattr(e, "model_handle", id(e)) for e in engines})}))
"""


def engines_rss(n: int, src: Path) -> dict[str, Any]:
    """RSS growth of a process that opens 1, then ``n`` SmolLM2 engines (default settings, each prefilling
    40 tokens) with the graftmem under ``src``, and how many loaded models they use (one per engine
    before the shared model; a tree without ``Engine.model_handle`` counts as one per engine)."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(src), str(n)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(src)},
                         timeout=600, check=True)
    return {"engines": n, "src": str(src), **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="1,4,8,16", help="concurrent agent counts, comma-separated")
    ap.add_argument("--engines", default="same", help="graftmem serve --engines for N agents: 'same' (N) or a number "
                    "(capped at N)")
    ap.add_argument("--parallel", default="same", help="llama-server -np for N agents: 'same' (N) or a number")
    ap.add_argument("--turns", type=int, default=5, help="turns per agent (at most 5)")
    ap.add_argument("--words", type=int, default=2000, help="manual words in the system prompt (2000: ~3,000 tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per turn")
    ap.add_argument("--stagger-ms", type=float, default=500.0, help="agent i starts i x this after agent 0")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--only", default="graftmem,llama-server")
    ap.add_argument("--out", default=str(harness.RESULTS / "concurrency.json"))
    ap.add_argument("--rss", type=int, default=0, metavar="N", help="only measure the RSS of N engines in one "
                    "process (and with --baseline DIR, of another source tree too), print it and exit")
    ap.add_argument("--baseline", default=None, help="with --rss: another graftmem source tree to compare")
    args = ap.parse_args()
    if args.rss:
        for src in [agent.ROOT] + ([Path(args.baseline).resolve()] if args.baseline else []):
            print(json.dumps(engines_rss(args.rss, src)))
        return
    counts = [int(x) for x in args.agents.split(",") if x.strip()]
    if not counts or min(counts) < 1 or not 1 <= args.turns <= len(agent.USER_TURNS):
        ap.error(f"--agents needs counts >= 1 and --turns 1..{len(agent.USER_TURNS)}")
    only = set(args.only.split(","))
    cfg = EngineConfig()
    cores = usable_cores()
    _, model = resolve_model("smollm2")
    work = Path(tempfile.mkdtemp(prefix="graftmem-bench-concurrency-"))
    system = agent.system_prompt(args.words)
    reqs = [agent_requests(system, i, args.turns) for i in range(max(counts))]
    notes: dict[str, str] = {}
    exe: Optional[Path] = None
    if "llama-server" in only:
        try:
            exe = cpp_peer.build()
        except cpp_peer.PeerUnavailable as exc:
            notes["llama-server"] = f"unavailable: {exc}"
            only.discard("llama-server")

    def pick(choice: str, n: int) -> int:
        return n if choice == "same" else max(1, min(n, int(choice)))

    def graftmem(n: int) -> Callable[[], agent.Proc]:
        def start() -> agent.Proc:
            agent.SERVE_ARGS[:] = ["--engines", str(pick(args.engines, n))]
            return agent.graftmem_server(work / f"home-{time.time_ns()}", work)
        return start

    def llama(n: int) -> Callable[[], agent.Proc]:
        assert exe is not None
        return lambda: agent.llama_server(exe, model, cfg, cores, work, parallel=pick(args.parallel, n))

    servers = {"graftmem": (graftmem, {}), "llama-server": (llama, {"cache_prompt": True})}
    servers = {k: v for k, v in servers.items() if k in only}
    load_before = os.getloadavg()
    t_start = time.time()
    rss = engines_rss(max(counts), agent.ROOT) if "graftmem" in servers else None
    reference: dict[str, list[list[str]]] = {}
    for name, (factory, extra) in servers.items():  # each request alone, on one engine / one slot
        t0 = time.time()
        with agent.started(factory(1)) as s:
            reference[name] = alone(s.url, reqs, args.max_tokens, extra)
        print(f"{name}: {len(reqs) * args.turns} requests alone in {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
    runs: list[dict[str, Any]] = []
    names = list(servers)
    k = 0
    for n in counts:
        for rep in range(args.reps):
            for name in names[k % len(names):] + names[:k % len(names)]:
                factory, extra = servers[name]
                t0 = time.time()
                try:
                    with agent.started(factory(n)) as s:
                        r = run_agents(s.url, reqs[:n], args.max_tokens, args.stagger_ms / 1e3, extra)
                        startup = round(s.startup_s, 2)
                except cpp_peer.PeerUnavailable as exc:
                    notes[f"{name} x{n}"] = f"failed: {exc}"
                    continue
                texts = [[t["text"] for t in a] for a in r["agents"]]
                same = [t == ref for a, refs in zip(texts, reference[name]) for t, ref in zip(a, refs)]
                r.update({"server": name, "agents_n": n, "rep": rep, "startup_s": startup,
                          "engines_or_slots": pick(args.engines if name == "graftmem" else args.parallel, n),
                          "answers_equal_alone": f"{sum(same)}/{len(same)}", "all_equal_alone": all(same)})
                runs.append(r)
                print(f"{name:<13} {n:>3} agents: {r['tokens_per_s']} tok/s, TTFT p50 {r['ttft_p50_ms']} ms "
                      f"p95 {r['ttft_p95_ms']} ms, equal alone {r['answers_equal_alone']}"
                      f"{', errors ' + str(len(r['errors'])) if r['errors'] else ''} ({time.time() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
            k += 1

    summary: dict[str, dict[str, Any]] = {}
    for n in counts:
        row: dict[str, Any] = {}
        for name in names:
            mine = [r for r in runs if r["server"] == name and r["agents_n"] == n]
            if mine:
                row[name] = {"tokens_per_s": harness.summary(r["tokens_per_s"] for r in mine)["median"],
                             "ttft_p50_ms": harness.summary(r["ttft_p50_ms"] for r in mine)["median"],
                             "ttft_p95_ms": harness.summary(r["ttft_p95_ms"] for r in mine)["median"],
                             "all_equal_alone": all(r["all_equal_alone"] for r in mine),
                             "errors": sum(len(r["errors"]) for r in mine)}
        if "graftmem" in row and "llama-server" in row:
            g, ls = row["graftmem"], row["llama-server"]
            row["ratios"] = {
                "tokens_per_s graftmem / llama-server (target >= 0.8)":
                    round(g["tokens_per_s"] / ls["tokens_per_s"], 2) if ls["tokens_per_s"] else None,
                "ttft_p95 graftmem / llama-server (target <= 1.5)":
                    round(g["ttft_p95_ms"] / ls["ttft_p95_ms"], 2) if ls["ttft_p95_ms"] else None}
        summary[str(n)] = row
    out = {
        "machine": {"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1)", "engine": cfg.model_dump(), "usable_cores": cores,
        "agents": counts, "turns": args.turns, "system_words": args.words, "max_tokens": args.max_tokens,
        "stagger_ms": args.stagger_ms, "reps": args.reps, "engines": args.engines, "parallel": args.parallel,
        "reference": "each request alone: one at a time on a one-engine graftmem / one-slot llama-server",
        "wall_s": round(time.time() - t_start, 1), "summary": summary, "notes": notes, "graftmem_engines_rss": rss,
        "llama_server_build": cpp_peer.build_record(),
        "runs": [{**{k: v for k, v in r.items() if k != "agents"},
                  "turns": [[{kk: t[kk] for kk in ("ttft_ms", "total_ms", "completion_tokens", "cached_tokens",
                                                  "source") if t.get(kk) is not None} for t in a]
                            for a in r["agents"]]} for r in runs],
    }
    harness.write_results(args.out, out, args=args)
    print(f"{'agents':>6} {'server':<13}{'tok/s':>9}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}  equal alone")
    for n, row in summary.items():
        for name in names:
            if name in row:
                v = row[name]
                print(f"{n:>6} {name:<13}{v['tokens_per_s']:>9.2f}{v['ttft_p50_ms']:>13.0f}{v['ttft_p95_ms']:>13.0f}"
                      f"  {v['all_equal_alone']}")
        if "ratios" in row:
            print(f"{'':>6} ratios: {row['ratios']}")
    print(f"wrote {args.out}; notes: {notes}")


if __name__ == "__main__":
    main()
