"""Composition and position, measured: what is exact and what drifts (paper 4.2 and 4.8).

For each model, over the same N sample queries (graftmem.memory.exactness.sample_queries), first-step logits
of each condition are compared with a fresh prefill (SHA-256 equality, KL(fresh || other) median,
p99 and max, argmax flips):

* floor      fresh vs fresh: block A then block B prefilled, twice (the engine's own determinism)
* chain      A learned, B chained on it (graft A, prefill B, store B as a delta); graft B
             vs the fresh sequential prefill of A then B. Also vs ONE prefill call over A+B
             (``chain_vs_one_call``): on Gemma 3 that differs (micro-batch boundaries move)
* stitch     A captured alone at positions 0.., B captured alone at its own positions |A|.. in an
             empty cache (it never attends to A); both states joined into one cache, vs the fresh
             sequential prefill of A then B
* rebase@M   A captured at positions 0.., restored, shifted by M with llama_memory_seq_add
             (llama.cpp re-rotates K by RoPE), vs a fresh prefill of A at positions M..
* own@M      A captured at positions M.. and restored there: own position, away from 0

    python -m bench.position [--models smollm2 gemma3-270m] [--samples 50] [--words 200]
                             [--offsets 8 128 1024 4096]

Prints a table and writes bench/results/position.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, engine, write_results
from graftmem import Memory
from graftmem.core import join_states, logits_sha256
from graftmem.memory import kl_divergence, sample_queries
from tests.conftest import long_text

#: the paper's figures (PAPER.md, 4.1 / 4.2 / 4.8), for the side-by-side columns
PAPER = {
    "floor": "SHA-equal 50/50, KL 0",
    "chain": "sequential prefill composes exactly",
    "stitch": "KL 13.85, 50/50 argmax flips",
    "rebase": "KL ~0.015, a handful of argmax flips",
    "own": "SHA-equal 50/50, KL 0 (own position)",
}


def _progress(model: str, what: str, t0: float) -> None:
    print(f"[{model}] {what} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    kls = np.array([kl_divergence(a, b) for a, b in zip(ref, got)])
    return {
        "samples": len(ref),
        "sha_equal": int(sum(logits_sha256(a) == logits_sha256(b) for a, b in zip(ref, got))),
        "kl_median": float(np.median(kls)), "kl_p99": float(np.percentile(kls, 99)),
        "kl_max": float(kls.max()),
        "argmax_flips": int(sum(int(np.argmax(a)) != int(np.argmax(b)) for a, b in zip(ref, got))),
    }


def run_model(model: str, samples: int, words: int, offsets: list[int], threads: int | None = 1) -> dict:
    # one thread by default: on a shared, oversubscribed CPU llama.cpp's spinning barriers waste most
    # of a second thread's time (the thread count does not change the bytes: docs/exactness.md)
    eng = engine(model, n_threads=threads)
    qtoks = [eng.tokenize(q, add_special=False) for q in sample_queries(samples)]
    a = eng.tokenize(long_text(words, 31))
    b = eng.tokenize(" " + long_text(words, 32), add_special=False)
    na, nb = len(a), len(b)
    out: dict = {"model": eng.model_name, "tokens_a": na, "tokens_b": nb, "n_swa": eng.n_swa,
                 "exact_engine": eng.exactness.exact, "conditions": {}}
    t0 = time.perf_counter()

    def fresh_ab() -> list[np.ndarray]:
        res = []
        eng.reset()
        eng.prefill(a)
        eng.prefill(b)
        for q in qtoks:
            eng.prefill(q)
            res.append(eng.logits())
            eng.trim(na + nb)
        return res

    def graft_each(state: bytes, n: int, shift: int = 0) -> list[np.ndarray]:
        res = []
        for q in qtoks:
            eng.restore(memoryview(bytearray(state)), n)
            if shift:
                eng.shift_positions(shift)
            eng.prefill(q)
            res.append(eng.logits())
        return res

    with eng.lock:
        ref = fresh_ab()
        # floor: a second fresh sequential prefill, each sample re-prefilled from scratch
        floor = []
        for q in qtoks[: min(samples, 10)]:
            eng.reset()
            eng.prefill(a)
            eng.prefill(b)
            eng.prefill(q)
            floor.append(eng.logits())
        out["conditions"]["floor"] = compare(ref[: len(floor)], floor)
        _progress(model, "floor", t0)

        # stitch: A alone at 0.., B alone at na.. (never attended to A), joined
        eng.reset()
        eng.prefill(a)
        sa = bytes(eng.capture())
        eng.reset_at(na)
        eng.prefill(b)
        sb = bytes(eng.capture())
        stitched = join_states(sa, sb)
        out["conditions"]["stitch"] = compare(ref, graft_each(stitched, na + nb))
        _progress(model, "stitch", t0)

        # rebase and own position at each offset M, for block A alone
        for m in offsets:
            eng.reset_at(m)
            eng.prefill(a)
            own_state = bytes(eng.capture())
            fresh_m = []
            for q in qtoks:
                eng.prefill(q)
                fresh_m.append(eng.logits())
                eng.trim(m + na)
            out["conditions"][f"rebase@{m}"] = compare(fresh_m, graft_each(sa, na, shift=m))
            out["conditions"][f"own@{m}"] = compare(fresh_m, graft_each(own_state, m + na))
            _progress(model, f"offset {m}", t0)
        eng.reset()

    # chain: through the public API (learn with parent=, stored as a delta)
    with tempfile.TemporaryDirectory() as home, Memory(engine=eng, home=home) as mem:
        root = mem.learn(long_text(words, 31), name="A")
        child = mem.learn(" " + long_text(words, 32), parent=root.id, name="B")
        assert root.tokens == a and child.tokens == b
        from graftmem.memory import graft_logits

        with eng.lock:
            chain = [graft_logits(mem.engine, mem.store, child.id, q) for q in qtoks]
            one = []
            eng.reset()
            eng.prefill(a + b)  # one call: micro-batch boundaries differ from learning A then B
            for q in qtoks:
                eng.prefill(q)
                one.append(eng.logits())
                eng.trim(na + nb)
            eng.reset()
        out["conditions"]["chain"] = compare(ref, chain)
        out["conditions"]["chain_vs_one_call"] = compare(one, chain)
        out["chain_storage"] = {"storage": child.storage, "stored_bytes": child.state_size,
                                "full_state_bytes": child.full_state_size,
                                "saved_bytes": (child.full_state_size or 0) - child.state_size,
                                "saved_fraction": 1 - child.state_size / (child.full_state_size or 1)}
    out["seconds"] = time.perf_counter() - t0
    eng.close()
    return out


def paper_for(cond: str) -> str:
    return PAPER.get(cond.split("@")[0].replace("_vs_one_call", ""), "")


def table(results: list[dict]) -> str:
    lines = [f"{'model':<14} {'condition':<20} {'SHA-equal':>10} {'KL median':>10} {'KL p99':>10} "
             f"{'KL max':>10} {'flips':>7}  paper"]
    for r in results:
        for cond, c in r["conditions"].items():
            lines.append(f"{r['model']:<14} {cond:<20} {c['sha_equal']:>4}/{c['samples']:<5} "
                         f"{c['kl_median']:>10.3g} {c['kl_p99']:>10.3g} {c['kl_max']:>10.3g} "
                         f"{c['argmax_flips']:>3}/{c['samples']:<3}  {paper_for(cond)}")
        s = r["chain_storage"]
        lines.append(f"{r['model']:<14} chain storage: {s['storage']}, {s['stored_bytes']:,} of "
                     f"{s['full_state_bytes']:,} bytes stored ({100 * s['saved_fraction']:.1f}% saved)")
    return "\n".join(lines)


def markdown(json_path: str) -> str:
    """The result file as a Markdown table (for docs/position.md and docs/benchmarks.md)."""
    data = json.loads(Path(json_path).read_text())
    out = ["| model | condition | SHA-equal | KL median | KL p99 | KL max | argmax flips | paper |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        for cond, c in r["conditions"].items():
            out.append(f"| {r['model']} | {cond} | {c['sha_equal']}/{c['samples']} | {c['kl_median']:.3g} | "
                       f"{c['kl_p99']:.3g} | {c['kl_max']:.3g} | {c['argmax_flips']}/{c['samples']} | "
                       f"{paper_for(cond)} |")
    out.append("")
    for r in data["results"]:
        s = r["chain_storage"]
        out.append(f"- {r['model']}, A = {r['tokens_a']} tokens, B = {r['tokens_b']} tokens: the chained "
                   f"child is stored as a {s['storage']}, {s['stored_bytes']:,} of {s['full_state_bytes']:,} "
                   f"bytes ({100 * s['saved_fraction']:.1f}% saved on disk).")
    return "\n".join(out)


def plot(json_path: str, png: str) -> None:
    """KL(fresh || other) per condition and model, log scale; exact conditions drawn at the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    conds = [c for c in data["results"][0]["conditions"] if c != "floor"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(data["results"])
    floor = 1e-9
    for i, r in enumerate(data["results"]):
        med = [max(r["conditions"][c]["kl_median"], floor) for c in conds]
        p99 = [max(r["conditions"][c]["kl_p99"], floor) for c in conds]
        xs = [j + i * width for j in range(len(conds))]
        ax.bar(xs, med, width, label=f"{r['model']} (median)")
        ax.scatter(xs, p99, marker="_", s=200, color="black", zorder=3, label="p99" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 100)
    ax.axhline(13.85, color="red", ls=":", lw=1, label="paper: stitching KL 13.85")
    ax.axhline(0.015, color="gray", ls="--", lw=1, label="paper: re-basing KL ~0.015")
    ax.set_xticks([j + width * (len(data["results"]) - 1) / 2 for j in range(len(conds))])
    ax.set_xticklabels(conds, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("KL(fresh || other), nats\n(exact = bottom)")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="only draw the plot from a result file")
    ap.add_argument("--markdown", metavar="JSON", help="only print a result file as a Markdown table")
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--words", type=int, default=200, help="words per block (about 1.2 tokens each)")
    ap.add_argument("--offsets", type=int, nargs="+", default=[8, 128, 1024, 4096])
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1: shared machines)")
    ap.add_argument("--out", default=str(RESULTS / "position.json"))
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if args.plot:
        plot(*args.plot)
        print(f"wrote {args.plot[1]}")
        return 0
    results = [run_model(m, args.samples, args.words, args.offsets, args.threads) for m in args.models]
    print(table(results))
    doc = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "paper": PAPER, "results": results}
    write_results(args.out, doc, args=args)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
