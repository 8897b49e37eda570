"""The skill-manual agent: learn six manuals once, then solve six tasks through ``recall``.

    python examples/skill_agent/agent.py [--home DIR] [--model smollm2] [--max-tokens 32] [--threads 1] [--json FILE]

For each task it prints the routed block, the routing score, whether the route is the right manual,
whether the task succeeded (checked by code on the answer), the tokens prefilled and the wall time,
for the graft (restore the manual's KV state, prefill only the task) and, in the same run, for the
text way (prefill the manual's text again, then the task). The two answers must be identical, byte for
byte in their first-step logits; the script exits 1 if any route is wrong or any answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from graftmem import Memory  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from skills import SKILLS, TASKS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", default=None, help="store directory (default: a fresh temp dir)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads (default 1: on a shared, busy CPU more threads stall each other; "
                         "0 = all cores)")
    args = ap.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="graftmem-skills-")

    t0 = time.perf_counter()
    config = {"n_threads": args.threads} if args.threads else None
    with Memory(args.model, home=home, config=config) as mem:
        print(f"model {mem.fingerprint.model_name}, exact={mem.exactness.exact}; store {home} "
              f"(loaded in {time.perf_counter() - t0:.1f} s)")
        t = time.perf_counter()
        ids = {}
        for s in SKILLS:
            b = mem.learn(s.manual, name=s.name, when_to_use=s.when_to_use, chat=True)
            ids[b.id] = s.name
        print(f"learned {len(SKILLS)} manuals once ({sum(mem.get(i).n_tokens for i in ids)} tokens) "
              f"in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        mem.search("warm up", top_k=1)  # loads MiniLM and indexes the store, once
        print(f"router ready in {time.perf_counter() - t:.1f} s (MiniLM load + {len(SKILLS)} embeddings)\n")

        rows = []
        for i, task in enumerate(TASKS, 1):
            t = time.perf_counter()
            hits = mem.search(task.text, top_k=2)  # embeds the task; recall below reuses this route
            route_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            g = mem.recall(task.text, max_tokens=args.max_tokens)
            graft_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            x = mem.recall(task.text, max_tokens=args.max_tokens, mode="text")
            text_ms = (time.perf_counter() - t) * 1e3
            routed = g.block.name if g.block is not None else None
            rows.append({
                "task": task.text, "expected_skill": task.skill, "routed": routed, "score": g.score,
                "runner_up": ids.get(g.runner_up or "", None), "runner_up_score": g.runner_up_score,
                "route_ok": routed == task.skill, "success": task.check(g.text), "expected": task.expected,
                "answer": g.text, "identical": (g.text == x.text and g.receipt.first_logits_sha256
                                                == x.receipt.first_logits_sha256),
                "graft_prefilled": g.receipt.tokens_prefilled, "graft_restored": g.receipt.tokens_restored,
                "text_prefilled": x.receipt.tokens_prefilled, "route_ms": route_ms,
                "graft_ms": graft_ms, "text_ms": text_ms, "exact": g.receipt.exact,
                "top_hit": hits[0].name if hits else None,
            })
            r = rows[-1]
            print(f"[{i}] {task.text}")
            print(f"    routed -> {routed} (score {g.score:.3f}; runner-up {r['runner_up']} "
                  f"{(g.runner_up_score or 0):.3f})  route {'OK' if r['route_ok'] else 'WRONG'}  "
                  f"route {route_ms:.1f} ms")
            print(f"    answer {g.text.strip()!r}  -> task {'SUCCESS' if r['success'] else 'FAILED'} "
                  f"(expected {task.expected!r})")
            print(f"    graft: restored {r['graft_restored']} + prefilled {r['graft_prefilled']} tokens, "
                  f"{graft_ms:.0f} ms | text: prefilled {r['text_prefilled']} tokens, {text_ms:.0f} ms | "
                  f"{text_ms / graft_ms:.1f}x | answers {'identical' if r['identical'] else 'DIFFER'}\n")

    n = len(rows)
    routed_ok = sum(r["route_ok"] for r in rows)
    success = sum(r["success"] for r in rows)
    same = sum(r["identical"] for r in rows)
    g_total = sum(r["graft_ms"] for r in rows)
    x_total = sum(r["text_ms"] for r in rows)
    hdr = f"{'#':<2} {'routed':<20} {'score':>5} {'route':<5} {'task':<7} {'pre g/t':>9} {'graft ms':>8} {'text ms':>8} {'same':<4}"
    print(hdr)
    for i, r in enumerate(rows, 1):
        print(f"{i:<2} {str(r['routed']):<20} {r['score']:>5.3f} {'ok' if r['route_ok'] else 'WRONG':<5} "
              f"{'ok' if r['success'] else 'failed':<7} {r['graft_prefilled']:>4}/{r['text_prefilled']:<4} "
              f"{r['graft_ms']:>8.0f} {r['text_ms']:>8.0f} {'yes' if r['identical'] else 'NO':<4}")
    print(f"\nrouted correctly {routed_ok}/{n}; task success {success}/{n} "
          f"(the answer contains the expected output; model {args.model}); answers identical "
          f"graft vs text {same}/{n}; graft {g_total:.0f} ms vs text {x_total:.0f} ms in total: "
          f"{x_total / g_total:.1f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows, "routed_ok": routed_ok,
                                               "success": success, "identical": same,
                                               "graft_ms": g_total, "text_ms": x_total}, indent=2))
    return 0 if routed_ok == n and same == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
