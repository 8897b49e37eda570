"""Bring your own model: what a GGUF a user picks gives on this CPU, measured (docs/models.md).

Why: the models page told a user to expect "about 10 tokens/s" of a 3B model as an estimate scaled from
the 135M one; the section now runs on real GGUFs shipped in packages (Gemma 3 270M Q4_K_M, SmolLM2-135M)
and quotes this script's numbers instead. Per model, in one fresh home: learn a manual of about
``--tokens`` tokens as a chat turn (one cold prefill + capture + store), then ``--rounds`` times, in
alternation, the same task the text way (``recall(mode="text")``: prefill manual + task) and grafted
(``recall``: restore + prefill the task), comparing the first-step logits' SHA-256 and the answers;
last ``verify(samples=10)``. Reported: prefill and decode rates, time to the first token both ways
(their ratio), state bytes per token, and whether every round was SHA-equal.

    python -m bench.byo_model [--models gemma3-270m smollm2] [--tokens 1000] [--rounds 5]

Prints a table and writes bench/results/byo_model.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from bench.harness import RESULTS, prose, summary, write_results

OUT = RESULTS / "byo_model.json"
RULES = ("Refund desk. A purchase under 30 days old is refunded: answer REFUND APPROVED and the ticket code "
         "RF-<order digits>. Older purchases: answer REFUND DECLINED.\n")
TASK = "A customer asks for a refund of order NW-20417, bought 5 days ago. What do you answer?"


def one_model(model: str, config: dict[str, Any], n_tokens: int, rounds: int) -> dict[str, Any]:
    from graftmem import Memory

    with tempfile.TemporaryDirectory(prefix="graftmem-byo-") as home:
        t0 = time.perf_counter()
        mem = Memory(model, config=config, home=home)
        load_s = time.perf_counter() - t0
        try:
            words = max(0, int(n_tokens / 1.3))  # about 1.3 tokens per word of this vocabulary
            manual = RULES + prose(words, seed=1) + "\n" + RULES
            t0 = time.perf_counter()
            block = mem.learn(manual, name="refunds", when_to_use="a customer asks for a refund", chat=True)
            learn_s = time.perf_counter() - t0
            text_ttft, graft_ttft, decode_rates, restore, equal, same_text = [], [], [], [], 0, 0
            for _ in range(rounds):
                t = mem.recall(TASK, max_tokens=32, mode="text")
                g = mem.recall(TASK, max_tokens=32)
                assert g.block is not None and g.block.id == block.id, "the task did not route to the manual"
                text_ttft.append(t.receipt.prefill_ms)
                graft_ttft.append(g.receipt.restore_ms + g.receipt.prefill_ms)
                restore.append(g.receipt.restore_ms)
                if g.receipt.decode_tokens > 1:
                    decode_rates.append(g.receipt.decode_tokens / (g.receipt.decode_ms / 1000))
                equal += g.receipt.first_logits_sha256 == t.receipt.first_logits_sha256
                same_text += g.text == t.text
            rep = mem.verify(block.id, samples=10)
            text_med = summary(text_ttft, digits=1)["median"]
            graft_med = summary(graft_ttft, digits=1)["median"]
            return {
                "model": model, "gguf": str(mem.engine.model_path), "config": config,
                "load_s": round(load_s, 2), "manual_tokens": block.n_tokens, "learn_s": round(learn_s, 2),
                "prefill_tokens_per_s": round(block.n_tokens / (text_med / 1000), 1),
                "text_first_token_ms": summary(text_ttft, digits=1, unit="ms", samples=True),
                "graft_first_token_ms": summary(graft_ttft, digits=1, unit="ms", samples=True),
                "restore_ms": summary(restore, digits=1, unit="ms"),
                "graft_vs_text": round(text_med / graft_med, 1),
                "decode_tokens_per_s": summary(decode_rates, digits=1) if decode_rates else None,
                "state_bytes_per_token": round(block.state_size / block.n_tokens),
                "sha_equal_rounds": f"{equal}/{rounds}", "same_answer_rounds": f"{same_text}/{rounds}",
                "verify": {"ok": rep.ok, "sha_equal": rep.sha_equal, "max_kl": rep.max_kl},
                "answer": g.text,
            }
        finally:
            mem.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2"], help="short names or GGUF paths")
    ap.add_argument("--tokens", type=int, default=1000, help="about this many tokens of manual")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    load_before = os.getloadavg()  # a shared machine: the load says how far the absolute rates are a floor
    rows = [one_model(m, {"n_ctx": args.n_ctx}, args.tokens, args.rounds) for m in args.models]
    load_after = os.getloadavg()
    print(f"{'model':14} {'tokens':>6} {'prefill/s':>9} {'text ms':>8} {'graft ms':>8} {'ratio':>6} "
          f"{'decode/s':>8} {'B/token':>8} {'SHA-eq':>6} verify")
    for r in rows:
        dec = r["decode_tokens_per_s"]["median"] if r["decode_tokens_per_s"] else "-"
        print(f"{r['model'][:14]:14} {r['manual_tokens']:>6} {r['prefill_tokens_per_s']:>9} "
              f"{r['text_first_token_ms']['median_ms']:>8} {r['graft_first_token_ms']['median_ms']:>8} "
              f"{r['graft_vs_text']:>5}x {dec:>8} {r['state_bytes_per_token']:>8} {r['sha_equal_rounds']:>6} "
              f"{r['verify']['sha_equal']}/10 max KL {r['verify']['max_kl']}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    write_results(args.out, {"rows": rows, "machine": {"loadavg_before": load_before, "loadavg_after": load_after}},
                  args=args)


if __name__ == "__main__":
    main()
