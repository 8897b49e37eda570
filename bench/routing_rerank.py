"""Experiment: re-rank the router's top 3 by the model's own likelihood of the task after grafting each.

    python -m bench.routing_rerank [--gamma 0.3] [--out bench/results/routing_rerank.json]

For every task, the hybrid router's top 3 blocks are each grafted (restored at their own positions),
the task's chat turn is prefilled token by token and the log-probability of each next token summed
(``ll``). A candidate's re-ranked score is ``router score + gamma * (ll - max ll) / n_tokens`` (the
per-token log-likelihood gap to the best candidate). ``gamma`` is swept on the TUNING set
(bench/routing_set.py) and the chosen value measured once on the HELD-OUT set
(bench/routing_heldout.py). SmolLM2-135M, one llama.cpp thread.

Not in the library: measured +1 task on each set for about a second per task (token-by-token scoring;
the engine keeps only the last position's logits). See docs/routing.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from bench.harness import RESULTS, summary, write_results
from bench.routing_heldout import ALL_MANUALS, HELDOUT
from bench.routing_set import LABELLED, MANUALS
from graftmem import Memory
from graftmem.memory import SentenceTransformerEmbedder, continuation_for, graft

GAMMAS = [0.0, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def score_set(emb, manuals, labelled) -> list[dict]:
    rows = []
    with Memory("smollm2", home=tempfile.mkdtemp(prefix="graftmem-rerank-"), embedder=emb,
                config={"n_threads": 1}) as mem:
        names = {mem.learn(m.manual, name=m.name, when_to_use=m.when_to_use, chat=True).id: m.name
                 for m in manuals}
        eng = mem.engine
        for task, want in labelled:
            hits = mem.search(task, top_k=3)
            t0 = time.perf_counter()
            lls = []
            for h in hits:
                block = mem.get(h.block_id)
                toks = eng.tokenize(continuation_for(block, task), add_special=False)
                with eng.session():
                    graft(eng, mem.store, block)
                    eng.prefill(toks[:1])
                    total = 0.0
                    for t in toks[1:]:
                        total += float(log_softmax(eng.logits())[t])
                        eng.prefill([t])
                lls.append(total)
            rows.append({"task": task, "want": want, "names": [names[h.block_id] for h in hits],
                         "scores": [h.score for h in hits], "ll": lls, "n": len(toks) - 1,
                         "rerank_ms": (time.perf_counter() - t0) * 1e3})
    return rows


def accuracy(rows: list[dict], gamma: float) -> int:
    ok = 0
    for r in rows:
        ll = np.asarray(r["ll"])
        s = np.asarray(r["scores"]) + gamma * (ll - ll.max()) / r["n"]
        ok += r["names"][int(s.argmax())] == r["want"]
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gamma", type=float, default=0.3, help="the weight measured on the held-out set")
    ap.add_argument("--out", default=str(RESULTS / "routing_rerank.json"))
    args = ap.parse_args()
    emb = SentenceTransformerEmbedder()
    tune = score_set(emb, MANUALS, LABELLED)
    print("## tuning set: top-1 after re-ranking the top 3, by gamma (0 = the router alone)")
    for g in GAMMAS:
        print(f"gamma {g:<5} {accuracy(tune, g)}/{len(tune)}")
    held = score_set(emb, ALL_MANUALS, HELDOUT)
    res = {"gamma": args.gamma,
           "tuning": {str(g): accuracy(tune, g) for g in GAMMAS}, "tuning_n": len(tune),
           "heldout_router": accuracy(held, 0.0), "heldout_reranked": accuracy(held, args.gamma),
           "heldout_n": len(held), "heldout_top3": sum(r["want"] in r["names"] for r in held),
           "rerank_ms_p50": summary(r["rerank_ms"] for r in tune + held)["median"],
           "rows": {"tuning": tune, "heldout": held}}
    print(f"## held-out: router {res['heldout_router']}/{len(held)}, re-ranked (gamma {args.gamma}) "
          f"{res['heldout_reranked']}/{len(held)}, right block in the top 3: {res['heldout_top3']}/{len(held)}; "
          f"re-ranking p50 {res['rerank_ms_p50']:.0f} ms per task (3 grafts + token-by-token scoring)")
    write_results(args.out, res, args=args, threads=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
