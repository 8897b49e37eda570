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

Usage: ``python scripts/tiny_models.py [FAMILY ...]`` prints one ``family path`` line each
(``--list`` prints the families). Tests import `build()`.
"""

from __future__ import annotations

import argparse
import hashlib
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

__all__ = ["Family", "FAMILIES", "build", "copy_tokenizer", "sdist_dir", "templates_dir", "vocab_path"]


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
    key = hashlib.sha256(f"{RECIPE}|{_sha(vocab)}|{_sha(tpl)}|{n_embd}|{n_layer}|{seed}".encode()).hexdigest()[:16]
    out = cache_root() / "tiny" / f"{fam.name}-{key}.gguf"
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all of {', '.join(FAMILIES)}")
    ap.add_argument("--list", action="store_true", help="list the families and exit")
    args = ap.parse_args(argv)
    if args.list:
        for f in FAMILIES.values():
            sys.stdout.write(f"{f.name:10} vocab={f.vocab:10} template={f.template}  {f.note}\n")
        return 0
    for name in args.families or list(FAMILIES):
        if name not in FAMILIES:
            ap.error(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
        sys.stdout.write(f"{name} {build(name)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
