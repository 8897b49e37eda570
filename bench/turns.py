"""Per-turn time to first token of a 5-turn agent, graftmem next to llama-server, seen by a PLAIN client.

bench/serve.py measures through the ``openai`` package with one client per session; its figures were not
reproduced by a plain streaming client (issue #44). This bench is that plain client: ``httpx``, one
``POST /v1/chat/completions`` with ``"stream": true`` per turn, and the time from sending the request to
the first SSE chunk whose ``delta.content`` is not empty (the first content byte the user sees). Two
ways to connect, both measured:

* ``fresh``: a new connection (a new ``httpx.Client``) for every turn, as a script that calls ``curl``
  or a client without a pool does;
* ``keep``: one ``httpx.Client`` for the whole session, its connection kept alive between turns. A
  server that closes an idle kept-alive connection makes the client reconnect; when a request fails
  on a connection the server had closed ("Server disconnected without sending a response", seen on
  llama-server's cpp-httplib), it is sent again on a new one and the time counts from the first try
  (``retries`` in the JSON says how often).

The agent is bench/serve.py's (a support manual plus four tool descriptions in the system prompt,
``--words`` sized to ~2,900 tokens on SmolLM2, and 5 scripted turns with tool calls and tool results as
text), ``--max-tokens`` (16) greedy tokens per answer, so both servers see the same token ids turn after
turn; the answers are compared.

Sessions, per rep and per connection way:

* graftmem ``first``: ``graftmem serve`` on a new, empty home; ``restart``: a new ``graftmem serve``
  process on the home the first session left (the model is loaded again; the blocks persist);
* llama-server ``first``: a new process (bench/serve.py's flags: one slot, the engine's n_ctx, batch,
  ubatch, threads, flash attention, the same weight buffers); ``warm``: the same process, a second
  session, whose slot (and RAM prompt cache) still holds the first session's last turn. After a restart
  llama-server has nothing: its warm slot is the bar graftmem's restart is held to.

Only one server runs at a time (a server's background work, graftmem's block writer, must not land in
the other's turns); the order of the servers rotates per rep and per connection way, and the JSON
keeps every sample, the load average around every session and each server's own account of a turn
(graftmem's receipt: tokens restored and prefilled, prefill ms; llama-server's ``timings``: ``cache_n``,
``prompt_n``, ``prompt_ms``), so the time outside the prefill (the request path) is read per turn.

Every session starts ``--pause`` seconds (2) after the previous one ended, the restart's and the warm
slot's alike. Why: a restarted server always meets its first request after an idle gap, while
llama-server's warm session used to start the instant its first one ended; and on this VM (2-core AMD
EPYC, Firecracker) the gap is not free: with graftmem's short OpenMP spin (``GOMP_SPINCOUNT=1000``) a
one-token decode at 2,885 cached tokens took 26-51 ms instead of 12-14 ms once the process had idled
(ad-hoc probes; with libgomp's default spin 13-15 ms), docs/benchmarks.md "After an idle gap". The same
pause before both makes the restart's turn 1 and the warm slot's turn 1 the same kind of call.

    python -m bench.turns [--reps 2] [--ways fresh,keep] [--words 2300] [--max-tokens 16] [--pause 2]
                          [--out bench/results/turns.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from bench import peer as cpp_peer
from bench import serve as serve_bench
from bench.harness import RESULTS, summary, write_results
from graftmem.core import EngineConfig, usable_cores


def turn(url: str, messages: list[dict[str, str]], max_tokens: int, client: Optional[httpx.Client]) -> dict[str, Any]:
    """One streamed Chat Completions request: ms from sending it to the first content byte, the text,
    and the server's own account of the prompt (graftmem's receipt, llama-server's ``timings``).
    ``client`` None: a fresh connection for this request alone."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    own = client is None
    retries = 0
    t0 = time.perf_counter()
    while True:
        c = httpx.Client(timeout=600) if own else client
        assert c is not None
        first: Optional[float] = None
        parts: list[str] = []
        receipt, timings = None, None
        try:
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    ch = json.loads(data)
                    for choice in ch.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if first is None:
                                first = time.perf_counter() - t0
                            parts.append(text)
                    receipt = ch.get("graftmem") or receipt
                    timings = ch.get("timings") or timings
            break
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # a kept-alive connection the server had closed: send again on a new one (what clients do)
            if own or retries >= 2 or first is not None:
                raise
            retries += 1  # the pool drops the broken connection and opens a new one
            print(f"   (reconnect after {type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        finally:
            if own:
                c.close()
    end = time.perf_counter() - t0
    out: dict[str, Any] = {"ttft_ms": round((first if first is not None else end) * 1e3, 2),
                           "total_ms": round(end * 1e3, 2), "text": "".join(parts), "retries": retries}
    if receipt:
        out.update(cached=receipt.get("tokens_restored"), prefilled=receipt.get("tokens_prefilled"),
                   prefill_ms=receipt.get("prefill_ms"), restore_ms=receipt.get("restore_ms"),
                   source=receipt.get("source"))
    elif timings:
        out.update(cached=timings.get("cache_n"), prefilled=timings.get("prompt_n"),
                   prefill_ms=timings.get("prompt_ms"))
    return out


PAUSE = [2.0]  #: seconds of idle before every session (``--pause``)


def session(url: str, reqs: list[list[dict[str, str]]], max_tokens: int, way: str) -> dict[str, Any]:
    """The 5 turns back to back (an agent sends its next request as soon as it has the answer), after
    the same idle pause for every session (the module doc says why)."""
    time.sleep(PAUSE[0])
    load = os.getloadavg()[0]
    client = httpx.Client(timeout=600) if way == "keep" else None
    try:
        turns = [turn(url, msgs, max_tokens, client) for msgs in reqs]
    finally:
        if client is not None:
            client.close()
    return {"load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2), "turns": turns}


def run_graftmem(work: Path, rep: int, way: str, reqs: list, max_tokens: int) -> dict[str, Any]:
    home = work / f"home-{way}-{rep}"
    out = {}
    for phase in ("first", "restart"):
        with serve_bench.started(lambda: serve_bench.graftmem_server(home, work)) as s:
            out[phase] = session(s.url, reqs, max_tokens, way)
            out[phase]["startup_s"] = round(s.startup_s, 2)
    return out


def run_llama_server(exe: Path, cfg: EngineConfig, threads: int, work: Path, way: str, reqs: list,
                     max_tokens: int) -> dict[str, Any]:
    out = {}
    with serve_bench.started(lambda: serve_bench.llama_server(exe, serve_bench.MODEL[0], cfg, threads, work)) as s:
        for phase in ("first", "warm"):
            out[phase] = session(s.url, reqs, max_tokens, way)
        out["first"]["startup_s"] = round(s.startup_s, 2)
    return out


def per_turn(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = len(sessions[0]["turns"])
    return [summary([s["turns"][i]["ttft_ms"] for s in sessions], digits=1) for i in range(n)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ways", default="fresh,keep", help="fresh (a connection per turn), keep (kept alive), or both")
    ap.add_argument("--words", type=int, default=2300, help="manual words in the system prompt (2300: a 2,857-token system prompt on SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds of idle before every session (the same for "
                    "a restarted graftmem and llama-server's warm slot)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--only", default="graftmem,llama-server")
    ap.add_argument("--out", default=str(RESULTS / "turns.json"))
    args = ap.parse_args(argv)
    PAUSE[0] = args.pause
    ways = [w for w in args.ways.split(",") if w]
    if not set(ways) <= {"fresh", "keep"}:
        raise SystemExit(f"--ways: fresh and/or keep, got {args.ways!r}")
    only = args.only.split(",")
    cfg = EngineConfig()
    threads = cfg.n_threads or usable_cores()
    name, model, note = serve_bench.bench_model(args.model)
    serve_bench.MODEL[:] = [model]
    reqs = serve_bench.turns(serve_bench.system_prompt(args.words))
    exe = cpp_peer.build() if "llama-server" in only else None
    work = Path(tempfile.mkdtemp(prefix="graftmem-bench-turns-"))
    res: dict[str, dict[str, list]] = {w: {"graftmem_first": [], "graftmem_restart": [], "llama_first": [],
                                           "llama_warm": []} for w in ways}
    load0, t_start = os.getloadavg(), time.time()
    def report(done_reps: int) -> None:
        table: dict[str, Any] = {}
        for way in ways:
            d = {key: per_turn(v) for key, v in res[way].items() if v}
            ratios: dict[str, Any] = {}
            for a, b, label in (("graftmem_first", "llama_first", "first session: graftmem / llama-server (target <= 1.2)"),
                                ("graftmem_restart", "llama_warm",
                                 "after a restart: graftmem / llama-server's warm slot (target <= 1.0)")):
                if a in d and b in d:
                    ratios[label] = {
                        "of_medians": [round(x["median"] / y["median"], 2) for x, y in zip(d[a], d[b])],
                        # paired per rep (the sessions of one rep ran minutes apart, under the same load)
                        "per_rep": [[round(x["ttft_ms"] / y["ttft_ms"], 2) for x, y in zip(sa["turns"], sb["turns"])]
                                    for sa, sb in zip(res[way][a], res[way][b])]}
            table[way] = {"per_turn_ms": d, "ratios": ratios}
        texts = {who: [[t["text"] for t in s["turns"]] for w in ways for k, v in res[w].items() if k.startswith(who)
                       for s in v] for who in ("graftmem", "llama")}
        equal = {who: all(x == v[0] for x in v) if v else None for who, v in texts.items()}
        # turn by turn, whether the two servers gave the same answer (llama-server's cells differ from a cold
        # prefill's where it re-evaluates other calls than graftmem does; neither is wrong to its own rule)
        same_turns = ([a == b for a, b in zip(texts["graftmem"][0], texts["llama"][0])]
                      if texts["graftmem"] and texts["llama"] else None)
        write_results(args.out, {
            "model": f"{name} ({note})" if note else name, "engine": {**cfg.model_dump(), "threads": threads},
            "max_tokens": args.max_tokens, "system_words": args.words, "reps": args.reps, "in_rep": done_reps,
            "ways": ways, "machine": {"cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
                                      "loadavg_before": load0, "loadavg_after": os.getloadavg()},
            "wall_s": round(time.time() - t_start, 1), "llama_server_build": cpp_peer.build_record(),
            "weight_buffers": {"graftmem_extra_bufts": cfg.extra_bufts,
                               "llama_server": " ".join(cpp_peer.weight_buffer_args(cfg.extra_bufts == "on")) or "repack on"},
            "answers_equal_within_server": equal, "answers_same_per_turn_across_servers": same_turns,
            "answers": {who: v[0] if v else None for who, v in texts.items()},
            "summary": table, "raw": res}, args=args, threads=threads)
        for way in ways:
            print(f"== {way} connection (rep {done_reps}); TTFT per turn, median [min-max] ms")
            for key, rows in table[way]["per_turn_ms"].items():
                print(f"{key:<18}" + "  ".join(f"{r['median']:>7.0f} [{r['min']:.0f}-{r['max']:.0f}]" for r in rows))
            for label, r in table[way]["ratios"].items():
                print(f"{label}: {r['of_medians']} per rep {r['per_rep']}")
        print(f"answers equal within each server: {equal}; same across servers per turn: {same_turns}; load "
              f"{load0} -> {os.getloadavg()}", flush=True)

    runners = [k for k in ("graftmem", "llama-server") if k in only]
    k = 0
    for rep in range(args.reps):
        for way in ways:
            order = runners[k % len(runners):] + runners[:k % len(runners)]
            k += 1
            for who in order:
                t0 = time.time()
                if who == "graftmem":
                    r = run_graftmem(work, rep, way, reqs, args.max_tokens)
                    res[way]["graftmem_first"].append(r["first"])
                    res[way]["graftmem_restart"].append(r["restart"])
                else:
                    assert exe is not None
                    r = run_llama_server(exe, cfg, threads, work, way, reqs, args.max_tokens)
                    res[way]["llama_first"].append(r["first"])
                    res[way]["llama_warm"].append(r["warm"])
                print(f"rep {rep + 1}/{args.reps} {way} {who}: {time.time() - t0:.0f} s, load "
                      f"{os.getloadavg()[0]:.2f}; " + "; ".join(
                          f"{ph} " + " / ".join(f"{t['ttft_ms']:.0f}" for t in s["turns"]) for ph, s in r.items()),
                      file=sys.stderr, flush=True)
                report(rep + 1)  # after every server's sessions: a run stopped early keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
