"""Is a token's KV state independent of the batch it was computed in? (Why the server reuses whole
messages, never single tokens, the way llama-server's slot does.)

For each model: the state and first logits after prefilling ``S``, ``U``, ``H`` as three calls (the way the
server prefills a prompt: one message per call; ``H`` plays the assistant header) are the reference. Then:

* ``last_token_alone``: prefill ``S``, ``U``, then ``H + more`` as one call (the header inside the longer
  message that follows it), trim to the end of ``H`` minus one token and evaluate ``H``'s last token alone:
  what llama-server's token-level reuse does. Equal logits? Equal state?
* ``cells_inside_longer_call``: the same, trimmed to the end of ``H``: are ``H``'s cells, computed inside
  the longer call, the cells of ``H`` prefilled as its own call?
* ``one_call``: ``S + U + H`` prefilled as one call: equal logits?

    python -m bench.batch_invariance [--out bench/results/batch_invariance.json]
"""

from __future__ import annotations

import argparse
import json

from bench.harness import RESULTS, engine, write_results
from graftmem.core import logits_sha256
from tests.conftest import long_text

MODELS = (("smollm2", 2000), ("gemma3-270m", 900))


def check(name: str, words: int) -> dict:
    with engine(name, n_ctx=4096) as e:
        s = e.tokenize(long_text(words, seed=1))
        u = e.tokenize(" Question: what is the refund policy?", add_special=False)
        h = e.tokenize(" Answer:", add_special=False)
        more = h + e.tokenize(" The refund policy says that items are refunded within thirty days of purchase.",
                              add_special=False)
        n = len(s) + len(u) + len(h)
        with e.session():
            e.prefill(s), e.prefill(u), e.prefill(h)
            ref_logits, ref_state = logits_sha256(e.logits()), bytes(e.capture())
        out: dict = {"model": name, "prompt_tokens": n, "header_tokens": len(h)}
        with e.session():
            e.prefill(s), e.prefill(u), e.prefill(more)
            e.trim(n - 1)
            e.prefill(h[-1:])
            out["last_token_alone"] = {"logits_equal": logits_sha256(e.logits()) == ref_logits,
                                       "state_equal": bytes(e.capture()) == ref_state}
        with e.session():
            e.prefill(s), e.prefill(u), e.prefill(more)
            e.trim(n)
            out["cells_inside_longer_call"] = {"state_equal": bytes(e.capture()) == ref_state}
        with e.session():
            e.prefill(s + u + h)
            out["one_call"] = {"logits_equal": logits_sha256(e.logits()) == ref_logits}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "batch_invariance.json"))
    args = ap.parse_args()
    rows = [check(name, words) for name, words in MODELS]
    for r in rows:
        print(json.dumps(r))
    write_results(args.out, {"rows": rows}, args=args, indent=1)


if __name__ == "__main__":
    main()
