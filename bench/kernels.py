"""What llama.cpp's extra weight buffer types (CPU repack, AMX) cost or gain, and whether they stay exact.

For each model and each setting of `EngineConfig.extra_bufts` (off, the default, and on): the weight
buffer types llama.cpp chose, prefill and decode speed (interleaved repetitions, medians and spreads),
and the exactness of a graft (restore + query == fresh prefill + query, SHA-256 of the logits) at the
given length. The "on" setting is first run in a child process (`graftmem.core.kernels.kernel_verdict`):
on a host where those kernels crash, its row says so instead of taking this script down.

    python -m bench.kernels [--models smollm2 gemma3-270m] [--tokens 512] [--decode 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from bench.harness import RESULTS, engine, summary, write_results
from graftmem import EngineConfig, system_report
from graftmem.core import Engine, logits_sha256, probe_kernels
from tests.conftest import long_text


def one_rep(eng: Engine, tokens: list[int], query: list[int], n_decode: int) -> dict:
    with eng.session():
        t0 = time.perf_counter()
        eng.prefill(tokens)
        prefill_s = time.perf_counter() - t0
        state = bytes(eng.capture())
        eng.prefill(query)
        fresh = logits_sha256(eng.logits())
        eng.restore(memoryview(bytearray(state)), len(tokens))
        eng.prefill(query)
        graft = logits_sha256(eng.logits())
        tok = int(eng.logits().argmax())
        t0 = time.perf_counter()
        for _ in range(n_decode):
            eng.prefill([tok])
            tok = int(eng.logits().argmax())
        decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(tokens) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "graft_equal": graft == fresh, "fresh_sha": fresh}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "kernels.json"))
    args = ap.parse_args()
    out: dict = {"system": system_report(), "platform": platform.platform(),
                 "loadavg_before": os.getloadavg()[0], "tokens": args.tokens, "decode": args.decode,
                 "reps": args.reps, "models": {}}
    for model in args.models:
        engines: dict[str, Engine] = {}
        rows: dict[str, dict] = {}
        for setting in ("off", "on"):
            cfg = EngineConfig(extra_bufts=setting, n_ctx=4096)
            if setting == "on":
                verdict = probe_kernels(model, cfg, extra_bufts=True)
                if not verdict.ran:
                    rows[setting] = {"verdict": verdict.model_dump()}
                    continue
            eng = engine(model, **cfg.model_dump(exclude_unset=True))
            engines[setting] = eng
            rows[setting] = {"weight_buffers": eng.weight_buffers, "extra_bufts_used": eng.extra_bufts,
                             "fingerprint": eng.fingerprint.digest(), "exact": eng.exactness.model_dump(), "reps": []}
        base = next(iter(engines.values()))
        tokens = base.tokenize(long_text(args.tokens))[:args.tokens]
        query = base.tokenize(" Then the agent answers the customer", add_special=False)
        for _ in range(args.reps):  # interleaved: the machine's drift hits both settings alike
            for setting, eng in engines.items():
                rows[setting]["reps"].append(one_rep(eng, tokens, query, args.decode))
        for setting, row in rows.items():
            reps = row.get("reps")
            if reps:
                row["prefill_tok_s"] = summary((r["prefill_tok_s"] for r in reps), digits=1)
                row["decode_tok_s"] = summary((r["decode_tok_s"] for r in reps), digits=1)
                row["graft_equal"] = f"{sum(r['graft_equal'] for r in reps)}/{len(reps)}"
                row["fresh_sha"] = sorted({r["fresh_sha"][:16] for r in reps})
                del row["reps"]
        if all("prefill_tok_s" in rows[s] for s in ("off", "on")):
            rows["on_vs_off"] = {
                "prefill": round(rows["on"]["prefill_tok_s"]["median"] / rows["off"]["prefill_tok_s"]["median"], 2),
                "decode": round(rows["on"]["decode_tok_s"]["median"] / rows["off"]["decode_tok_s"]["median"], 2),
                "same_logits": rows["on"]["fresh_sha"] == rows["off"]["fresh_sha"]}
        for eng in engines.values():
            eng.close()
        out["models"][model] = rows
        print(f"{model}: " + json.dumps({k: {kk: v.get(kk) for kk in ("weight_buffers", "prefill_tok_s", "decode_tok_s",
                                                                      "graft_equal")} if "reps" not in v and k != "on_vs_off"
                                          else v for k, v in rows.items()}, default=str))
    out["loadavg_after"] = os.getloadavg()[0]
    write_results(args.out, out, args=args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
