"""The flywheel on a problem set, in two processes.

    python examples/flywheel/run.py learn  --store /tmp/fw-store   # run 1: live solving, verify, deposit
    python examples/flywheel/run.py recur  --store /tmp/fw-store   # run 2 (a new process): from the blocks
    python examples/flywheel/run.py variants --store /tmp/fw-store # held-out variants: transfer

Run 1 solves each problem of problems.py: the 135M model first (best-of-k), then the stand-in solver
(solver.py: a deterministic program generator standing for a larger model, not a model), every answer
checked by an ExactMatch verifier on the known answers; only verified solutions become blocks. Run 2
answers the same problems again from a fresh process: exact lookup, graft, a few decode tokens.
bench/flywheel.py measures the same loop against the base model and writes the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from graftmem import ExactMatch, Flywheel, Memory  # noqa: E402

from problems import answers, problem_set, variants  # noqa: E402
from solver import make_solver  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description="the verified-knowledge flywheel on examples/flywheel/problems.py")
    ap.add_argument("phase", choices=["learn", "recur", "variants"])
    ap.add_argument("--store", default="/tmp/graftmem-flywheel-example")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    probs = (variants() if args.phase == "variants" else problem_set())[: args.limit]
    # one llama.cpp thread: on a busy shared CPU two spinning threads decode far slower than one
    with Memory("smollm2", home=args.store, config={"n_threads": 1}) as mem:
        count = lambda s: len(mem.engine.tokenize(s, add_special=False))  # noqa: E731
        fw = Flywheel(mem, ExactMatch(answers()), solver=make_solver(count), budget=512)
        solved = tokens = 0
        wall = 0.0
        for p in probs:
            sol = fw.solve(p["problem"])
            solved += sol.verified
            tokens += sol.tokens_decoded
            wall += sol.wall_s
            print(f"{sol.source:8} {str(sol.method):12} {str(sol.answer):>6} (want {p['answer']:>5})  "
                  f"{sol.tokens_decoded:4d} tok  {sol.wall_s * 1e3:7.0f} ms  {p['problem'][:56]}")
        print(f"\n{args.phase}: {solved}/{len(probs)} verified, {tokens:,} model tokens, {wall:.1f} s; "
              f"{len(fw.mem.get_all(kind='solution'))} solution blocks in {args.store}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
