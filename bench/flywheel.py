"""Flywheel benchmark: learn (run 1), recur in a new process (run 2), transfer to held-out variants,
and the do-no-harm gate. Prints tables and writes bench/results/flywheel.json.

    python -m bench.flywheel                  # all phases; run 2 is a child process
    python -m bench.flywheel --limit 10       # the first 10 problems only

Arms, per problem of examples/flywheel/problems.py (30 problems with known answers):

* base: SmolLM2-135M alone, best-of-5 (greedy + 4 samples at the gate's T=0.5, --base-tokens each);
  solved if ANY of the five answers is right (an oracle pick: generous to the base model).
* run 1 (flywheel, learning): Flywheel.solve with the model's own samples first, then the stand-in
  solver (examples/flywheel/solver.py, a deterministic program generator that stands for a larger
  model, NOT a model); every answer verified (ExactMatch on the known answers); verified ones deposited.
* run 2 (flywheel, recurrence, new process): the same problems again; they should come from the cache
  (graft the block, decode the answer). Tokens are the model's decode tokens after the graft.
* transfer: held-out variants (new numbers, same shape, never deposited): routing, then literal
  substitution into the cached program, and separately the model adapting the program after a graft.
* gate: self-consistency of the base model's five answers (agreement >= 0.75 means confident) against
  whether its greedy answer is right; and what grafting the routed block does to problems the model
  already solves (the harm the gate exists to prevent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import RESULTS, example_modules, write_results
from graftmem import ExactMatch, Flywheel, Gate, Memory
from graftmem.memory import literals, normalize_answer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# the example's problem set and stand-in solver (examples/flywheel/problems.py, solver.py)
problems, solver = example_modules("flywheel", "problems", "solver")
EASY, answers, problem_set, variants = problems.EASY, problems.answers, problems.problem_set, problems.variants
make_solver = solver.make_solver


def flywheel(mem: Memory, gate: bool = True) -> Flywheel:
    count = lambda s: len(mem.engine.tokenize(s, add_special=False))  # noqa: E731
    return Flywheel(mem, ExactMatch(answers()), solver=make_solver(count), gate=Gate() if gate else None,
                    budget=512)


# one llama.cpp thread: on a shared, oversubscribed CPU two spinning threads decoded 40x slower
CONFIG = {"n_threads": 1}


def right(x, want) -> bool:
    return normalize_answer(x) is not None and normalize_answer(x) == normalize_answer(want)


def phase_learn(args) -> dict:
    probs = problem_set()[: args.limit]
    rows = []
    with Memory("smollm2", home=args.store, config=CONFIG) as mem:
        fw = flywheel(mem)
        for p in probs:
            t0 = time.perf_counter()
            base = fw.ask_model(p["problem"], samples=5, max_tokens=args.base_tokens)
            base_s = time.perf_counter() - t0
            sol = fw.solve(p["problem"])
            rows.append({
                "family": p["family"], "problem": p["problem"], "answer": p["answer"],
                "base_answers": base.answers, "base_greedy_right": right(base.answers[0], p["answer"]),
                "base_solved": any(right(a, p["answer"]) for a in base.answers), "base_tokens": base.tokens,
                "base_s": base_s, "base_agreement": base.agreement, "base_confident": base.confident,
                "run1_source": sol.source, "run1_method": sol.method, "run1_answer": sol.answer,
                "run1_verified": sol.verified, "run1_tokens": sol.tokens_decoded,
                "run1_solver_tokens": sol.solver_tokens, "run1_s": sol.wall_s, "deposited": sol.deposited,
            })
            print(f"  run1 {p['family']:10} {sol.source:8} {str(sol.method):12} {sol.answer!s:>6} "
                  f"base {base.answers[0]!s:>8} ({base.tokens} tok)", flush=True)
        # the do-no-harm measurement: easy problems, gate on; and the routed block grafted regardless
        harm = []
        for p in EASY:
            base = fw.ask_model(p["problem"], samples=5, max_tokens=args.base_tokens)
            hit = fw._route(p["problem"], exclude=None)  # noqa: SLF001 - measurement
            grafted = fw.answer_with_block(hit[0].id, p["problem"]) if hit else None
            sol = fw.solve(p["problem"])
            harm.append({
                "problem": p["problem"], "answer": p["answer"], "base_answers": base.answers,
                "base_greedy_right": right(base.answers[0], p["answer"]), "base_confident": base.confident,
                "routed_block": hit[0].name if hit else None,
                "with_block_answer": grafted.answer if grafted else None,
                "with_block_right": bool(grafted and right(grafted.answer, p["answer"])),
                "gated_source": sol.source, "gated_method": sol.method, "gated_block": sol.block_id,
                "gated_right": sol.verified, "gate_confident": bool(sol.gate and sol.gate.confident),
            })
            print(f"  harm {p['problem']:20} alone {base.answers[0]!s:>4}  with block {harm[-1]['with_block_answer']!s:>6}"
                  f"  gated -> {sol.source}/{sol.method}", flush=True)
    return {"rows": rows, "harm": harm}


def phase_recur(args) -> dict:
    """Run in a NEW process: nothing of run 1 survives but the store on disk."""
    probs = problem_set()[: args.limit]
    rows, trans = [], []
    t_load = time.perf_counter()
    with Memory("smollm2", home=args.store, config=CONFIG) as mem:
        load_s = time.perf_counter() - t_load
        fw = flywheel(mem)
        for p in probs:
            sol = fw.solve(p["problem"])
            rows.append({"problem": p["problem"], "source": sol.source, "method": sol.method,
                         "answer": sol.answer, "verified": sol.verified, "tokens": sol.tokens_decoded,
                         "wall_s": sol.wall_s, "sha": sol.receipt.first_logits_sha256 if sol.receipt else None,
                         "router_loaded": mem.router_loaded})
            print(f"  run2 {p['family']:10} {sol.source:8} {sol.answer!s:>6} {sol.tokens_decoded} tok "
                  f"{sol.wall_s * 1e3:.0f} ms", flush=True)
        router_loaded_after_recurrences = mem.router_loaded
        for v in variants():
            sub, score = fw.try_transfer(v["problem"], "substitution")
            ada, _ = fw.try_transfer(v["problem"], "adaptation")
            hit = fw._route(v["problem"], exclude=None)  # noqa: SLF001 - measurement
            fam = hit[0].metadata.get("shape") if hit else None
            trans.append({
                "family": v["family"], "problem": v["problem"], "answer": v["answer"], "score": score,
                "routed_to": hit[0].metadata.get("problem") if hit else None,
                "routed_same_shape": fam is not None and fam == literals(v["problem"])[1],
                "substitution_answer": sub.answer if sub else None, "substitution_ok": bool(sub and sub.verified),
                "substitution_program": sub.program if sub else None,
                "adaptation_answer": ada.answer if ada else None, "adaptation_ok": bool(ada and ada.verified),
                "adaptation_program": ada.program if ada else None, "adaptation_tokens": ada.tokens if ada else 0,
            })
            print(f"  transfer {v['family']:10} subst {trans[-1]['substitution_answer']!s:>6} "
                  f"model {trans[-1]['adaptation_answer']!s:>6} want {v['answer']}", flush=True)
    return {"rows": rows, "transfer": trans, "load_s": load_s,
            "router_loaded_after_recurrences": router_loaded_after_recurrences}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="/tmp/graftmem-flywheel-bench")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--base-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(RESULTS / "flywheel.json"))
    ap.add_argument("--phase", choices=["all", "recur"], default="all")
    ap.add_argument("--child-out", default=None)
    args = ap.parse_args()
    if args.phase == "recur":
        Path(args.child_out).write_text(json.dumps(phase_recur(args)))
        return 0
    shutil.rmtree(args.store, ignore_errors=True)
    print("run 1 (learn) ...", flush=True)
    learn = phase_learn(args)
    print("run 2 (recurrence, new process) ...", flush=True)
    child_out = Path(args.store) / "run2.json"
    cmd = [sys.executable, "-m", "bench.flywheel", "--phase", "recur", "--store", args.store,
           "--child-out", str(child_out)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    subprocess.run(cmd, check=True)
    recur = json.loads(child_out.read_text())
    report(learn, recur, args)
    return 0


def report(learn: dict, recur: dict, args) -> None:
    rows, r2, tr, harm = learn["rows"], recur["rows"], recur["transfer"], learn["harm"]
    n = len(rows)
    print("\nper problem")
    hdr = f"{'family':10} {'answer':>6} | {'base best-of-5':>14} {'tok':>5} | {'run 1':>17} {'tok':>4} {'solver':>6} | {'run 2':>6} {'tok':>3} {'ms':>6}"
    print(hdr)
    print("-" * len(hdr))
    for a, b in zip(rows, r2):
        print(f"{a['family']:10} {a['answer']:>6} | {('yes' if a['base_solved'] else 'no'):>14} {a['base_tokens']:>5} | "
              f"{a['run1_source'] + '/' + str(a['run1_method']):>17} {a['run1_tokens']:>4} {a['run1_solver_tokens']:>6} | "
              f"{('yes' if b['verified'] else 'no') + '/' + b['source'][:1]:>6} {b['tokens']:>3} {b['wall_s'] * 1e3:>6.0f}")
    base_solved = sum(a["base_solved"] for a in rows)
    greedy = sum(a["base_greedy_right"] for a in rows)
    base_tok = sum(a["base_tokens"] for a in rows)
    base_s = sum(a["base_s"] for a in rows)
    r1_solved = sum(a["run1_verified"] for a in rows)
    r1_tok = sum(a["run1_tokens"] for a in rows)
    r1_solver = sum(a["run1_solver_tokens"] for a in rows)
    r1_s = sum(a["run1_s"] for a in rows)
    deposits = sum(1 for a in rows if a["deposited"])
    r2_solved = sum(b["verified"] for b in r2)
    r2_cache = sum(b["source"] == "cache" for b in r2)
    r2_tok = sum(b["tokens"] for b in r2)
    r2_s = sum(b["wall_s"] for b in r2)
    ratio = base_tok / r2_tok if r2_tok else float("inf")
    sub_ok = sum(t["substitution_ok"] for t in tr)
    ada_ok = sum(t["adaptation_ok"] for t in tr)
    routed_ok = sum(t["routed_same_shape"] for t in tr)
    print("\ntotals")
    print(f"  base model best-of-5 : {base_solved}/{n} solved (greedy {greedy}/{n}), {base_tok:,} tokens, {base_s:.1f} s")
    print(f"  run 1 (learn)        : {r1_solved}/{n} verified, {r1_tok:,} model tokens + {r1_solver:,} stand-in "
          f"solver tokens, {r1_s:.1f} s, {deposits} blocks deposited")
    print(f"  run 2 (new process)  : {r2_solved}/{n} verified, {r2_cache}/{n} from the cache, {r2_tok:,} tokens, "
          f"{r2_s:.2f} s (model load {recur['load_s']:.1f} s not included)")
    print(f"  token ratio base best-of-5 / run 2: {ratio:,.1f}x; wall-time ratio {base_s / r2_s if r2_s else 0:,.1f}x")
    print(f"  transfer to {len(tr)} held-out variants: routed to the same-shape block {routed_ok}/{len(tr)}, "
          f"substitution {sub_ok}/{len(tr)}, model adaptation {ada_ok}/{len(tr)}")
    conf = [a for a in rows] + [{"base_confident": h["base_confident"], "base_greedy_right": h["base_greedy_right"]} for h in harm]
    cm = {(c, r): sum(1 for x in conf if x["base_confident"] == c and x["base_greedy_right"] == r)
          for c in (True, False) for r in (True, False)}
    harmed = sum(1 for h in harm if h["base_greedy_right"] and not h["with_block_right"])
    gated_kept = sum(1 for h in harm if h["gated_block"] is None and h["gated_method"] == "model")
    print(f"  gate (5-sample self-consistency, 3/5 agree) over {len(conf)} problems: confident&right {cm[True, True]}, "
          f"confident&wrong {cm[True, False]}, unsure&right {cm[False, True]}, unsure&wrong {cm[False, False]}")
    gated_right = sum(1 for h in harm if h["gated_right"])
    print(f"  harm on {len(harm)} easy problems the model solves: grafting the routed block blindly broke "
          f"{harmed}/{len(harm)}; the flywheel answered {gated_right}/{len(harm)} right, its gate kept the block "
          f"away from {gated_kept}/{len(harm)} (the rest went through a verified transfer)")
    out = {
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1)", "n_problems": n,
        "totals": {"base_solved": base_solved, "base_greedy_right": greedy, "base_tokens": base_tok, "base_s": base_s,
                   "run1_verified": r1_solved, "run1_model_tokens": r1_tok, "run1_solver_tokens": r1_solver,
                   "run1_s": r1_s, "deposits": deposits, "run2_verified": r2_solved, "run2_from_cache": r2_cache,
                   "run2_tokens": r2_tok, "run2_s": r2_s, "token_ratio": ratio,
                   "transfer_n": len(tr), "transfer_routed_same_shape": routed_ok,
                   "transfer_substitution": sub_ok, "transfer_adaptation": ada_ok,
                   "gate_confusion": {f"{'confident' if c else 'unsure'}_{'right' if r else 'wrong'}": v for (c, r), v in cm.items()},
                   "harm_without_gate": harmed, "harm_kept_away_by_gate": gated_kept, "harm_flywheel_right": gated_right,
                   "harm_n": len(harm),
                   "run2_router_loaded": recur["router_loaded_after_recurrences"]},
        "run1": rows, "run2": r2, "transfer": tr, "harm": harm,
    }
    write_results(args.out, out, args=args, threads=CONFIG["n_threads"], default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
