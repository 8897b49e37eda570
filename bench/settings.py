"""Which engine settings change the bytes? Measured, per model, against the default configuration.

For each variant: prefill the same text, capture the state (BLAKE3 digest), prefill a query and hash
the logits; then graft the *default* engine's state into the variant engine and compare with the
variant's own fresh logits. A setting belongs in the fingerprint's identity when it changes the state
bytes or the logits, or when a cross-setting graft is not exact.

    python -m bench.settings [--tokens 700] [--models smollm2 gemma3-270m]
"""

from __future__ import annotations

import argparse
import time

from bench.harness import RESULTS, engine, write_results
from graftmem.core import logits_sha256, state_digest
from tests.conftest import long_text

VARIANTS: dict[str, dict] = {
    "default": {},
    "n_threads=1": {"n_threads": 1},
    "n_ubatch=128": {"n_ubatch": 128},
    "n_ubatch=256,n_batch=256": {"n_ubatch": 256, "n_batch": 256},
    "n_batch=1024": {"n_batch": 1024},
    "n_ctx=4096": {"n_ctx": 4096},
    "kv=q8_0": {"type_k": "q8_0", "type_v": "q8_0"},
    "flash_attn=False": {"flash_attn": False},
    "swa_full=False": {"swa_full": False},
}


def measure(model: str, n_tokens: int) -> list[dict]:
    base = engine(model, probe=False)
    tokens = base.tokenize(long_text(n_tokens))[:n_tokens]
    query = base.tokenize(" Then the agent answers the customer", add_special=False)
    base.reset(); base.prefill(tokens)
    base_state = bytes(base.capture())
    base.prefill(query)
    base_logits = logits_sha256(base.logits())
    base.close()
    rows = []
    for name, over in VARIANTS.items():
        eng = engine(model, probe=False, **over)
        eng.reset()
        t0 = time.perf_counter()
        eng.prefill(tokens)
        t_prefill = time.perf_counter() - t0
        st = bytes(eng.capture())
        eng.prefill(query)
        fresh = logits_sha256(eng.logits())
        try:
            eng.restore(memoryview(bytearray(base_state)), len(tokens))
            eng.prefill(query)
            cross = logits_sha256(eng.logits())
        except Exception as exc:  # a foreign state may be refused outright (e.g. another KV type)
            cross = f"refused: {type(exc).__name__}"
        eng.restore(memoryview(bytearray(st)), len(tokens))
        eng.prefill(query)
        own = logits_sha256(eng.logits())
        rows.append({
            "model": model, "variant": name, "state_equal_default": st == base_state,
            "state_bytes": len(st), "logits_equal_default": fresh == base_logits,
            "own_graft_exact": own == fresh, "default_state_grafted_exact": cross == fresh,
            "prefill_s": round(t_prefill, 2), "state_digest": state_digest(st)[:20],
        })
        eng.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--out", default=str(RESULTS / "settings.json"))
    args = ap.parse_args()
    rows = [r for m in args.models for r in measure(m, args.tokens)]
    cols = ["model", "variant", "state_equal_default", "logits_equal_default", "own_graft_exact",
            "default_state_grafted_exact", "state_bytes"]
    w = [max(len(str(r[c])) for r in rows + [dict(zip(cols, cols))]) for c in cols]
    print("  ".join(c.ljust(x) for c, x in zip(cols, w)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(x) for c, x in zip(cols, w)))
    write_results(args.out, {"tokens": args.tokens, "rows": rows}, args=args)


if __name__ == "__main__":
    main()
