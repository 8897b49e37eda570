"""Per-GB rates of each restore phase, and what they mean for a model we cannot run here.

Nothing larger than 270M runs on this machine, but a graft's cost is linear in the state's bytes and
each phase has a rate. Measured here, interleaved across sizes, median of ``--reps``:

* read      ``readinto`` a preallocated buffer from a file in the page cache (warm) and after
            ``posix_fadvise(DONTNEED)`` dropped the file's pages (cold: the disk's rate)
* blake3    the digest a block's first read of a file version checks, with graftmem's setting
            (``max_threads=AUTO`` above 1 MiB: BLAKE3's tree over every core) and on one thread
* xxh3      the xxh3-128 later reads of the same file version check (`graftmem.store.verified`)
* set_data  ``llama_state_seq_set_data`` of real SmolLM2 states (512..``--set-tokens`` tokens; a
            memcpy into the KV tensors, so its rate is read off the largest)
* prefill   SmolLM2-135M and Gemma 3 270M tokens/s at ``--prefill-tokens`` (2 threads), converted to
            an effective FLOP/s (2 x parameters x tokens/s, the linear layers only)

Synthetic states of 0.1..``--max-gb`` GB for read and hash (their speed does not depend on the bytes).
Then the projection for Llama-3.1-8B (32 layers, 8 KV heads x 128, KV f16 = 128 KiB/token, q8_0 =
68 KiB/token) at 3k and 32k tokens, on this CPU and on a GPU host with assumed rates (printed with
their sources in the JSON and in docs/benchmarks.md).

    python -m bench.restore_rates [--max-gb 4] [--reps 3] [--out bench/results/restore_rates.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import blake3
import numpy as np
import xxhash

from bench.harness import RESULTS, engine, summary, write_results

GB = 1e9
CHUNK = 64 << 20

#: Llama-3.1-8B's shape (its config.json): 32 layers, 8 KV heads of 128, 8.03 B parameters.
LLAMA8B = {"n_layer": 32, "n_kv_head": 8, "head_dim": 128, "params": 8.03e9}
#: Assumed GPU-host rates, with where they come from (none is measured here).
GPU_ASSUMED = {
    "prefill_tok_s": (6700, "llama.cpp llama-bench pp512, RTX 4090, llama 7B Q4_0: 7,980 t/s (ggml-org/llama.cpp "
                            "PR #4766), scaled by parameters 6.74/8.03; a datacenter GPU is faster, long "
                            "contexts slower (attention), so this favours prefill at 32k"),
    "h2d_gb_s": (25.0, "PCIe 4.0 x16 host-to-device, practical (32 GB/s theoretical): set_data into VRAM tensors"),
    "read_cold_gb_s": (6.0, "one PCIe 4.0 NVMe SSD, sequential read (vendor figures 5-7 GB/s)"),
    "read_warm_gb_s": (10.0, "page cache to a user buffer on a server CPU (one memcpy stream)"),
    "cores": (16, "a GPU host's CPU cores given to hashing (BLAKE3's tree runs on all of them; this "
                  "machine's one-thread rate times the cores)"),
}


def _fill(buf: memoryview) -> None:
    """Random-looking bytes, one random 64 MiB chunk tiled (hash and read speeds ignore the values)."""
    chunk = np.random.default_rng(0).integers(0, 256, size=min(CHUNK, len(buf)), dtype=np.uint8).tobytes()
    for off in range(0, len(buf), len(chunk)):
        n = min(len(chunk), len(buf) - off)
        buf[off:off + n] = chunk[:n]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _read_into(path: Path, buf: memoryview, cold: bool) -> None:
    with open(path, "rb", buffering=0) as f:
        if cold:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise OSError(f"{path}: short read")
            got += n


def io_and_hash_rates(sizes_gb: list[float], reps: int, tmp: Path) -> dict:
    out: dict = {}
    big = int(max(sizes_gb) * GB)
    buf = memoryview(bytearray(big))
    _fill(buf)
    for gb in sizes_gb:
        n = int(gb * GB)
        path = tmp / f"state-{gb}.bin"
        with open(path, "wb") as f:
            f.write(buf[:n])
            f.flush()
            os.fsync(f.fileno())
        out[str(gb)] = {"bytes": n, "read_warm": [], "read_cold": [], "blake3_auto": [], "blake3_1": [], "xxh3": []}
    for _ in range(reps):  # interleaved: every size and phase once per round
        for gb in sizes_gb:
            row, n = out[str(gb)], int(gb * GB)
            path, view = tmp / f"state-{gb}.bin", buf[:n]
            row["read_cold"].append(_timed(lambda: _read_into(path, view, True)))
            row["read_warm"].append(_timed(lambda: _read_into(path, view, False)))
            row["blake3_auto"].append(_timed(lambda: blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()))
            row["blake3_1"].append(_timed(lambda: blake3.blake3(view).digest()))
            row["xxh3"].append(_timed(lambda: xxhash.xxh3_128(view).digest()))
    for gb in sizes_gb:
        (tmp / f"state-{gb}.bin").unlink()
        row = out[str(gb)]
        for k in ("read_warm", "read_cold", "blake3_auto", "blake3_1", "xxh3"):
            row[k] = summary(row[k], unit="s")
            row[k]["gb_s"] = row["bytes"] / GB / row[k]["median_s"]
    return out


def engine_rates(set_tokens: int, prefill_tokens: int, reps: int) -> dict:
    words = "the agent reads a manual and follows each step before it answers about orders refunds".split()
    text = " ".join(words[i % len(words)] for i in range(max(set_tokens, prefill_tokens) * 2))
    out: dict = {"set_data": {}, "prefill": {}}
    with engine("smollm2", n_ctx=max(set_tokens, prefill_tokens) + 64) as eng:
        toks = eng.tokenize(text)
        lengths = [n for n in (512, 1024, 2048, 4096, 8192) if n <= set_tokens]
        states = {}
        with eng.session():
            done = 0
            for n in lengths:  # one prefill, captured at each length
                eng.prefill(toks[done:n])
                done = n
                states[n] = memoryview(bytearray(bytes(eng.capture())))
        for n in lengths:
            ms = summary((eng.restore(states[n], n) for _ in range(reps)), unit="ms")
            out["set_data"][str(n)] = {"bytes": len(states[n]), **ms,
                                       "gb_s": len(states[n]) / GB / (ms["median_ms"] / 1e3)}
        eng.reset()
    for model, params in (("smollm2", 134.5e6), ("gemma3-270m", 268e6)):
        with engine(model, n_ctx=prefill_tokens + 64, probe=False) as eng:
            toks = eng.tokenize(text)[:prefill_tokens]
            secs = []
            for _ in range(reps):
                with eng.session():
                    secs.append(_timed(lambda: eng.prefill(toks)))
            median_s = summary(secs)["median"]
            tok_s = prefill_tokens / median_s
            out["prefill"][model] = {"tokens": prefill_tokens, "threads": eng.n_threads, "median_s": median_s,
                                     "tok_s": tok_s, "params": params, "effective_gflop_s": 2 * params * tok_s / 1e9}
    return out


def project(rates: dict, engine: dict) -> list[dict]:
    """Graft vs prefill for Llama-3.1-8B from the measured rates (largest size measured for each)."""
    io = rates[max(rates, key=float)]
    set_gb_s = engine["set_data"][max(engine["set_data"], key=int)]["gb_s"]
    flops = max(p["effective_gflop_s"] for p in engine["prefill"].values()) * 1e9
    cpu_tok_s = flops / (2 * LLAMA8B["params"])
    per_tok = {"f16": 2 * LLAMA8B["n_layer"] * LLAMA8B["n_kv_head"] * LLAMA8B["head_dim"] * 2}
    per_tok["q8_0"] = per_tok["f16"] * 34 // 64  # q8_0: 34 bytes per 32 values
    rows = []
    for kv, bpt in per_tok.items():
        for tokens in (3000, 32000):
            gb = tokens * bpt / GB
            read_w, read_c = gb / io["read_warm"]["gb_s"], gb / io["read_cold"]["gb_s"]
            b3, b3_1, x3 = gb / io["blake3_auto"]["gb_s"], gb / io["blake3_1"]["gb_s"], gb / io["xxh3"]["gb_s"]
            cpu_set = gb / set_gb_s
            gpu_set = gb / GPU_ASSUMED["h2d_gb_s"][0]
            # the GPU host's own disk, page cache and cores (assumed), the same xxh3 rate per byte
            g_read_c, g_read_w = gb / GPU_ASSUMED["read_cold_gb_s"][0], gb / GPU_ASSUMED["read_warm_gb_s"][0]
            g_b3 = gb / (io["blake3_1"]["gb_s"] * GPU_ASSUMED["cores"][0])
            row = {"model": "Llama-3.1-8B", "kv": kv, "tokens": tokens, "state_gb": round(gb, 3),
                   "read_warm_s": read_w, "read_cold_s": read_c, "blake3_s": b3, "blake3_1thread_s": b3_1, "xxh3_s": x3,
                   "cpu": {"set_data_s": cpu_set, "graft_first_read_s": read_c + b3 + cpu_set,
                           "graft_later_read_s": read_w + x3 + cpu_set, "prefill_s": tokens / cpu_tok_s},
                   "gpu": {"set_data_s": gpu_set, "read_cold_s": g_read_c, "blake3_s": g_b3,
                           "graft_first_read_s": g_read_c + g_b3 + gpu_set,
                           "graft_later_read_s": g_read_w + x3 + gpu_set,
                           # read, check and copy as a pipeline of chunks: the slowest phase, not the sum
                           "graft_first_pipelined_s": max(g_read_c, g_b3, gpu_set),
                           "prefill_s": tokens / GPU_ASSUMED["prefill_tok_s"][0]}}
            for host in ("cpu", "gpu"):
                h = row[host]
                h["speedup_first"] = h["prefill_s"] / h["graft_first_read_s"]
                h["speedup_later"] = h["prefill_s"] / h["graft_later_read_s"]
                h["check_share_first"] = (b3 if host == "cpu" else g_b3) / h["graft_first_read_s"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set-tokens", type=int, default=4096, help="largest SmolLM2 state restored (tokens)")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--tmp", type=Path, default=None, help="where the synthetic state files go (a real disk)")
    ap.add_argument("--out", type=Path, default=RESULTS / "restore_rates.json")
    args = ap.parse_args(argv)
    sizes = [s for s in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0) if s <= args.max_gb]
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="graftmem-rates-") as tmp:
        rates = io_and_hash_rates(sizes, args.reps, Path(tmp))
    engine = engine_rates(args.set_tokens, args.prefill_tokens, args.reps)
    out = {"machine": {"load_avg": os.getloadavg()},
           "rates": rates, "engine": engine, "gpu_assumed": {k: {"value": v, "source": s} for k, (v, s) in GPU_ASSUMED.items()},
           "projection": project(rates, engine)}
    write_results(args.out, out, args=args, indent=1)
    top = rates[str(sizes[-1])]
    sys.stdout.write(f"at {sizes[-1]} GB: read warm {top['read_warm']['gb_s']:.2f} GB/s, cold {top['read_cold']['gb_s']:.2f}, "
                     f"blake3 {top['blake3_auto']['gb_s']:.2f} (1 thread {top['blake3_1']['gb_s']:.2f}), "
                     f"xxh3 {top['xxh3']['gb_s']:.2f}; set_data "
                     f"{max(v['gb_s'] for v in engine['set_data'].values()):.2f} GB/s\n")
    for r in out["projection"]:
        sys.stdout.write(f"{r['model']} {r['kv']} {r['tokens']} tok ({r['state_gb']} GB): cpu graft "
                         f"{r['cpu']['graft_first_read_s']:.2f}/{r['cpu']['graft_later_read_s']:.2f} s vs prefill "
                         f"{r['cpu']['prefill_s']:.0f} s; gpu graft {r['gpu']['graft_first_read_s']:.2f}/"
                         f"{r['gpu']['graft_later_read_s']:.2f} s (pipelined {r['gpu']['graft_first_pipelined_s']:.2f} s) "
                         f"vs prefill {r['gpu']['prefill_s']:.2f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
