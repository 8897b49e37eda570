"""Could a restarted turn go straight to decoding from what the store already holds? (#26, item 2)

A cold chat request prefills its generation header (``<|im_start|>assistant\\n``, 4 tokens on SmolLM2) as
its own call after the prompt, then samples from that call's logits. A server that wanted to skip that
call after a restart would need, for the prompt's prefix, (a) the header's cells as that 4-token call
computes them and (b) that call's logits. The learned chain does hold cells at the header's positions:
the next turn's assistant segment starts with the header, and it is prefilled as ONE call (header +
answer + end of turn). This script measures whether the header's rows inside that longer call are the
bytes the header's own call writes: the state of the first ``prefix + header`` positions after
``[prefix], [header]`` against ``[prefix], [header + n answer tokens]`` for growing ``n``, and against
the header inside the prefix's call (``[prefix + header]``).

    python -m bench.header_cells [--model smollm2] [--prefix 300] [--out bench/results/header_cells.json]
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Optional

from graftmem.core import statefmt

from .harness import engine, prose, write_results

ANSWER_LENGTHS = (1, 8, 28, 60, 124, 200, 400)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=300, help="prompt tokens before the header")
    ap.add_argument("--out", default="bench/results/header_cells.json")
    args = ap.parse_args(argv)
    with engine(args.model, n_ctx=2048, probe=False) as eng:
        pre = eng.tokenize(prose(args.prefix, 3))[:args.prefix]
        head = eng.tokenize("<|im_start|>assistant\n", add_special=False)
        answer = eng.tokenize(" " + prose(400, 9), add_special=False)

        def state(calls: list[list[int]]) -> bytes:
            eng.reset()
            for c in calls:
                eng.prefill(c)
            return bytes(statefmt.cut(bytes(eng.capture()), len(pre) + len(head)))

        own = state([pre, head])
        rows = []
        for n in ANSWER_LENGTHS:
            other = state([pre, head + answer[:n]])
            rows.append({"call_tokens": len(head) + n, "equal": other == own,
                         "sha256": hashlib.sha256(other).hexdigest()[:16]})
            print(f"header's own call vs its rows in a {len(head) + n:>3}-token call: "
                  f"{'equal' if other == own else 'DIFFERENT'}")
        joined = state([pre + head]) == own
        print(f"header's own call vs its rows in the prefix's call: {'equal' if joined else 'DIFFERENT'}")
    write_results(args.out, {"model": args.model, "prefix_tokens": len(pre), "header_tokens": len(head),
                             "own_call_sha256": hashlib.sha256(own).hexdigest()[:16], "longer_calls": rows,
                             "in_the_prefix_call_equal": joined}, args=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
