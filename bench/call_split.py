"""What a prefill call costs by its size, after a long cached prompt (#26: why a turn is one call).

An agent's turn adds a few dozen tokens after thousands of cached ones. The server prefills a prompt one
segment per call (the cuts are what make a graft's bytes equal to a cold prefill's), so the number of
calls per turn is a design choice: one per message (the tool result, the user message, the assistant
header: three or four calls) or one per turn. This bench prefills a ``--prefix``-token prompt once,
then, trimming back to it each time, the same ``--tail`` new tokens as one call and as the message-sized
calls a per-message cut gives (``--split``), plus single calls of 1, 4, 8 and 32 tokens; rounds
interleaved, medians reported.

    python -m bench.call_split [--model smollm2] [--prefix 2500] [--tail 124] [--split 30,50,40,4]
                               [--threads 1] [--rounds 3] [--out bench/results/call_split.json]
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

from .harness import engine, prose, summary, write_results

SMALL_CALLS = (1, 4, 8, 32)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=2500, help="cached prompt tokens before the new ones")
    ap.add_argument("--tail", type=int, default=124, help="new tokens of the turn")
    ap.add_argument("--split", default="30,50,40", help="sizes of the per-message calls (the rest: a last call)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/call_split.json")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.split.split(",") if x]
    with engine(args.model, n_ctx=max(4096, args.prefix + args.tail + 64), n_threads=args.threads, probe=False) as eng:
        pre = eng.tokenize(prose(args.prefix, 3))[:args.prefix]
        tail = eng.tokenize(" " + prose(args.tail, 9), add_special=False)[:args.tail]
        if sum(sizes) >= len(tail):
            raise SystemExit(f"--split {args.split} must leave tokens of the {len(tail)}-token tail for a last call")
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        calls = [tail[a:b] for a, b in zip(bounds, [*bounds[1:], len(tail)])]
        ways: dict[str, list[list[int]]] = {"one call": [tail], f"{len(calls)} calls": calls}
        ways.update({f"{n} tokens": [tail[:n]] for n in SMALL_CALLS})
        ms: dict[str, list[float]] = {k: [] for k in ways}
        with eng.session():
            t = time.perf_counter()
            eng.prefill(pre)
            prefix_ms = (time.perf_counter() - t) * 1e3
            for r in range(args.rounds):
                names = list(ways)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    eng.trim(len(pre))
                    t = time.perf_counter()
                    for c in ways[name]:
                        eng.prefill(c)
                    ms[name].append((time.perf_counter() - t) * 1e3)
    rows = {k: {"calls": [len(c) for c in ways[k]], **summary(v, digits=1, unit="ms")} for k, v in ms.items()}
    for k, v in rows.items():
        print(f"{k:>10} {str(v['calls']):>18}: median {v['median_ms']} ms")
    write_results(args.out, {"model": args.model, "prefix_tokens": len(pre), "tail_tokens": len(tail),
                             "prefix_ms": round(prefix_ms, 1), "ways": rows}, args=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
