"""Cold prefill vs graft, next to the peer (Llama.save_state + pickle) and the floor.

For each model and block length N, in one run:

* cold       fresh context: prefill N block tokens + the query (the paper's measure uses 1 token)
* graft      graftmem's own restore path (``load_state``, what ``Memory.ask`` runs): read the block
             file into the engine buffer while hashing it, check BLAKE3 digest and fingerprint, for a
             sliding-window model past its window put the window cells back at their fresh indices
             (placeholder cells), llama_state_seq_set_data; then prefill the query
* floor      the raw minimum: readinto a preallocated buffer + llama_state_seq_set_data of the stored
             bytes, no checks (for Gemma past its window: no cell placement either, so fewer cells)
* peer       what a user would pick today: llama_cpp.Llama.save_state() pickled to disk (what
             LlamaDiskCache does), restored with pickle.load + Llama.load_state, then the query

Speedups are ratios measured in the same run (absolute times drift on shared machines).

    python bench/graft_speed.py [--models smollm2 gemma3-270m] [--lengths 512 1024 2048 3000 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graftmem import EngineConfig, Memory  # noqa: E402
from graftmem.core import logits_sha256  # noqa: E402
from graftmem.store import load_state  # noqa: E402
from tests.conftest import long_text  # noqa: E402

QUESTION = "\nQuestion: according to the manual, what should the agent do first?\nAnswer:"


def timed(fn, reps: int) -> tuple[float, object]:
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), out


def drop_page_cache_hint(path: Path) -> None:
    """Warm the page cache the same way for every contender (all read from page cache)."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def bench_model(model: str, lengths: list[int], reps: int, home: Path, threads: int | None) -> list[dict]:
    rows = []
    mem = Memory(model, home=home / model, config=EngineConfig(probe=False, n_threads=threads))
    eng = mem.engine
    import llama_cpp  # the peer only; the library itself imports llama_cpp in _engine.py alone

    peer = llama_cpp.Llama(str(eng.model_path), n_ctx=eng.n_ctx, n_batch=eng.config.n_batch,
                           n_ubatch=eng.config.n_ubatch, flash_attn=True, swa_full=True,
                           n_threads=eng.n_threads, verbose=False)
    for n in lengths:
        # a text of about n tokens: cut a long text at token n and learn its detokenized form
        tokens = eng.tokenize(long_text(n, seed=n))[:n]
        block = mem.learn(eng.detokenize(tokens[1:]))
        n = block.n_tokens
        q1 = eng.tokenize(" the", add_special=False)[:1]
        qn = eng.tokenize(QUESTION, add_special=False)
        path = mem.store.path_of(block.id)
        drop_page_cache_hint(path)

        def cold(q):
            eng.reset()
            t0 = time.perf_counter()
            eng.prefill(block.tokens)
            eng.prefill(q)
            lg = eng.logits()
            return (time.perf_counter() - t0) * 1e3, logits_sha256(lg)

        cold_1_ms, cold_sha = cold(q1)
        cold_q_ms, cold_q_sha = cold(qn)

        def graft(q):
            def run():
                _, view = load_state(mem.store, block.id, eng.buffer, fingerprint=eng.fingerprint)
                eng.restore(view, block.n_tokens)
                eng.prefill(q)
                return logits_sha256(eng.logits())
            return run

        def restore_only():  # the library's restore path (Memory.ask): read, check, place window cells, graft
            _, view = load_state(mem.store, block.id, eng.buffer, fingerprint=eng.fingerprint)
            eng.restore(view, block.n_tokens)

        graft_1_ms, g1 = timed(graft(q1), reps)
        graft_q_ms, gq = timed(graft(qn), reps)
        restore_ms, _ = timed(restore_only, reps)
        soff = path.stat().st_size - 32 - block.state_size

        def floor():
            view = eng.buffer(block.state_size)
            with open(path, "rb", buffering=0) as f:
                f.seek(soff)
                got = 0
                while got < block.state_size:
                    got += f.readinto(view[got:])
            eng.restore(view, block.n_tokens)

        floor_ms, _ = timed(floor, reps)
        # the peer: Llama.save_state + pickle to a file, restore by unpickling + load_state
        peer.reset()
        peer.eval(block.tokens)
        pk = home / f"peer-{model}-{n}.pkl"
        with open(pk, "wb") as f:
            pickle.dump(peer.save_state(), f)
        drop_page_cache_hint(pk)

        def peer_restore():
            with open(pk, "rb") as f:
                st = pickle.load(f)
            peer.load_state(st)

        peer_ms, _ = timed(peer_restore, max(2, reps // 2))

        def peer_graft():
            peer_restore()
            peer.eval(q1)
        peer_1_ms, _ = timed(peer_graft, max(2, reps // 2))
        eng.reset()
        rows.append({
            "model": model, "n_tokens": n, "state_bytes": block.state_size,
            "file_bytes": path.stat().st_size, "peer_file_bytes": pk.stat().st_size,
            "cold_1_ms": round(cold_1_ms, 1), "graft_1_ms": round(graft_1_ms, 2),
            "speedup_1": round(cold_1_ms / graft_1_ms, 1),
            "cold_q_ms": round(cold_q_ms, 1), "graft_q_ms": round(graft_q_ms, 2),
            "speedup_q": round(cold_q_ms / graft_q_ms, 1), "q_tokens": len(qn),
            "restore_ms": round(restore_ms, 2), "floor_ms": round(floor_ms, 2),
            "restore_vs_floor": round(restore_ms / floor_ms, 2),
            "peer_restore_ms": round(peer_ms, 1), "peer_vs_restore": round(peer_ms / restore_ms, 1),
            "peer_graft_1_ms": round(peer_1_ms, 1),
            "file_vs_state": round(path.stat().st_size / block.state_size, 4),
            "exact_1": g1 == cold_sha, "exact_q": gq == cold_q_sha,
        })
        pk.unlink()
        print(_fmt_row(rows[-1]), flush=True)
    peer.close()
    mem.close()
    return rows


COLS = [("model", "model"), ("n_tokens", "N"), ("state_bytes", "state B"), ("cold_1_ms", "cold N+1 ms"),
        ("graft_1_ms", "graft+1 ms"), ("speedup_1", "x(+1)"), ("cold_q_ms", "cold N+q ms"),
        ("graft_q_ms", "graft+q ms"), ("speedup_q", "x(+q)"), ("restore_ms", "restore ms"),
        ("floor_ms", "floor ms"), ("restore_vs_floor", "vs floor"), ("peer_restore_ms", "peer ms"),
        ("peer_vs_restore", "peer/ours"), ("file_vs_state", "file/state"), ("exact_q", "exact")]


def _fmt_row(r: dict) -> str:
    return " | ".join(str(r[k]) for k, _ in COLS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 3000, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "graft_speed.json"))
    args = ap.parse_args()
    print(" | ".join(h for _, h in COLS))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for m in args.models for r in bench_model(m, args.lengths, args.reps, Path(tmp), args.threads)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu_count": os.cpu_count(), "threads": args.threads,
                                          "command": " ".join(sys.argv), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
