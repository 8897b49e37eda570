#!/usr/bin/env python3
"""Tiny random-weight GGUFs of real model families: a real tokenizer and a real chat template on a
2-layer ``llama`` body, built locally from what the llama-cpp-python sdist vendors.

Why: no 1-8B model can be downloaded here (nothing comes from a model hub), and none is needed to
prove the plumbing of "any model": what differs between families is the tokenizer (its special
tokens, its BOS rule, its pre-tokenizer) and the chat template, not the weights. llama.cpp vendors
vocab-only GGUFs with the real tokenizers (``models/ggml-vocab-*.gguf``) and a library of real chat
templates (``models/templates/*.jinja``); both ship inside the llama-cpp-python 0.3.36 sdist, which pip
fetches from PyPI like any package. This script:

1. gets that sdist with ``pip download`` (pip's cache makes a rerun instant) and extracts only the
   vocab GGUFs, the templates and ``gguf-py`` into a cache directory OUTSIDE the repository
   (``$GRAFTMEM_MODEL_CACHE`` or ``platformdirs.user_cache_dir("graftmem")/models``, the directory
   graftmem's packaged models already use);
2. copies every ``tokenizer.*`` key of a family's vocab GGUF into a new ``llama``-architecture GGUF with
   2 layers, n_embd 64 and seeded random weights (f16 token embedding, tied output), and sets
   ``tokenizer.chat_template`` to the family's real template;
3. writes it atomically under a name keyed by every input (this script's recipe version, the vocab
   file's SHA-256, the template's SHA-256), so a rerun returns the cached file without work.

The weights are noise: the models babble. They load, tokenize, prefill, graft and decode exactly
like the real family's models do, which is all the tests ask of them.

Architectures (`ARCHS`, `build_arch()`): the same recipe for the model *bodies* people run, not
only llama: a gated-delta-net hybrid (Qwen 3.5), Mamba-2 (pure and in the Granite 4 / Nemotron-H
hybrids), LFM2's short convolutions, GPT-OSS (mixture of experts + alternating sliding windows),
DeepSeek 2's latent attention (MLA) and Qwen3-MoE. Each recipe is the hyper-parameters its
``load_arch_hparams`` reads in the pinned llama.cpp (``src/models/<arch>.cpp``; the key set follows
``tests/test-llama-archs.cpp``, llama.cpp's own random-weight test), shrunk to n_embd 64 and 2-4
layers. The tensor list and shapes are asked of llama.cpp itself rather than copied by hand:
``llama_model_init_from_user`` builds the model from the key-value section alone and calls back once
per tensor its loader creates (every optional one too); the optional quantization scales, biases and
rope factors are left out, a tensor the loader then reports missing is added back, and the file is
written with gguf-py's writer and loaded from disk before it is kept. That runs in a child process
(it swaps llama.cpp's log callback to read the loader's errors, and a bad recipe may crash).

Usage: ``python scripts/tiny_models.py [FAMILY ...]`` prints one ``family path`` line each
(``--list`` prints the families, ``--arch NAME ...`` builds architectures). Tests import `build()`
and `build_arch()`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
_VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
RECIPE = 1  #: bump when the body below changes: it is part of every cache key

__all__ = ["Arch", "ARCHS", "Family", "FAMILIES", "build", "build_arch", "copy_tokenizer", "sdist_dir",
           "templates_dir", "vocab_path"]


@dataclass(frozen=True)
class Family:
    """One tiny model: a vendored vocab and a vendored template."""

    name: str
    vocab: str        #: ``models/ggml-vocab-<vocab>.gguf``
    template: str     #: ``models/templates/<template>.jinja``
    note: str = ""


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama31", "llama-bpe", "meta-llama-Llama-3.1-8B-Instruct", "Llama 3.1 (tiktoken BPE, <|eot_id|>)"),
    Family("phi35", "phi-3", "microsoft-Phi-3.5-mini-instruct", "Phi-3.5 (SentencePiece, <|end|>)"),
    Family("gemma4", "gemma-4", "google-gemma-4-31B-it", "Gemma 4 (<|turn>, 262k vocab)"),
    Family("qwen25", "qwen2", "Qwen-Qwen2.5-7B-Instruct", "Qwen 2.5 (ChatML, Hermes tools)"),
    Family("qwen3", "qwen2", "Qwen-Qwen3-0.6B", "Qwen 3 (ChatML + <think>; this vocab lacks <think> as a special)"),
    Family("qwen35", "qwen35", "Qwen3.5-4B", "Qwen 3.5 (XML tool calls)"),
    Family("command-r", "command-r", "CohereForAI-c4ai-command-r-plus-tool_use", "Command R+ (tool use)"),
)}


def cache_root() -> Path:
    """graftmem's model cache (the same directory `graftmem.core.models` assembles Gemma 3 in)."""
    root = os.environ.get("GRAFTMEM_MODEL_CACHE")
    if root:
        return Path(root)
    import platformdirs

    return Path(platformdirs.user_cache_dir("graftmem")) / "models"


