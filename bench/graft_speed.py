"""Cold prefill vs graft, next to llama.cpp's own server (the C++ peer), the pickle peer and the floor.

For each model and block length N, in one run, with the same GGUF, n_ctx 4096, n_batch 512,
n_ubatch 512, flash attention, f16 KV cache, swa_full (Gemma) and 2 threads everywhere:

* cold       fresh context: prefill N block tokens + the query (the paper's measure uses 1 token; the
             18-token question is timed after trimming the same fresh prefill back to N)
* graft      graftmem's own restore path (`graftmem.memory.graft`, what ``Memory.ask`` and the
             server run): read the block file into the engine buffer, check header, trailer,
             fingerprint and the state digest (the first read of a file version: BLAKE3 while reading;
             later reads of the same version: the xxh3-128 of the bytes BLAKE3 checked, computed while
             reading), for a sliding-window model past its window put the window cells back at their
             fresh indices, llama_state_seq_set_data; then the query.
             ``graft+1 b3`` is the same after touching the file (new ctime), so BLAKE3 runs again.
             From the page cache: the process's hot tier (RAM) is off here (`configure_hot_tier(0)`).
* graft hot  the same with the hot tier on (the default, 512 MiB) for a block it already admitted: one
             set_data from the checked state in RAM, then the query (``graft+1 hot``, ``hot/srv``).
* graft device  the same on an engine with ``keep_on_device``: the block it grafted last comes back from
             the copy in the context's own buffers (host RAM on a CPU; ``graft+1 device``, ``device/srv``).
* floor      the raw minimum: readinto a preallocated buffer + llama_state_seq_set_data of the stored
             bytes, no checks. For a sliding-window block past its window (Gemma), that restores fewer
             cells at the wrong indices, a state that is NOT the fresh one; its floor is then
             ``floor_placed``: readinto + placing the window cells at their fresh indices behind
             masked placeholders + set_data, still unchecked, the least work that yields the exact
             state. ``restore/floor`` uses that one where it applies (the raw one is kept in the JSON).
* server     llama-server built from the same vendored llama.cpp (bench/peer.py), on 127.0.0.1, through
             its HTTP API (httpx): cold prefill of the N tokens, ``POST /slots/0?action=save``,
             ``?action=restore``, then a completion of the cached N tokens + 1 token (cache_prompt), the
             "restore + 1" a C++ user gets. It checks no digest and no identity.
* pickle     llama_cpp.Llama.save_state() pickled to disk (what LlamaDiskCache does), restored with
             pickle.load + Llama.load_state (at --pickle-lengths only: it prefills the block again)

The timed contenders run interleaved: each of the ``--reps`` rounds runs every contender once, in a
rotating order, so that load on the shared machine hits all of them alike. Reported: medians, the
min-max spread, and per-round ratios (graft+1 / server restore+1 of the same round).

Also recorded: whether the server's restored slot gives the same next token and top-10 probabilities
as its own fresh prefill (llama-server makes no such promise), and a per-phase breakdown of a recall
(``Memory.ask`` receipts: read, check, place, set_data, task prefill, decode).

    python -m bench.graft_speed [--models smollm2 gemma3-270m] [--lengths 512 1024 2048 3000 4000]
                                [--reps 7] [--no-server] [--pickle-lengths 512 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import peer as cpp_peer
from bench.harness import RESULTS, summary, write_results
from graftmem import Engine, EngineConfig, Memory
from graftmem.core import logits_sha256, needs_placing, place_cells_into
from graftmem.memory import graft as graft_block
from graftmem.store import configure_hot_tier
from tests.conftest import long_text

QUESTION = "\nQuestion: according to the manual, what should the agent do first?\nAnswer:"
N_CTX, N_BATCH, N_UBATCH, THREADS = 4096, 512, 512, 2
PHASES = ("read_ms", "check_ms", "place_ms", "set_data_ms", "prefill_ms", "decode_ms", "restore_ms")


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def warm(path: Path) -> None:
    """Read the file once so every contender reads from the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def bench_model(model: str, lengths: list[int], reps: int, home: Path, server_exe: Path | None,
                server_note: str | None, pickle_lengths: list[int]) -> list[dict]:
    rows = []
    mem = Memory(model, home=home / model, config=EngineConfig(probe=False, n_ctx=N_CTX, n_batch=N_BATCH,
                                                               n_ubatch=N_UBATCH, n_threads=THREADS))
    eng = mem.engine
    import llama_cpp  # the pickle peer only; the library itself imports llama_cpp in core/backend.py alone

    pk_peer = llama_cpp.Llama(str(eng.model_path), n_ctx=eng.n_ctx, n_batch=N_BATCH, n_ubatch=N_UBATCH,
                              flash_attn=True, swa_full=True, n_threads=THREADS, verbose=False)
    srv = None
    if server_exe is not None:
        try:
            srv = cpp_peer.LlamaServer(server_exe, eng.model_path, Path(tempfile.mkdtemp(dir=home)),
                                       n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, threads=THREADS,
                                       swa_full=eng.config.swa_full and eng.n_swa > 0,
                                       cache_type_k=eng.config.type_k, cache_type_v=eng.config.type_v,
                                       extra_bufts=eng.extra_bufts)
        except cpp_peer.PeerUnavailable as exc:
            server_note = f"llama-server did not start: {exc}"
            print(f"!! {server_note}; the server columns are skipped", flush=True)
    for target in lengths:
        # a text of about n tokens: cut a long text at token n and learn its detokenized form
        tokens = eng.tokenize(long_text(target, seed=target))[:target]
        block = mem.learn(eng.detokenize(tokens[1:]))
        n = block.n_tokens
        if n + 32 > N_CTX:
            raise SystemExit(f"{model}: {n} tokens leave no room for the query in n_ctx={N_CTX}")
        q1 = eng.tokenize(" the", add_special=False)[:1]
        qn = eng.tokenize(QUESTION, add_special=False)
        path = mem.store.path_of(block.id)
        warm(path)

        # cold: an emptied context prefills the N tokens, then the query. One prefill of the N tokens
        # serves both queries: after the 1-token query, trimming back to N leaves the cache a fresh
        # N-token prefill leaves (tests/test_exactness.py checks that byte for byte), so N + q costs
        # the N-token prefill plus the q-token prefill measured after the trim.
        eng.reset()
        t0 = time.perf_counter()
        eng.prefill(block.tokens)
        prefill_n_ms = ms_since(t0)
        t1 = time.perf_counter()
        eng.prefill(q1)
        lg = eng.logits()
        cold_1_ms = prefill_n_ms + ms_since(t1)
        cold_sha = logits_sha256(lg)
        eng.trim(n)
        t1 = time.perf_counter()
        eng.prefill(qn)
        lg = eng.logits()
        cold_q_ms = prefill_n_ms + ms_since(t1)
        cold_q_sha = logits_sha256(lg)
        eng.reset()

        # ---- the server: cold prefill of the N tokens, save the slot, its fresh reference for +1
        srv_row: dict = {}
        slot_file = f"{model}-{n}.bin"
        if srv is not None:
            srv.erase()
            t0 = time.perf_counter()
            r = srv.complete(list(block.tokens), n_predict=1)
            srv_row["server_cold_ms"] = round(ms_since(t0), 1)
            srv_row["server_cold_prompt_ms"] = round(r["timings"]["prompt_ms"], 1)
            t0 = time.perf_counter()
            s = srv.slot("save", slot_file)
            srv_row["server_save_ms"] = round(ms_since(t0), 2)
            srv_row["server_save_inner_ms"] = round(s["timings"]["save_ms"], 2)
            srv_row["server_slot_bytes"] = s["n_written"]
            warm(srv.slot_dir / slot_file)
            fresh = srv.complete(list(block.tokens) + q1, n_predict=1, n_probs=10)  # evaluates q1 on the fresh cells
            srv.erase()

        def graft(q, touch=False):
            def run():
                if touch:
                    os.utime(path)  # a new file version: the next read checks BLAKE3 again
                t0 = time.perf_counter()
                graft_block(eng, mem.store, block)
                eng.prefill(q)
                lg = eng.logits()
                return ms_since(t0), logits_sha256(lg)
            return run

        def restore_only(touch=False):
            def run():
                if touch:
                    os.utime(path)
                t0 = time.perf_counter()
                graft_block(eng, mem.store, block)
                return ms_since(t0), None
            return run

        soff = path.stat().st_size - 32 - block.state_size

        def floor():
            t0 = time.perf_counter()
            view = eng.buffer(block.state_size)
            with open(path, "rb", buffering=0) as f:
                f.seek(soff)
                got = 0
                while got < block.state_size:
                    got += f.readinto(view[got:])
            eng.restore(view, block.n_tokens)
            return ms_since(t0), None

        def server_restore_1():
            t0 = time.perf_counter()
            inner = srv.slot("restore", slot_file)["timings"]["restore_ms"]
            t_restore = ms_since(t0)
            t1 = time.perf_counter()
            r = srv.complete(list(block.tokens) + q1, n_predict=1)
            t_one = ms_since(t1)
            return (t_restore, t_one, inner), r

        # a sliding-window block past its window stores only the window's cells; the exact state puts
        # them back at their fresh cell indices behind masked placeholder cells (docs/exactness.md), so
        # its raw floor restores a smaller state that is NOT the fresh one. The honest floor for such a
        # block is the unchecked minimum that yields the exact state: readinto + place + set_data.
        with open(path, "rb") as f:
            f.seek(soff)
            placing = needs_placing(f.read(block.state_size))
        scratch = memoryview(bytearray(block.state_size))

        def floor_placed():
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                f.seek(soff)
                got = 0
                while got < block.state_size:
                    got += f.readinto(scratch[got:])
            view = place_cells_into(scratch, block.pos_end, eng.buffer)
            eng.restore(view, block.n_tokens)
            return ms_since(t0), None

        def graft_hot():
            # what a process with the default hot tier (GRAFTMEM_HOT_TIER_MB=512) does on a block it grafted
            # twice already: set_data from the checked state in RAM, then the token. The tier is turned on
            # for this contender only (untimed: turning it on, the two grafts that admit the state)
            configure_hot_tier(512 << 20)
            try:
                graft_block(eng, mem.store, block)
                graft_block(eng, mem.store, block)
                return graft(q1)()
            finally:
                configure_hot_tier(0)

        # the same graft on an engine with ``keep_on_device`` (a second context on the same weights): the
        # block it grafted last comes back from the copy in its own buffers (on a CPU, host RAM)
        dev_eng = Engine(eng.model_path, eng.config.model_copy(update={"keep_on_device": True}))
        graft_block(dev_eng, mem.store, block)  # untimed: the copy holds this block from now on (only it grafts here)

        def graft_device():
            t0 = time.perf_counter()
            graft_block(dev_eng, mem.store, block)
            dev_eng.prefill(q1)
            lg = dev_eng.logits()
            return ms_since(t0), logits_sha256(lg)

        contenders = {"graft_1": graft(q1), "graft_1_hot": graft_hot, "graft_1_device": graft_device, "graft_1_b3": graft(q1, touch=True), "restore": restore_only(),
                      "restore_b3": restore_only(touch=True), "floor": floor}
        if placing:
            contenders["floor_placed"] = floor_placed
        if srv is not None:
            contenders["server"] = server_restore_1
        samples: dict[str, list] = {k: [] for k in contenders}
        outs: dict[str, object] = {}
        names = list(contenders)
        graft(q1)()  # warm-up: first read of this file version (BLAKE3), then the hot path is measured
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: interleaved rounds
            for k in order:
                t, out = contenders[k]()
                samples[k].append(t)
                outs.setdefault(k, out)
                if k != "server" and out is not None and out != cold_sha:
                    outs[k] = out  # keep a mismatch visible
        if srv is not None:  # the record: restored slot vs the server's own fresh prefill (untimed:
            # n_probs sorts the whole vocabulary, 262k entries for Gemma, which would swamp the +1 time)
            srv.slot("restore", slot_file)
            outs["server"] = srv.complete(list(block.tokens) + q1, n_predict=1, n_probs=10)
        graft_q_ms = summary(graft(qn)()[0] for _ in range(reps))["median"]
        gq = graft(qn)()[1]

        # ---- per-phase breakdown from Memory.ask receipts (hot file version), median over reps
        phase_rows = []
        for _ in range(max(3, reps // 2)):
            rc = mem.ask(block.id, QUESTION, max_tokens=8).receipt
            phase_rows.append(rc)
        phases = {p: round(summary(getattr(rc, p) or 0.0 for rc in phase_rows)["median"], 2) for p in PHASES}
        os.utime(path)
        rc_b3 = mem.ask(block.id, QUESTION, max_tokens=8).receipt
        phases_b3 = {p: round(getattr(rc_b3, p) or 0.0, 2) for p in PHASES}

        # ---- the pickle peer: Llama.save_state + pickle to a file, restore by unpickling + load_state
        # (its own prefill of the N tokens is the bench's largest cost: only at --pickle-lengths)
        peer_ms = pk_bytes = None
        if target in pickle_lengths:
            pk_peer.reset()
            pk_peer.eval(block.tokens)
            pk = home / f"peer-{model}-{n}.pkl"
            with open(pk, "wb") as f:
                pickle.dump(pk_peer.save_state(), f)
            warm(pk)

            def peer_restore():
                with open(pk, "rb") as f:
                    st = pickle.load(f)
                pk_peer.load_state(st)

            peer_ts = []
            for _ in range(max(2, reps // 2)):
                t0 = time.perf_counter()
                peer_restore()
                peer_ts.append(ms_since(t0))
            peer_ms = summary(peer_ts)["median"]
            pk_bytes = pk.stat().st_size
            pk.unlink()
        eng.reset()

        g1 = summary(samples["graft_1"], digits=2, samples=True)
        rs = summary(samples["restore"], digits=2, samples=True)
        fl = summary(samples["floor"], digits=2, samples=True)
        # the floor the restore is held to: the placed one where the block needs placing
        fkey = "floor_placed" if placing else "floor"
        fe = summary(samples[fkey], digits=2, samples=True)
        row = {
            "model": model, "n_tokens": n, "state_bytes": block.state_size,
            "file_bytes": path.stat().st_size, "peer_file_bytes": pk_bytes,
            "cold_1_ms": round(cold_1_ms, 1), "graft_1_ms": g1["median"],
            "speedup_1": round(cold_1_ms / g1["median"], 1),
            "graft_1": g1, "graft_1_b3": summary(samples["graft_1_b3"], digits=2, samples=True),
            "cold_q_ms": round(cold_q_ms, 1), "graft_q_ms": round(graft_q_ms, 2),
            "speedup_q": round(cold_q_ms / graft_q_ms, 1), "q_tokens": len(qn),
            "restore_ms": rs["median"], "restore": rs, "restore_b3": summary(samples["restore_b3"], digits=2, samples=True),
            "floor_ms": fl["median"], "floor": fl, "needs_placing": placing,
            "floor_placed": summary(samples["floor_placed"], digits=2, samples=True) if placing else None,
            "floor_exact_ms": fe["median"],
            "restore_vs_floor": round(rs["median"] / fe["median"], 2),
            "restore_vs_floor_rounds": summary([a / b for a, b in zip(samples["restore"], samples[fkey])], digits=2, samples=True),
            "restore_vs_raw_floor": round(rs["median"] / fl["median"], 2),
            "peer_restore_ms": peer_ms and round(peer_ms, 1),
            "peer_vs_restore": peer_ms and round(peer_ms / rs["median"], 1),
            "file_vs_state": round(path.stat().st_size / block.state_size, 4),
            "graft_1_hot": summary(samples["graft_1_hot"], digits=2, samples=True),
            "graft_1_device": summary(samples["graft_1_device"], digits=2, samples=True),
            "exact_1": (outs["graft_1"] == cold_sha and outs["graft_1_b3"] == cold_sha and outs["graft_1_hot"] == cold_sha
                        and outs["graft_1_device"] == cold_sha),
            "exact_q": gq == cold_q_sha,
            "phases_hot": phases, "phases_first_read": phases_b3,
        }
        if srv is not None:
            sr = [x[0] for x in samples["server"]]
            s1 = [x[1] for x in samples["server"]]
            inner = [x[2] for x in samples["server"]]
            tot = [x[0] + x[1] for x in samples["server"]]
            restored = outs["server"]
            row.update(srv_row)
            row.update({
                "server_restore_ms": round(summary(sr)["median"], 2), "server_restore": summary(sr, digits=2, samples=True),
                "server_restore_inner": summary(inner, digits=2, samples=True),
                "server_plus1_ms": round(summary(s1)["median"], 2), "server_plus1": summary(s1, digits=2, samples=True),
                "server_restore_1_ms": round(summary(tot)["median"], 2), "server_restore_1": summary(tot, digits=2, samples=True),
                "graft1_vs_server": summary([a / b for a, b in zip(samples["graft_1"], tot)], digits=2, samples=True),
                "graft1_hot_vs_server": summary([a / b for a, b in zip(samples["graft_1_hot"], tot)], digits=2, samples=True),
                "graft1_device_vs_server": summary([a / b for a, b in zip(samples["graft_1_device"], tot)], digits=2, samples=True),
                "server_restored_prompt_n": restored["timings"]["prompt_n"],
                "server_same_token": restored["tokens"] == fresh["tokens"],
                "server_same_top10_probs": (restored.get("completion_probabilities")
                                            == fresh.get("completion_probabilities")),
                "server_cold_vs_restore_1": round(srv_row["server_cold_ms"] / summary(tot)["median"], 1),
            })
            (srv.slot_dir / slot_file).unlink(missing_ok=True)
        rows.append(row)
        dev_eng.close()
        print(_fmt_row(row), flush=True)
    if srv is not None:
        srv.close()
    pk_peer.close()
    mem.close()
    return rows


COLS = [("model", "model"), ("n_tokens", "N"), ("state_bytes", "state B"), ("cold_1_ms", "cold N+1 ms"),
        ("graft_1_ms", "graft+1 ms"), ("speedup_1", "x(+1)"), ("graft_1_b3", "graft+1 b3 ms"),
        ("server_cold_ms", "srv cold ms"), ("server_save_ms", "srv save ms"),
        ("server_restore_ms", "srv restore ms"), ("server_plus1_ms", "srv +1 ms"),
        ("server_restore_1_ms", "srv restore+1 ms"), ("graft1_vs_server", "graft+1/srv"),
        ("graft_1_hot", "graft+1 hot ms"), ("graft1_hot_vs_server", "hot/srv"),
        ("graft_1_device", "graft+1 device ms"), ("graft1_device_vs_server", "device/srv"),
        ("cold_q_ms", "cold N+q ms"), ("graft_q_ms", "graft+q ms"), ("speedup_q", "x(+q)"),
        ("restore_ms", "restore ms"), ("floor_exact_ms", "floor ms"), ("restore_vs_floor", "vs floor"),
        ("peer_restore_ms", "pickle ms"), ("peer_vs_restore", "pickle/ours"), ("file_vs_state", "file/state"),
        ("exact_q", "exact"), ("server_same_top10_probs", "srv restored==fresh")]


def _cell(v: object) -> str:
    if isinstance(v, dict):
        return f"{v['median']} [{v['min']}-{v['max']}]"
    return "-" if v is None else str(v)


def _fmt_row(r: dict) -> str:
    return " | ".join(_cell(r.get(k)) for k, _ in COLS)


def _md_span(d: dict | None, nd: int = 1) -> str:
    if not d:
        return "-"
    return f"{d['median']:,.{nd}f} [{d['min']:,.{nd}f}–{d['max']:,.{nd}f}]"


def markdown(result: dict) -> str:
    """The tables of docs/benchmarks.md, from a results JSON."""
    out = ["| model | N | state MB | cold N+1 ms | graft+1 ms | cold/graft+1 | graft+1 first read (BLAKE3) ms | "
           "server restore+1 ms | graft+1 / server (per round) | server restore ms (inner) | server +1 ms | "
           "server save ms | server cold ms | restore ms | floor ms | restore/floor | pickle peer ms | exact | "
           "server restored == fresh |",
           "|" + "---|" * 19]
    for r in result["rows"]:
        srv = "server_restore_1" in r
        out.append(" | ".join([
            "", r["model"], str(r["n_tokens"]), f"{r['state_bytes'] / 1e6:.1f}", f"{r['cold_1_ms']:,.0f}",
            _md_span(r["graft_1"]), f"**{r['speedup_1']:.0f}x**", _md_span(r["graft_1_b3"]),
            _md_span(r.get("server_restore_1")), f"**{_md_span(r.get('graft1_vs_server'), 2)}**" if srv else "-",
            (f"{r['server_restore_ms']:.1f} ({r['server_restore_inner']['median']:.1f})" if srv else "-"),
            f"{r['server_plus1_ms']:.1f}" if srv else "-", f"{r['server_save_ms']:.1f}" if srv else "-",
            f"{r['server_cold_ms']:,.0f}" if srv else "-",
            _md_span(r["restore"]),
            (f"{_md_span(r['floor_placed'])} (raw {r['floor']['median']:.1f})" if r.get("needs_placing")
             else _md_span(r["floor"])), f"{r['restore_vs_floor']:.2f}",
            f"{r['peer_restore_ms']:,.0f}" if r["peer_restore_ms"] else "-", str(r["exact_1"] and r["exact_q"]),
            (f"{r['server_same_top10_probs']} (token {r['server_same_token']}, "
             f"{r['server_restored_prompt_n']} evaluated)" if srv else "-"), ""]).strip())
    out += ["", "| model | N | read | check | place | set_data | task prefill (18 tok) | decode (8 tok) | restore "
            "| first read: check | first read: restore |", "|" + "---|" * 11]
    for r in result["rows"]:
        h, b = r["phases_hot"], r["phases_first_read"]
        out.append(" | ".join(["", r["model"], str(r["n_tokens"]), *(f"{h[k]:.2f}" for k in (
            "read_ms", "check_ms", "place_ms", "set_data_ms", "prefill_ms", "decode_ms", "restore_ms")),
            f"{b['check_ms']:.2f}", f"{b['restore_ms']:.2f}", ""]).strip())
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", metavar="JSON", help="print the docs tables of a results file and exit")
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 3000, 4000])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-server", action="store_true", help="skip the llama-server peer")
    ap.add_argument("--pickle-lengths", nargs="*", type=int, default=[512, 3000],
                    help="lengths at which the pickle peer runs (it prefills the block once more)")
    ap.add_argument("--out", default=str(RESULTS / "graft_speed.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run atexit: stop the llama-server it started
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    exe, note, build = None, None, {}
    if not args.no_server:
        try:
            exe = cpp_peer.build()
            build = cpp_peer.build_record()
        except (cpp_peer.PeerUnavailable, OSError) as exc:
            note = f"llama-server could not be built: {exc}"
            print(f"!! {note}\n!! the llama-server columns are skipped", flush=True)
    configure_hot_tier(0)  # every graft from the page cache: what the floor and llama-server read from
    print(" | ".join(h for _, h in COLS))
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for m in args.models for r in bench_model(m, args.lengths, args.reps, Path(tmp), exe, note,
                                                 args.pickle_lengths)]
    load = os.getloadavg()
    write_results(args.out, {
        "cpu_count": os.cpu_count(), "n_ctx": N_CTX, "reps": args.reps,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 1), "loadavg_at_end": [round(x, 2) for x in load],
        "llama_server": {"available": exe is not None, "note": note, "exe": str(exe) if exe else None,
                         **build},
        "rows": rows}, args=args, threads=THREADS)


if __name__ == "__main__":
    main()
