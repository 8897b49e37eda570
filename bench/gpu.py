"""Grafts on a GPU backend: are they byte-exact there, and what do graft and prefill cost for an 8B model?

No GPU is in this project's CI and no GPU model can be downloaded, so this bench builds what it needs
from the sdist-vendored tokenizer (Llama 3's BPE vocab and the Llama 3.1 chat template,
``scripts/tiny_models.py``) and random weights, on the host it runs on:

* **exactness** (``small``): a random-weight model with SmolLM2-135M's shape (30 layers, 576 wide, 9
  heads, 3 KV heads) in f16 and in Q4_0 weights (cuBLAS and the quantized matmul kernels), each with
  flash attention on (KV f16 and q8_0) and off. Per setting: the load-time probe, then a 2,000-token
  prefix (four micro-batches) captured, a short suffix (9 tokens) and 16 greedy tokens: a second fresh run
  (run-to-run determinism), a graft of the captured state (logits SHA-256 and tokens), the capture
  after the graft (the same bytes?), and graftmem's own `Memory.verify` (graft vs a fresh prefill in a
  child process). The same model on the CPU backend in the same process: its logits differ from the
  GPU's (another computation), so its fingerprint must differ too.
* **rates** (``big``): a random-weight model with Llama-3.1-8B's shape (32 layers, 4096 wide, 32
  heads, 8 KV heads, FFN 14,336, 128,256-token vocab; Q4_0, one random layer's tensors repeated in
  every layer: the kernels' speed does not depend on the values), all layers offloaded. Per KV type
  (f16, q8_0) and prompt length (3,072 and 32,768 tokens): a cold prefill to the first token's logits,
  the capture (``llama_state_seq_get_data``, device to host), the restore (``set_data``, host to
  device) and a graft's first token (restore + a one-token prefill), median of ``--reps``; the graft's
  first-token logits against the cold prefill's (byte-exact at 8B shape too?). Then the same state kept
  on the device (`Engine.copy_on_device`: llama.cpp's ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``, a copy in the
  context's buffers) and grafted from there: the copy's time, the restore's, the first token's, and
  its logits against the cold prefill's.
* **io**: the read / BLAKE3 / xxh3 rates of `bench.restore_rates` on this host's disk and cores.

    python -m bench.gpu [--gpu-layers 999] [--only small,big,io] [--reps 3] [--out FILE]
    python -m bench.gpu --table bench/results/gpu_h200.json     # the table of docs/benchmarks.md

What a CUDA build of llama-cpp-python needs: docs/exactness.md ("GPU offload"); ``bench/gpu_check.sh``
builds one from the sdist's llama.cpp sources on a CUDA host and runs this script. Results:
bench/results/gpu_h200.json, docs/benchmarks.md and docs/exactness.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from bench.harness import RESULTS, summary, write_results
from graftmem import Engine, EngineConfig, Memory, UnsupportedFeature, logits_sha256, system_report

_TINY = Path(__file__).resolve().parent.parent / "scripts" / "tiny_models.py"

#: SmolLM2-135M's shape (its config.json) and Llama-3.1-8B's.
SMALL = {"n_embd": 576, "n_layer": 30, "n_head": 9, "n_kv_head": 3, "n_ff": 1536}
BIG = {"n_embd": 4096, "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_ff": 14336}
WORDS = ("the agent reads a manual and follows each step before it answers about orders refunds "
         "shipping returns warranty invoices accounts passwords").split()


def _tiny():
    if "graftmem_tiny_models" in sys.modules:
        return sys.modules["graftmem_tiny_models"]
    spec = importlib.util.spec_from_file_location("graftmem_tiny_models", _TINY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["graftmem_tiny_models"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def shaped_model(shape: dict[str, int], wtype: str, *, seed: int = 0, repeat_layers: bool = False) -> Path:
    """A random-weight ``llama`` GGUF of ``shape`` with Llama 3's tokenizer and the Llama 3.1 template,
    weights ``f16`` or ``q4_0``; cached by every input. ``repeat_layers`` writes one random layer's
    tensors into every layer (fast to build at 8B; speed does not depend on the values)."""
    tm = _tiny()
    gguf = tm._gguf()
    vocab = tm.vocab_path("llama-bpe")
    tpl = tm.templates_dir() / "meta-llama-Llama-3.1-8B-Instruct.jinja"
    blob = json.dumps({"shape": shape, "wtype": wtype, "seed": seed, "repeat": repeat_layers, "recipe": 1,
                       "vocab": tm._sha(vocab), "tpl": tm._sha(tpl)}, sort_keys=True)
    out = tm.cache_root() / "shaped" / f"llama-{shape['n_layer']}x{shape['n_embd']}-{wtype}-" \
        f"{hashlib.sha256(blob.encode()).hexdigest()[:12]}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    kv = tm.read_kv(vocab)
    n_vocab = len(kv["tokenizer.ggml.tokens"][2])
    e, n_ff, n_head, n_kv = shape["n_embd"], shape["n_ff"], shape["n_head"], shape["n_kv_head"]
    hd = e // n_head
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"graftmem shaped {out.stem}")
    w.add_context_length(131072)
    w.add_embedding_length(e)
    w.add_block_count(shape["n_layer"])
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "q4_0": gguf.GGMLQuantizationType.Q4_0}[wtype]
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if wtype == "f16" else gguf.LlamaFileType.MOSTLY_Q4_0)
    tm.copy_tokenizer(w, kv, tpl)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, scale: float) -> np.ndarray:
        a = rng.standard_normal((rows, cols), dtype=np.float32) * scale
        if wtype == "f16":
            return a.astype(np.float16)
        return gguf.quants.quantize(a, qtype)

    def add(name: str, arr: np.ndarray) -> None:
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", weight(n_vocab, e, 1.0))  # tied output (no output.weight)
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    layer: dict[str, np.ndarray] = {}
    for i in range(shape["n_layer"]):
        if not layer or not repeat_layers:
            layer = {"attn_q": weight(e, e, e ** -0.5), "attn_k": weight(n_kv * hd, e, e ** -0.5),
                     "attn_v": weight(n_kv * hd, e, e ** -0.5), "attn_output": weight(e, e, e ** -0.5),
                     "ffn_gate": weight(n_ff, e, e ** -0.5), "ffn_up": weight(n_ff, e, e ** -0.5),
                     "ffn_down": weight(e, n_ff, n_ff ** -0.5)}
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(e, dtype=np.float32))
        for t, arr in layer.items():
            add(p + t + ".weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def _tokens(eng: Engine, n: int, offset: int = 0) -> list[int]:
    text = " ".join(WORDS[(i * 7 + offset) % len(WORDS)] + ("." if i % 13 == 12 else "") for i in range(n + 64))
    toks = eng.tokenize(text)
    assert len(toks) >= n, (len(toks), n)
    return toks[:n]


def _greedy(eng: Engine, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(np.argmax(eng.logits()))
        out.append(tok)
        eng.prefill([tok])
    return out


def graft_check(eng: Engine, n_prefix: int = 2000, n_suffix: int = 24, n_decode: int = 16) -> dict[str, Any]:
    """Fresh (twice) vs graft on one engine: logits SHA-256 after the suffix, greedy tokens, state bytes."""
    prefix = _tokens(eng, n_prefix)
    suffix = eng.tokenize(" and then the agent answers the question about refunds", add_special=False)[:n_suffix]
    with eng.session():
        eng.prefill(prefix)
        state = bytes(eng.capture())
        eng.prefill(suffix)
        logits = eng.logits().copy()
        fresh = logits_sha256(logits)
        fresh_tokens = _greedy(eng, n_decode)
    with eng.session():
        eng.prefill(prefix)
        eng.prefill(suffix)
        fresh2 = logits_sha256(eng.logits())
        fresh2_tokens = _greedy(eng, n_decode)
    with eng.session():
        restore_ms = eng.restore(memoryview(bytearray(state)), len(prefix))
        recaptured = bytes(eng.capture()) == state
        eng.prefill(suffix)
        graft = logits_sha256(eng.logits())
        graft_tokens = _greedy(eng, n_decode)
    return {"prefix_tokens": len(prefix), "suffix_tokens": len(suffix), "state_bytes": len(state),
            "logits_finite": bool(np.isfinite(logits).all()), "logits_std": float(np.std(logits)),
            "fresh_sha": fresh, "fresh_again_sha": fresh2, "graft_sha": graft,
            "deterministic": fresh == fresh2 and fresh_tokens == fresh2_tokens,
            "graft_equal": fresh == graft, "tokens_equal": fresh_tokens == graft_tokens,
            "recaptured_equal": recaptured, "restore_ms": restore_ms, "greedy": fresh_tokens}


def exactness(gpu_layers: int, tmp: Path, n_prefix: int = 2000) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": SMALL, "runs": []}
    settings = [{"flash_attn": True, "type_k": "f16", "type_v": "f16"},
                {"flash_attn": True, "type_k": "q8_0", "type_v": "q8_0"},
                {"flash_attn": False, "type_k": "f16", "type_v": "f16"}]
    for wtype in ("f16", "q4_0"):
        t0 = time.perf_counter()
        path = shaped_model(SMALL, wtype)
        build_s = time.perf_counter() - t0
        cpu_sha: Optional[str] = None
        for layers in (gpu_layers, 0):
            for s in settings if layers else settings[:1]:
                cfg = EngineConfig(n_ctx=4096, n_gpu_layers=layers, **s)
                row: dict[str, Any] = {"weights": wtype, "n_gpu_layers": layers, **s, "build_s": round(build_s, 1)}
                out["runs"].append(row)
                try:
                    with Engine(path, cfg) as eng:
                        fp = eng.fingerprint
                        row.update(backend=fp.backend, weight_buffers=fp.weight_buffers,
                                   fingerprint=fp.digest()[:16], probe=eng.exactness.model_dump())
                        row.update(graft_check(eng, n_prefix))
                    if layers == 0:
                        cpu_sha = row["fresh_sha"]
                    elif s is settings[0]:  # the SDK end to end once per weight type (child processes: slow)
                        row.update(memory_verify(path, cfg, tmp / f"home-{wtype}-{len(out['runs'])}"))
                except Exception as exc:  # a failed setting is a result, not the end of the run
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc()[-2000:]
                _log(row)
        gpu_rows = [r for r in out["runs"] if r["weights"] == wtype and r["n_gpu_layers"] and "fresh_sha" in r]
        if cpu_sha and gpu_rows:
            out.setdefault("cpu_vs_gpu", {})[wtype] = {
                "logits_equal": gpu_rows[0]["fresh_sha"] == cpu_sha,
                "fingerprints_differ": gpu_rows[0]["fingerprint"] != next(
                    r["fingerprint"] for r in out["runs"] if r["weights"] == wtype and r["n_gpu_layers"] == 0)}
    return out


def memory_verify(path: Path, cfg: EngineConfig, home: Path) -> dict[str, Any]:
    """The SDK end to end on this backend: learn a manual, verify it (fresh prefill in a child process),
    then try the block from a CPU engine's memory (another fingerprint: must be refused)."""
    text = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(900))
    with Memory(path, home=home, config=cfg) as mem:
        block = mem.learn(text, name="manual")
        rep = mem.verify(block.id, samples=6, cross_process=True)
        answer = mem.ask(block.id, "What does the agent do first?", max_tokens=8)
    res: dict[str, Any] = {"memory_verify": {"ok": rep.ok, "samples": rep.samples, "sha_equal": rep.sha_equal,
                                             "argmax_agree": rep.argmax_agree, "max_kl": rep.max_kl,
                                             "cross_process": rep.cross_process, "n_tokens": rep.n_tokens},
                           "ask_receipt": str(getattr(answer, "receipt", ""))[:300]}
    with Memory(path, home=home, config=cfg.model_copy(update={"n_gpu_layers": 0})) as cpu:
        try:
            cpu.ask(block.id, "What does the agent do first?", max_tokens=4)
            res["cpu_refused"] = False
        except Exception as exc:
            res["cpu_refused"] = True
            res["cpu_refusal"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return res


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rates(gpu_layers: int, reps: int, lengths: list[int], n_layer: int = BIG["n_layer"]) -> dict[str, Any]:
    t0 = time.perf_counter()
    shape = {**BIG, "n_layer": n_layer}
    path = shaped_model(shape, "q4_0", repeat_layers=True)
    out: dict[str, Any] = {"shape": shape, "weights": "q4_0", "model_bytes": path.stat().st_size,
                           "build_s": round(time.perf_counter() - t0, 1), "rows": []}
    for kv in ("f16", "q8_0"):
        cfg = EngineConfig(n_ctx=max(lengths) + 256, n_gpu_layers=gpu_layers, type_k=kv, type_v=kv, probe=False)
        t1 = time.perf_counter()
        with Engine(path, cfg) as eng:
            load_s = time.perf_counter() - t1
            toks = _tokens(eng, max(lengths) + 1)
            with eng.session():  # warm-up: first kernels, cuBLAS handles
                eng.prefill(toks[:600])
                eng.logits()
            for n in lengths:
                row: dict[str, Any] = {"kv": kv, "tokens": n, "load_s": round(load_s, 2),
                                       "backend": eng.fingerprint.backend,
                                       "weight_buffers": eng.fingerprint.weight_buffers}
                prefill_s, capture_s, restore_ms, graft_s = [], [], [], []
                keep_s, dev_ms, dev_graft_s = [], [], []
                state = b""
                fresh = graft = dev_graft = ""
                for _ in range(reps):
                    with eng.session():
                        prefill_s.append(_timed(lambda: (eng.prefill(toks[:n]), eng.logits())))
                        t2 = time.perf_counter()
                        state = bytes(eng.capture())
                        capture_s.append(time.perf_counter() - t2)
                        eng.prefill(toks[n:n + 1])
                        fresh = logits_sha256(eng.logits())
                    buf = memoryview(bytearray(state))
                    with eng.session():
                        t3 = time.perf_counter()
                        restore_ms.append(eng.restore(buf, n))
                        eng.prefill(toks[n:n + 1])
                        graft = logits_sha256(eng.logits())
                        graft_s.append(time.perf_counter() - t3)
                    # the hot block kept on the device (#44): a copy in the context's own buffers, made
                    # from the grafted cells, then put back (device to device) and the same one token;
                    # refused by name for a quantized cache (llama.cpp copies part of it)
                    with eng.session():
                        eng.restore(buf, n)
                        t4 = time.perf_counter()
                        try:
                            copy = eng.copy_on_device()
                        except UnsupportedFeature as exc:
                            row["on_device_refused"] = str(exc)
                            continue
                        keep_s.append(time.perf_counter() - t4)
                        eng.reset()
                        t4 = time.perf_counter()
                        dev_ms.append(eng.restore_on_device(copy))
                        eng.prefill(toks[n:n + 1])
                        dev_graft = logits_sha256(eng.logits())
                        dev_graft_s.append(time.perf_counter() - t4)
                row.update(state_bytes=len(state), prefill=summary(prefill_s, unit="s"),
                           capture=summary(capture_s, unit="s"), restore=summary(restore_ms, unit="ms"),
                           graft_first_token=summary(graft_s, unit="s"), graft_equal=fresh == graft)
                if keep_s:
                    row.update(copy_on_device=summary(keep_s, unit="s"), restore_on_device=summary(dev_ms, unit="ms"),
                               graft_on_device_first_token=summary(dev_graft_s, unit="s"),
                               graft_on_device_equal=fresh == dev_graft)
                row["prefill_tok_s"] = n / row["prefill"]["median_s"]
                row["set_data_gb_s"] = len(state) / 1e9 / (row["restore"]["median_ms"] / 1e3)
                row["get_data_gb_s"] = len(state) / 1e9 / row["capture"]["median_s"]
                out["rows"].append(row)
                _log(row)
                del state, buf
    return out


def io_rates(reps: int, tmp: Path) -> dict[str, Any]:
    from bench.restore_rates import io_and_hash_rates

    return io_and_hash_rates([0.25, 1.0, 4.0], reps, tmp)


def table(data: dict[str, Any]) -> str:
    """The 8B graft-vs-prefill table of docs/benchmarks.md, from a results file of this script.

    A graft's first token = where the state comes from + its check + ``set_data`` + a one-token
    prefill (measured together as ``graft_first_token``): from RAM (the server's in-process prompt cache),
    from a copy kept on the device (measured: ``graft_on_device_first_token``, where the results have it), from
    the page cache (a later read of a checked file version: xxh3), from a cold disk (a first read: BLAKE3
    over every core); and the pipelined cold read (read, check and copy in chunks: the slowest phase)."""
    io = data["io"][max(data["io"], key=float)]
    rate = {k: io[k]["gb_s"] for k in ("read_warm", "read_cold", "blake3_auto", "xxh3")}
    rows = data["rates"]["rows"]
    dev = any("graft_on_device_first_token" in r for r in rows)  # results from before #44's seventh stop lack it
    lines = ["| KV | tokens | state | prefill (cold) | graft from RAM " + ("| from the device " if dev else "")
             + "| from page cache | from a cold disk | cold, pipelined | learn: capture |",
             "|---|---|---|---|---|" + ("---|" if dev else "") + "---|---|---|---|"]
    for r in rows:
        gb = r["state_bytes"] / 1e9
        ram = r["graft_first_token"]["median_s"]
        pre = r["prefill"]["median_s"]
        warm = gb / rate["read_warm"] + gb / rate["xxh3"] + ram
        cold = gb / rate["read_cold"] + gb / rate["blake3_auto"] + ram
        piped = max(gb / rate["read_cold"], gb / rate["blake3_auto"], r["restore"]["median_ms"] / 1e3)
        on_dev = ""
        if dev and "graft_on_device_first_token" not in r:
            on_dev = "| refused "
        elif dev:
            d = r["graft_on_device_first_token"]["median_s"]
            on_dev = f"| {d:.3f} s ({pre / d:.1f}x{'' if r['graft_on_device_equal'] else ', NOT exact'}) "
        lines.append(f"| {r['kv']} | {r['tokens']:,} | {gb:.2f} GB | {pre:.2f} s | {ram:.3f} s ({pre / ram:.1f}x) {on_dev}"
                     f"| {warm:.2f} s ({pre / warm:.1f}x) | {cold:.2f} s ({pre / cold:.1f}x) "
                     f"| {piped:.2f} s ({pre / piped:.1f}x) | {r['capture']['median_s']:.2f} s |")
    return "\n".join(lines)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed request with the standard library (the device host has no httpx)."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve_check(gpu_layers: int, tmp: Path, n_words: int = 1200) -> dict[str, Any]:
    """``graftmem serve``'s prompt cache on the GPU: the SmolLM2-shaped f16 model, a 4-turn agent
    conversation over Chat Completions (a ~1,500-token system prompt), served (1) on an empty store, where
    turns 2-4 graft what the turns before learned, (2) after a restart (a new Memory and server on the same
    home: the warm start grafts the learned chain, then every turn grafts), and (3) with the cache off
    (``{"graftmem": {"cache": false}}``: a fresh prefill of every segment). Per turn the three answers and
    first-logits SHA-256 (the receipts') must be equal, and the restart's turns must have restored their
    prefix (``tokens_restored``). `main` runs it with every layer offloaded and with half of them (a partial
    offload: the layers left on the CPU compute there, each block's bytes are those of that split)."""
    path = shaped_model(SMALL, "f16")
    system = " ".join(WORDS[(i * 5) % len(WORDS)] + ("." if i % 11 == 10 else "") for i in range(n_words))
    users = ["How do I get a refund?", "And the shipping label?", "What about a damaged parcel?",
             "Thanks. Anything else I must check?"]
    cfg = {"n_gpu_layers": gpu_layers, "n_ctx": 4096}
    home = tmp / f"serve-home-{gpu_layers}"
    answers: list[str] = []

    def session(cache: bool) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with Memory(path, home=home, config=cfg) as mem, mem.serve(api=True) as srv:
            msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
            for i, u in enumerate(users):
                msgs.append({"role": "user", "content": u})
                t0 = time.perf_counter()
                out = _post(srv.url + "/v1/chat/completions",
                            {"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0,
                             "graftmem": {"cache": cache}})
                ms = (time.perf_counter() - t0) * 1e3
                text = out["choices"][0]["message"]["content"] or ""
                rc = out.get("graftmem") or {}
                rows.append({"turn": i + 1, "text": text, "ms": round(ms, 1), "sha": rc.get("first_logits_sha256"),
                             "restored": rc.get("tokens_restored"), "prefilled": rc.get("tokens_prefilled"),
                             "source": rc.get("source"), "exact": rc.get("exact")})
                if len(answers) <= i:
                    answers.append(text)
                msgs.append({"role": "assistant", "content": answers[i]})  # every session sends the same turns
            srv.pipeline.wait_idle(120)  # type: ignore[attr-defined]  # learned prefixes stored before the restart
        return rows

    first = session(True)
    restart = session(True)
    fresh = session(False)
    same = [a["sha"] == b["sha"] == c["sha"] and a["text"] == b["text"] == c["text"]
            for a, b, c in zip(first, restart, fresh)]
    return {"model": path.name, "config": cfg, "first": first, "restart": restart, "fresh": fresh,
            "per_turn_equal": same, "all_equal": all(same),
            "restart_restored": [r["restored"] for r in restart],
            "restart_grafted_every_turn": all((r["restored"] or 0) > 0 for r in restart)}


def host() -> dict[str, Any]:
    info: dict[str, Any] = {"system": system_report(), "python": platform.python_version(), "cpus": os.cpu_count()}
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                ["lscpu"]):
        try:
            info[cmd[0]] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info[cmd[0]] = f"unavailable: {exc}"
    return info