def sdist_dir() -> Path:
    """The extracted parts of the llama-cpp-python sdist (vocabs, templates, gguf-py), extracted once."""
    out = cache_root() / "llama-cpp-python-0.3.36"
    done = out / ".complete"
    if done.exists():
        return out
    dl = cache_root() / "sdist"
    tarball = dl / SDIST_FILE
    if not tarball.exists():
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--quiet", SDIST, "-d", str(dl)], check=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(_VENDOR) and (
            (m.name.startswith(_VENDOR + "models/ggml-vocab-") and m.name.endswith(".gguf"))
            or m.name.startswith(_VENDOR + "models/templates/")
            or m.name.startswith(_VENDOR + "gguf-py/gguf/"))]
        for m in members:
            m.name = m.name[len(_VENDOR):]
        tar.extractall(tmp, members=members, filter="data")
    (tmp / ".complete").write_text(SDIST + "\n")
    try:
        os.replace(tmp, out)
    except OSError:  # another process extracted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def templates_dir() -> Path:
    return sdist_dir() / "models" / "templates"


def vocab_path(vocab: str) -> Path:
    return sdist_dir() / "models" / f"ggml-vocab-{vocab}.gguf"


def _gguf():
    """The ``gguf`` package: installed (the ``dev`` extra) or, failing that, the sdist's own copy."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(sdist_dir() / "gguf-py"))
        import gguf  # noqa: F401
    return gguf


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_kv(path: Path) -> dict[str, tuple[int, int, object]]:
    """The key-value section of a GGUF as ``{key: (type, array item type, value)}``.

    Why not ``gguf.GGUFReader``: it builds a numpy view per array item, 70 s for the half a million
    merges of a vocab on these CPUs; this reads the same values in about a second (arrays of numbers
    as numpy arrays, strings as ``str``)."""
    import struct

    import numpy as np

    data = path.read_bytes()
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        s = data[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        return s

    def scalar(t: int) -> object:
        nonlocal pos
        if t == 8:
            return string()
        fmt = _SCALARS[t]
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    out: dict[str, tuple[int, int, object]] = {}
    for _ in range(n_kv):
        key = string()
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if t != 9:
            out[key] = (t, -1, scalar(t))
            continue
        sub, n = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if sub == 8:
            out[key] = (t, sub, [string() for _ in range(n)])
        else:
            arr = np.frombuffer(data, dtype=_NUMPY[sub], count=n, offset=pos)
            pos += arr.nbytes
            out[key] = (t, sub, arr)
    return out


def copy_tokenizer(w, kv: dict[str, tuple[int, int, object]], template: Path) -> None:
    """Every ``tokenizer.*`` key of a vocab GGUF's `read_kv` into the writer ``w``, and ``template`` as
    its chat template (the vocab's own template keys are left out). Also used by bench/gpu.py."""
    gguf = _gguf()
    for name, (vtype, sub, value) in kv.items():
        if not name.startswith("tokenizer.") or name.startswith("tokenizer.chat_template"):
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            items = value.tolist() if hasattr(value, "tolist") else value
            w.add_key_value(name, items, gguf.GGUFValueType(vtype), sub_type=gguf.GGUFValueType(sub))
        else:
            w.add_key_value(name, value, gguf.GGUFValueType(vtype))
    w.add_chat_template(template.read_text(encoding="utf-8"))


def _cached(name: str, *inputs: object) -> Path:
    """Where the tiny GGUF ``name`` built from ``inputs`` is kept: a name keyed by every input, so a
    changed vocab, template or recipe gives a new file and a rerun finds the old one instantly."""
    key = hashlib.sha256("|".join(map(str, inputs)).encode()).hexdigest()[:16]
    return cache_root() / "tiny" / f"{name}-{key}.gguf"


def _finish(w, tmp: Path, out: Path) -> Path:
    """Write the GGUF writer ``w``'s file at ``tmp``, fsync it and move it to ``out`` atomically."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(family: str | Family, *, template: Optional[Path] = None, n_embd: int = 64,
          n_layer: int = 2, seed: int = 0) -> Path:
    """The path of the tiny GGUF of ``family`` (a name of `FAMILIES` or a `Family`), built if absent.

    ``template`` overrides the family's template file. Every input is in the file name's key, so a
    changed vocab, template or recipe gives a new file and a rerun finds the old one instantly.
    """
    fam = FAMILIES[family] if isinstance(family, str) else family
    vocab = vocab_path(fam.vocab)
    tpl = template or templates_dir() / f"{fam.template}.jinja"
    out = _cached(fam.name, RECIPE, _sha(vocab), _sha(tpl), n_embd, n_layer, seed)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf = _gguf()
    import numpy as np

    kv = read_kv(vocab)
    n_vocab = len(kv["tokenizer.ggml.tokens"][2])  # type: ignore[arg-type]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"graftmem tiny {fam.name}")
    n_head, n_ff = 4, 4 * n_embd
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, kv, tpl)
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.02, dtype=np.float32) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    # gguf-py takes numpy shapes (rows, cols) = (ne1, ne0)
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd, scale=0.5, dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", rand(n_embd, n_embd, scale=0.2))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(n_ff, n_embd, scale=0.2))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd, scale=0.2))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff, scale=0.2))
    return _finish(w, tmp, out)


# ---------------------------------------------------------------------------------------------- architectures
ARCH_RECIPE = 1  #: bump when the architecture builder changes: part of every architecture's cache key


@dataclass(frozen=True)
class Arch:
    """One tiny model of a real llama.cpp architecture: its hyper-parameters (GGUF keys without the
    ``<arch>.`` prefix), a vendored vocab and template, and what its per-sequence state holds."""

    name: str
    arch: str          #: ``general.architecture`` (llama.cpp's LLM_ARCH name)
    kv: tuple          #: ((key, value), ...): ints are u32, floats f32, lists u32 arrays
    vocab: str
    template: str
    memory: str        #: "attention", "window" (interleaved sliding windows), "recurrent" or "hybrid"
    note: str = ""


#: Every architecture speaks Llama 3.1's tokenizer and chat template: the body is what differs between
#: them (the state, the graft), and the server's chat segmentation needs a template whose turns meet at
#: special tokens, which these tiny vocab + template pairs give (the template families are covered by
#: `FAMILIES`).
_VOCAB, _TEMPLATE = "llama-bpe", "meta-llama-Llama-3.1-8B-Instruct"

_BASE = (("context_length", 8192), ("embedding_length", 64), ("attention.layer_norm_rms_epsilon", 1e-6),
         ("rope.freq_base", 10000.0))

ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("qwen3moe", "qwen3moe", _BASE + (
        ("block_count", 2), ("feed_forward_length", 128), ("attention.head_count", 4),
        ("attention.head_count_kv", 2), ("attention.key_length", 16), ("attention.value_length", 16),
        ("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", 32)),
        _VOCAB, _TEMPLATE, "attention", "Qwen3-MoE: mixture of experts, Q/K norms, GQA"),
    Arch("qwen35", "qwen35", _BASE + (
        ("block_count", 4), ("feed_forward_length", 128), ("attention.head_count", 4),
        ("attention.head_count_kv", 2), ("attention.key_length", 16), ("attention.value_length", 16),
        ("rope.dimension_count", 16), ("rope.dimension_sections", [3, 3, 2, 0]), ("ssm.conv_kernel", 4),
        ("ssm.inner_size", 64), ("ssm.state_size", 16), ("ssm.time_step_rank", 4), ("ssm.group_count", 2),
        ("full_attention_interval", 4)),
        _VOCAB, _TEMPLATE, "hybrid", "Qwen 3.5: 3 gated-delta-net layers per attention layer"),
    Arch("granitehybrid", "granitehybrid", _BASE + (
        ("block_count", 4), ("feed_forward_length", 128), ("attention.head_count", 4),
        ("attention.head_count_kv", [0, 2, 0, 2]), ("ssm.conv_kernel", 4), ("ssm.inner_size", 128),
        ("ssm.state_size", 16), ("ssm.time_step_rank", 8), ("ssm.group_count", 1)),
        _VOCAB, _TEMPLATE, "hybrid", "Granite 4 (H): Mamba-2 layers + attention layers"),
    Arch("nemotron_h", "nemotron_h", _BASE + (
        ("block_count", 4), ("attention.layer_norm_epsilon", 1e-5), ("feed_forward_length", [0, 0, 128, 0]),
        ("attention.head_count", 4), ("attention.head_count_kv", [0, 2, 0, 0]), ("ssm.conv_kernel", 4),
        ("ssm.inner_size", 128), ("ssm.state_size", 16), ("ssm.time_step_rank", 8), ("ssm.group_count", 1)),
        _VOCAB, _TEMPLATE, "hybrid", "Nemotron-H: Mamba-2, attention and MLP layers"),
    Arch("mamba2", "mamba2", _BASE + (
        ("block_count", 2), ("ssm.conv_kernel", 4), ("ssm.inner_size", 128), ("ssm.state_size", 16),
        ("ssm.time_step_rank", 8), ("ssm.group_count", 1)),
        _VOCAB, _TEMPLATE, "recurrent", "Mamba-2: recurrent layers only, no attention"),
    Arch("lfm2", "lfm2", _BASE + (
        ("block_count", 4), ("feed_forward_length", 128), ("attention.head_count", 4),
        ("attention.head_count_kv", [0, 2, 0, 2]), ("shortconv.l_cache", 3)),
        _VOCAB, _TEMPLATE, "hybrid", "LFM2: short-convolution layers + attention layers"),
    Arch("gpt-oss", "gpt-oss", _BASE + (
        ("block_count", 4), ("feed_forward_length", 32), ("attention.head_count", 4),
        ("attention.head_count_kv", 2), ("attention.key_length", 16), ("attention.value_length", 16),
        ("attention.sliding_window", 128), ("expert_count", 4), ("expert_used_count", 2),
        ("expert_feed_forward_length", 32)),
        _VOCAB, _TEMPLATE, "window",
        "GPT-OSS: mixture of experts, attention sinks, sliding window (128) on every other layer"),
    Arch("deepseek2", "deepseek2", _BASE + (
        ("block_count", 2), ("leading_dense_block_count", 1), ("feed_forward_length", 128),
        ("attention.head_count", 2), ("attention.head_count_kv", 1), ("attention.key_length", 48),
        ("attention.value_length", 32), ("attention.key_length_mla", 32), ("attention.value_length_mla", 16),
        ("rope.dimension_count", 16), ("attention.q_lora_rank", 32), ("attention.kv_lora_rank", 32),
        ("expert_count", 4), ("expert_used_count", 2), ("expert_shared_count", 1),
        ("expert_feed_forward_length", 32), ("expert_gating_func", 2), ("expert_weights_norm", True),
        ("expert_weights_scale", 1.0)),
        _VOCAB, _TEMPLATE, "attention",
        "DeepSeek 2/3: latent attention (MLA: the cache holds a 48-wide latent, no V), shared + routed experts"),
)}


def build_arch(arch: str | Arch, *, seed: int = 0) -> Path:
    """The path of the tiny GGUF of architecture ``arch`` (a name of `ARCHS` or an `Arch`), built if
    absent (in a child process, see the module doc). Keyed by every input, like `build()`."""
    a = ARCHS[arch] if isinstance(arch, str) else arch
    vocab = vocab_path(a.vocab)
    tpl = templates_dir() / f"{a.template}.jinja"
    blob = f"{ARCH_RECIPE}|{a.arch}|{a.kv!r}|{_sha(vocab)}|{_sha(tpl)}|{seed}"
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    out = cache_root() / "tiny" / f"arch-{a.name}-{key}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    env = {**os.environ, "GRAFTMEM_MODEL_CACHE": str(cache_root())}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-arch", a.name, str(tmp)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise RuntimeError(f"llama.cpp could not build a {a.arch} model: {tail}")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def _write_kv(w, a: Arch) -> None:
    gguf = _gguf()
    w.add_name(f"graftmem tiny {a.name}")
    for k, v in a.kv:
        key = f"{a.arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        else:
            raise TypeError(f"{a.name}: {k}={v!r}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(w, read_kv(vocab_path(a.vocab)), templates_dir() / f"{a.template}.jinja")


def _tensor_shapes(kv_only: Path) -> dict[str, tuple[int, ...]]:
    """``{name: ggml ne}`` of every tensor llama.cpp's loader creates for the key-value section of
    ``kv_only`` (``llama_model_init_from_user``: no file tensors, every optional tensor created)."""
    import ctypes

    import llama_cpp
    from llama_cpp import llama_cpp as C

    base = Path(getattr(C, "_base_path", Path(llama_cpp.__file__).parent / "lib"))
    G = ctypes.CDLL(str(base / "libggml-base.so"))

    class InitParams(ctypes.Structure):  # gguf.h: struct gguf_init_params
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    G.gguf_init_from_file.restype = ctypes.c_void_p
    G.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
    G.gguf_free.argtypes = [ctypes.c_void_p]
    G.ggml_get_name.restype = ctypes.c_char_p
    G.ggml_get_name.argtypes = [ctypes.c_void_p]
    G.ggml_n_dims.restype = ctypes.c_int
    G.ggml_n_dims.argtypes = [ctypes.c_void_p]
    meta = G.gguf_init_from_file(str(kv_only).encode(), InitParams(True, None))
    if not meta:
        raise RuntimeError(f"ggml could not read {kv_only}")
    out: dict[str, tuple[int, ...]] = {}

    @C.llama_model_set_tensor_data_t
    def record(t: int, _ud: int) -> None:
        ne = (ctypes.c_int64 * 4).from_address(t + 16)  # ggml.h: struct ggml_tensor {type; buffer; ne[4]; ...}
        out[G.ggml_get_name(t).decode()] = tuple(int(x) for x in ne[:G.ggml_n_dims(t)])

    model = C.llama_model_init_from_user(meta, record, None, C.llama_model_default_params())
    G.gguf_free(meta)
    if not model:
        raise RuntimeError("llama.cpp refused the hyper-parameters (see its log above)")
    C.llama_model_free(model)
    return out


def _init(name: str, shape: tuple[int, ...], rng):  # -> numpy array
    """Seeded weights that keep a random model finite: norms 1, Mamba's A negative (a decaying state),
    D 1, the router's bias 0, the dt bias -1, everything else N(0, 0.1) (llama.cpp's test uses 0.1)."""
    import numpy as np

    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    last = base.split(".")[-1]
    if "norm" in last or last == "ssm_d":
        return np.ones(shape, np.float32)
    if last == "ssm_a":
        return -np.abs(rng.standard_normal(shape, dtype=np.float32)) - 0.5
    if last == "exp_probs_b" or (name.endswith(".bias") and last != "ssm_dt"):
        return np.zeros(shape, np.float32)
    if name.endswith(".bias"):
        return np.full(shape, -1.0, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * 0.1


def _write_arch(a: Arch, out: Path) -> None:
    """The child's work (``--write-arch``): shapes from llama.cpp, then write, load, add what the loader
    says is missing, until it loads (bounded)."""
    import ctypes
    import re

    import numpy as np
    from llama_cpp import llama_cpp as C

    gguf = _gguf()
    kv_only = out.with_name(out.name + ".kv")
    w = gguf.GGUFWriter(str(kv_only), a.arch)
    _write_kv(w, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    C.llama_backend_init()
    shapes = _tensor_shapes(kv_only)
    kv_only.unlink()
    log: list[str] = []

    @C.llama_log_callback
    def collect(_level: int, text: bytes, _ud: int) -> None:
        log.append(text.decode("utf-8", "replace"))

    C.llama_log_set(collect, ctypes.c_void_p(0))

    def optional(n: str) -> bool:  # quantization scales, projection biases, rope factors: not needed
        return n.endswith((".scale", ".input_scale")) or n.startswith("rope_freqs") or \
            (n.endswith(".bias") and ".ssm_" not in n)

    keep = [n for n in shapes if not optional(n)]
    per_layer = re.compile(r"^blk\.\d+\.")
    for _ in range(16):
        rng = np.random.default_rng(0)
        w = gguf.GGUFWriter(str(out), a.arch)
        _write_kv(w, a)
        for n in keep:
            data = _init(n, tuple(reversed(shapes[n])), rng)  # gguf-py takes numpy shapes: ne reversed
            if n in ("token_embd.weight", "output.weight"):
                data = (data * 5).astype(np.float16)  # the vocab-sized matrices: half the file
            w.add_tensor(n, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        log.clear()
        model = C.llama_model_load_from_file(str(out).encode(), C.llama_model_default_params())
        if model:
            C.llama_model_free(model)
            return
        text = "".join(log)
        m = re.search(r"missing tensor '([^']+)'", text) or re.search(r"tensor '([^']+)' not found", text)
        if m is None or m.group(1) not in shapes:
            errors = [ln for ln in text.splitlines() if "error" in ln.lower()]
            raise SystemExit(f"llama.cpp refused the {a.arch} model: {errors[-1] if errors else text[-300:]}")
        tail = per_layer.sub("", m.group(1))  # one layer misses it: every layer that has it needs it
        keep += [n for n in shapes if n not in keep and (n == m.group(1) or (
            per_layer.match(n) and per_layer.match(m.group(1)) and per_layer.sub("", n) == tail))]
    raise SystemExit(f"{a.arch}: still missing tensors after 16 tries")


# ---------------------------------------------------------------------------------------------- scripted models
SCRIPT_RECIPE = 1  #: bump when the scripted builder changes: part of every scripted model's cache key


@dataclass(frozen=True)
class Script:
    """A model that writes one fixed answer in a family's own format, whatever it is asked.

    Why: random weights babble and never stop, so no tiny model can show that an agent framework gets a
    *well-formed* answer in a family's format (GPT-OSS's harmony channels, a reasoning block) through
    the server's real answer path. A script does: ``answer`` is what the model writes after the
    generation prompt (which ends with ``prompt_tail``), then its end-of-generation token."""

    name: str
    vocab: str         #: ``models/ggml-vocab-<vocab>.gguf``
    template: str      #: ``models/templates/<template>.jinja``
    prompt_tail: str   #: the text every generation prompt of ``template`` ends with
    answer: str
    note: str = ""


SCRIPTS: dict[str, Script] = {s.name: s for s in (
    Script("gpt-oss-script", "llama-bpe", "openai-gpt-oss-120b", "<|end|><|start|>assistant",
           "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
           "GPT-OSS's template; writes an analysis channel, then a final one (markers as text)"),
    Script("qwen3-script", "qwen2", "Qwen-Qwen3-0.6B", "<|im_start|>assistant\n",
           "<think>\nUser says hi.\n</think>\n\nHello!", "Qwen 3's template; thinks, then answers"),
)}

_CONTEXT = 6      #: a scripted model's next token depends on its last 6 tokens (5 previous-token heads)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed (a vocab token's characters -> its bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _spell(text: str, pieces: dict[bytes, int]) -> list[int]:
    """``text`` as vocab tokens, longest piece first (any spelling that decodes to the text will do: the
    model writes tokens, the server reads their text)."""
    data, out, i = text.encode("utf-8"), [], 0
    longest = max(len(k) for k in pieces)
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i:i + n] in pieces:
                out.append(pieces[data[i:i + n]])
                i += n
                break
        else:
            raise ValueError(f"no vocab token spells {data[i:i + 1]!r}")
    return out


def _tail_tokens(vocab: Path, text: str) -> list[int]:
    """How llama.cpp tokenizes ``text`` with this vocab (a child process: llama.cpp's own tokenizer)."""
    code = ("import json, sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False);"
            "print(json.dumps(m.tokenize(sys.argv[2].encode(), add_bos=False, special=True)))")
    out = subprocess.run([sys.executable, "-c", code, str(vocab), text], capture_output=True, text=True, check=True)
    return [int(t) for t in json.loads(out.stdout.strip().splitlines()[-1])]


def build_scripted(script: str | Script, *, n_embd: int = 192) -> Path:
    """The path of the scripted model ``script`` (a name of `SCRIPTS`), built if absent.

    The body is one ``llama`` layer whose weights are set, not trained: the token embedding is a one-hot
    code per token the script uses (one shared code for every other token) plus a constant; five
    attention heads with position-only queries and keys (RoPE phases that peak at a lag of 1 to 5)
    copy the codes of the five previous tokens beside the current one; the FFN is zero; the output
    matrix scores each next token by how many of the six codes match the contexts it follows in the
    script. So the next token is a lookup on the last six: the script, then the end token. The table is
    checked here (every step of the script decided with a margin) before the file is written."""
    sc = SCRIPTS[script] if isinstance(script, str) else script
    vocab, tpl = vocab_path(sc.vocab), templates_dir() / f"{sc.template}.jinja"
    out = _cached(sc.name, SCRIPT_RECIPE, _sha(vocab), _sha(tpl), sc.prompt_tail, sc.answer, n_embd)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf = _gguf()
    import numpy as np

    kv = read_kv(vocab)
    tokens: list[str] = kv["tokenizer.ggml.tokens"][2]  # type: ignore[assignment]
    types = kv["tokenizer.ggml.token_type"][2]
    eos = int(kv["tokenizer.ggml.eos_token_id"][2])  # type: ignore[arg-type]
    dec = _byte_decoder()
    pieces: dict[bytes, int] = {}
    for i, t in enumerate(tokens):
        if int(types[i]) == 1 and all(ch in dec for ch in t):  # normal tokens only
            pieces.setdefault(bytes(dec[ch] for ch in t), i)
    tail = _tail_tokens(vocab, sc.prompt_tail)[-_CONTEXT:]
    seq = tail + _spell(sc.answer, pieces)
    k = _CONTEXT
    width = (n_embd - 1) // k        # one block of codes per lag (0 = the current token), the last dim constant
    used = list(dict.fromkeys(seq + [eos]))
    if len(used) >= width:
        raise ValueError(f"script {sc.name!r} uses {len(used)} distinct tokens; n_embd {n_embd} holds {width - 1}")
    code = {t: i for i, t in enumerate(used)}
    other, const = width - 1, n_embd - 1
    # (state -> next): the state at step j is the codes of seq[j], seq[j-1], ..., seq[j-k+1]
    table: dict[tuple[int, ...], int] = {}
    for j in range(len(tail) - 1, len(seq)):
        state = tuple(code[seq[j - lag]] for lag in range(k))
        nxt = seq[j + 1] if j + 1 < len(seq) else eos
        if table.setdefault(state, nxt) != nxt:
            raise ValueError(f"script {sc.name!r}: the same {k} tokens are followed by two different ones; "
                             "rephrase it or raise the context")
    n_vocab = len(tokens)
    emb = np.zeros((n_vocab, n_embd), dtype=np.float32)
    emb[:, other] = 1.0
    for t, c in code.items():
        emb[t, other] = 0.0
        emb[t, c] = 1.0
    emb[:, const] = 1.0
    xn = np.sqrt(n_embd / 2.0)       # the attention norm's scale: every embedding has two ones
    n_head, hd = k, n_embd // k
    base, n_pairs, strength = 10000.0, 8, 256.0
    theta = base ** (-2.0 * np.arange(hd // 2) / hd)
    amp = np.sqrt(strength)          # score(lag) = amp^2/sqrt(hd) * sum_p cos((lag - want) * theta_p), p < n_pairs
    wq, wk, wv, wo = (np.zeros((n_embd, n_embd), dtype=np.float32) for _ in range(4))
    for h in range(k - 1):           # head h copies the code of the token (h + 1) back
        lag = h + 1
        for p in range(n_pairs):
            wq[h * hd + 2 * p, const] = amp / xn
            wk[h * hd + 2 * p, const] = amp * np.cos(lag * theta[p]) / xn
            wk[h * hd + 2 * p + 1, const] = amp * np.sin(lag * theta[p]) / xn
        for c in range(width):
            wv[h * hd + c, c] = 1.0 / xn
            wo[lag * width + c, h * hd + c] = 1.0
    # the output: after the layer a position holds k ones (the codes) and the constant
    xo = np.sqrt(n_embd / (k + 1.0))
    alpha = 64.0                     # logit of a next token whose whole context matches
    out_w = np.zeros((n_vocab, n_embd), dtype=np.float32)
    for state, nxt in table.items():
        for lag, c in enumerate(state):
            out_w[nxt, lag * width + c] = alpha / k / xo
    # check the table as the model will compute it: each step's next token ahead by a margin
    rows = sorted(set(table.values()))
    for state, nxt in table.items():
        x = np.zeros(n_embd, dtype=np.float32)
        for lag, c in enumerate(state):
            x[lag * width + c] = 1.0
        x[const] = 1.0
        scores = out_w[rows] @ (x * xo)
        best = rows[int(np.argmax(scores))]
        second = np.sort(scores)[-2] if len(rows) > 1 else 0.0
        if best != nxt or scores.max() - second < alpha / (2 * k):
            raise ValueError(f"script {sc.name!r}: step {state} is not decided (wants {nxt}, best {best})")
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"graftmem scripted {sc.name}")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, kv, tpl)
    w.add_tensor("token_embd.weight", emb.astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", out_w.astype(np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for name, m in (("attn_q", wq), ("attn_k", wk), ("attn_v", wv), ("attn_output", wo)):
        w.add_tensor(f"blk.0.{name}.weight", m)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", np.zeros((16, n_embd), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, n_embd), dtype=np.float32))
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((n_embd, 16), dtype=np.float32))
    return _finish(w, tmp, out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all of {', '.join(FAMILIES)}")
    ap.add_argument("--list", action="store_true", help="list the families and architectures, and exit")
    ap.add_argument("--arch", action="store_true", help=f"build architectures instead: {', '.join(ARCHS)}")
    ap.add_argument("--write-arch", nargs=2, metavar=("NAME", "OUT"), help=argparse.SUPPRESS)  # the child
    args = ap.parse_args(argv)
    if args.write_arch:
        _write_arch(ARCHS[args.write_arch[0]], Path(args.write_arch[1]))
        return 0
    if args.list:
        for f in FAMILIES.values():
            sys.stdout.write(f"{f.name:10} vocab={f.vocab:10} template={f.template}  {f.note}\n")
        for a in ARCHS.values():
            sys.stdout.write(f"{a.name:13} arch={a.arch:13} memory={a.memory:9} {a.note}\n")
        return 0
    if args.arch:
        for name in args.families or list(ARCHS):
            if name not in ARCHS:
                ap.error(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}")
            sys.stdout.write(f"{name} {build_arch(name)}\n")
        return 0
    for name in args.families or list(FAMILIES):
        if name not in FAMILIES:
            ap.error(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
        sys.stdout.write(f"{name} {build(name)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
