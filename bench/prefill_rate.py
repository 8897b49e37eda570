"""How prefill slows as the context grows, measured, and the cost model the progress bars use.

One long prefill of SmolLM2 (the default model) in n_batch chunks; the time of each chunk over its
tokens is the time per token at that chunk's mean position. The fit uses the process's CPU time (all
its threads): on a shared machine the wall time of a chunk depends on the neighbours' load more than on
its position (both are recorded). Attention reads every earlier cell, so a
token at position p costs a + b * p (the weights' part a, the attention part b * p): the least-squares
fit of that line gives `graftmem.core.progress.PREFILL_P0 = a / b`, the position at which a token costs
twice a token at position 0. The bars of learn, learn-document and the needle bench weight each token by
1 + p / p0 (`prefill_work`), so their "time left" follows the slowing rate instead of the early one.

    python -m bench.prefill_rate [--model smollm2] [--tokens 12288] [--threads N]

Prints a table and writes bench/results/prefill_rate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "prefill_rate.json"
LOAD_BEFORE: tuple[float, float, float] = (0.0, 0.0, 0.0)


def measure(model: str, n_tokens: int, threads: int | None) -> list[tuple[float, float, float]]:
    """(mean position, CPU seconds per token, wall seconds per token) of each n_batch chunk of one
    prefill of ``n_tokens``."""
    from graftmem import Engine

    cfg = {"n_ctx": n_tokens + 64, "probe": False}
    if threads:
        cfg["n_threads"] = threads
    with Engine(model, cfg) as e:
        words = " ".join(f"Section {i} covers the maintenance of pump {i % 97} and valve {i % 31}." for i in range(4000))
        toks = e.tokenize(words)
        while len(toks) < n_tokens:
            toks = toks + toks
        toks = toks[:n_tokens]
        marks: list[tuple[int, float, float]] = [(0, time.process_time(), time.perf_counter())]
        done = 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            marks.append((done, time.process_time(), time.perf_counter()))

        e.prefill(toks, progress=tick)
    rows = []
    for (p0, c0, w0), (p1, c1, w1) in zip(marks, marks[1:]):
        rows.append(((p0 + p1 - 1) / 2, (c1 - c0) / (p1 - p0), (w1 - w0) / (p1 - p0)))
    return rows


def fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of seconds per token = a + b * position: (a, b)."""
    x = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    global LOAD_BEFORE
    LOAD_BEFORE = os.getloadavg()
    rows = measure(args.model, args.tokens, args.threads)
    a, b = fit(rows)
    print(f"{'position':>9}  {'CPU ms/token':>12}  {'fit':>7}  {'wall ms/token':>13}  {'wall tok/s':>10}")
    for pos, spt, wall in rows:
        print(f"{pos:9.0f}  {spt * 1e3:12.2f}  {(a + b * pos) * 1e3:7.2f}  {wall * 1e3:13.2f}  {1 / wall:10.0f}")
    p0 = a / b if b > 0 else float("inf")
    total = sum(w for _, _, w in rows) * (rows[1][0] - rows[0][0] if len(rows) > 1 else 1)
    print(f"fit (CPU time): {a * 1e3:.3f} ms + {b * 1e6:.4f} us * position per token; p0 = a/b = {p0:.0f} positions")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "model": args.model, "tokens": args.tokens, "threads": args.threads or os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "rows": [{"position": p, "cpu_s_per_token": s, "wall_s_per_token": w} for p, s, w in rows],
        "fit": {"a_s": a, "b_s_per_position": b, "p0": p0, "on": "CPU time"}, "prefill_wall_seconds": total,
        "load_average_before_after": [LOAD_BEFORE, os.getloadavg()],
        "command": f"python -m bench.prefill_rate --model {args.model} --tokens {args.tokens}"}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
