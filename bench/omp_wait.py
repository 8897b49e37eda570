"""How libgomp's barrier wait prices llama.cpp's calls, idle and on busy cores (issue #44).

llama.cpp's CPU backend meets its threads at a barrier after every graph node. libgomp decides how a
thread waits there from ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``, read once when the library loads, so
each setting runs in its own process (a child of this script, the variable set before graftmem
imports llama.cpp). Each child loads SmolLM2 with the default engine config, prefills a ~3,000-token
text once, then per round trims back to it and times, with the same token ids every round:

* ``tail``: one prefill call of ``--tail`` (40) tokens, the size of bench/turns.py's turn 3 and 5 tails;
* ``one``: a one-token call (the call every graftmem turn ends its prompt with);
* ``decode8``: eight one-token calls back to back (a short answer's decode);
* ``one_idle`` / ``decode8_idle``: the same after ``--pause`` (0.5) s of sleep, as a request that arrives
  after the server idled meets them. Measured on this VM (2-core AMD EPYC, Firecracker): with a short spin
  (1,000) a one-token call after a pause took 29-48 ms instead of 12-14 (its worker thread sleeps at every
  barrier, and a sleeping vCPU wakes slowly), with libgomp's default spin 13-15 ms.

Two conditions, in one run, settings alternated within each: ``idle`` (nothing else running; check the
load average in the JSON) and ``busy``: ``--burners`` (2) processes spinning in pure Python on the same
cores for the length of the child, the shared host the passive default was chosen for.

    python -m bench.omp_wait [--settings passive,spin:10000,spin:300000,active] [--reps 3] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.harness import RESULTS, summary, write_results

CHILD = r"""
import json, os, sys, time
from bench.harness import prose
from graftmem import Memory, EngineConfig
rounds, tail, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[4])
mem = Memory("smollm2", home=sys.argv[3], config=EngineConfig(probe=False, n_ctx=4096))
eng = mem.engine
toks = eng.tokenize(prose(2600, seed=7))[:3000]
extra = eng.tokenize(prose(60, seed=8), add_special=False)[:tail]
eng.reset(); eng.prefill(toks); n = eng.n_past
out = {"tail": [], "one": [], "decode8": [], "one_idle": [], "decode8_idle": [], "threads": eng.config.n_threads}
for _ in range(rounds):
    eng.trim(n); t = time.perf_counter(); eng.prefill(extra); eng.logits(); out["tail"].append((time.perf_counter() - t) * 1e3)
    eng.trim(n); t = time.perf_counter(); eng.prefill(extra[:1]); eng.logits(); out["one"].append((time.perf_counter() - t) * 1e3)
    eng.trim(n); t = time.perf_counter()
    for tok in extra[:8]:
        eng.prefill([tok]); eng.logits()
    out["decode8"].append((time.perf_counter() - t) * 1e3)
    eng.trim(n); time.sleep(pause); t = time.perf_counter(); eng.prefill(extra[:1]); eng.logits()
    out["one_idle"].append((time.perf_counter() - t) * 1e3)
    eng.trim(n); time.sleep(pause); t = time.perf_counter()
    for tok in extra[:8]:
        eng.prefill([tok]); eng.logits()
    out["decode8_idle"].append((time.perf_counter() - t) * 1e3)
print("RESULT " + json.dumps(out), flush=True)
"""

KINDS = ("tail", "one", "decode8", "one_idle", "decode8_idle")
BURNER = "import time\nt = time.time()\nwhile time.time() - t < 600: pass\n"


def env_for(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting in ("passive", "active"):
        env["OMP_WAIT_POLICY"] = setting
    elif setting.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = setting.split(":", 1)[1]
    else:
        raise SystemExit(f"setting {setting!r}: passive, active or spin:N")
    return env


def child(setting: str, rounds: int, tail: int, home: str, pause: float) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(rounds), str(tail), home, str(pause)], env=env_for(setting),
                       capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"{setting}: child failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(line[0][7:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="passive,spin:10000,spin:100000,active")
    ap.add_argument("--conditions", default="idle,busy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tail", type=int, default=40)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.5, help="idle seconds before the *_idle calls")
    ap.add_argument("--out", default=str(RESULTS / "omp_wait.json"))
    args = ap.parse_args()
    import tempfile
    home = tempfile.mkdtemp(prefix="graftmem-omp-")
    settings = args.settings.split(",")
    raw: dict[str, dict[str, list]] = {c: {s: [] for s in settings} for c in args.conditions.split(",")}
    loads: dict[str, list] = {c: [] for c in raw}
    for cond in raw:
        for rep in range(args.reps):
            for s in settings if rep % 2 == 0 else settings[::-1]:
                burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners)] \
                    if cond == "busy" else []
                try:
                    t0 = time.time()
                    r = child(s, args.rounds, args.tail, home, args.pause)
                finally:
                    for b in burners:
                        b.kill()
                        b.wait()
                loads[cond].append(round(os.getloadavg()[0], 2))
                raw[cond][s].append(r)
                print(f"{cond} rep {rep + 1} {s:<14} " + "  ".join(
                    f"{k} {summary(r[k])['median']:.1f}" for k in KINDS)
                    + f" ms ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    table = {cond: {s: {k: summary([x for r in runs for x in r[k]], digits=1) for k in KINDS}
                    for s, runs in v.items()} for cond, v in raw.items()}
    write_results(args.out, {"model": "smollm2", "cached_tokens": 3000, "tail_tokens": args.tail,
                             "burners": args.burners, "loadavg_per_child": loads, "summary": table, "raw": raw},
                  args=args)
    for cond, v in table.items():
        for s, row in v.items():
            print(f"{cond:<5} {s:<14} " + "  ".join(
                f"{k} {row[k]['median']:>8.1f} [{row[k]['min']:.0f}-{row[k]['max']:.0f}]" for k in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