def _log(row: dict[str, Any]) -> None:
    keep = {k: v for k, v in row.items() if k not in ("traceback", "greedy", "probe")}
    sys.stderr.write(json.dumps(keep, default=str)[:600] + "\n")
    sys.stderr.flush()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-layers", type=int, default=999)
    ap.add_argument("--only", default="small,big,io", help="comma-separated phases: small, big, io, serve")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", default="3072,32768", help="prompt lengths of the big model's rates")
    ap.add_argument("--prefix-tokens", type=int, default=2000, help="the exactness check's prefix")
    ap.add_argument("--big-layers", type=int, default=BIG["n_layer"], help="fewer for a smoke run on a CPU")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    ap.add_argument("--table", type=Path, default=None, help="print the 8B table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        sys.stdout.write(table(json.loads(args.table.read_text())) + "\n")
        return 0
    phases = set(args.only.split(","))
    data: dict[str, Any] = {"host": host()}
    _log({"host": data["host"]["system"], "gpu": data["host"].get("nvidia-smi")})
    with tempfile.TemporaryDirectory(prefix="graftmem-gpu-") as tmp:
        for name, fn in (("exactness", lambda: exactness(args.gpu_layers, Path(tmp), args.prefix_tokens)),
                         ("rates", lambda: rates(args.gpu_layers, args.reps, [int(x) for x in args.lengths.split(",")],
                                             args.big_layers)),
                         ("io", lambda: io_rates(args.reps, Path(tmp))),
                         ("serve", lambda: {str(n): serve_check(n, Path(tmp)) for n in (args.gpu_layers, SMALL["n_layer"] // 2)})):
            if {"exactness": "small", "rates": "big", "io": "io", "serve": "serve"}[name] not in phases:
                continue
            t0 = time.perf_counter()
            try:
                data[name] = fn()
            except Exception as exc:
                data[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                sys.stderr.write(data[name]["traceback"])
            data[name + "_s"] = round(time.perf_counter() - t0, 1)
            write_results(args.out, data, args=args, default=str)  # after each phase: a timeout keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
