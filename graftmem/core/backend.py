"""The only module that imports ``llama_cpp``: the shared library, its log, the loaded weights.

Why one module: llama-cpp-python's bindings are a moving target (names and ctypes signatures change
between releases), so every use of them is reached through this module, and a pin bump is checked
here. The other core modules that call llama.cpp (`graftmem.core.engine`, `graftmem.core.grammar`,
`graftmem.core.kernels`) take the ctypes bindings as `C` from here; tests/test_architecture.py
fails on a second importer.

What lives here: backend start-up and log routing, the CPU / device report the fingerprint records,
the weights shared by every engine of a process (`_LoadedModel`), the content identity of the
compiled libraries (`library_identity`, a key of the cached verdicts) and the SHA-256 of a GGUF.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

import blake3

from . import openmp  # noqa: F401 - before llama_cpp: libgomp reads its wait policy when it loads
import llama_cpp
from llama_cpp import llama_cpp as C

from .errors import EngineError
from .models import model_cache_dir

__all__ = ["C", "KV_TYPES", "file_sha256", "init_backend", "library_identity", "llama_build", "llama_cpp_version",
           "schema_converter_module", "system_report"]

_llama_log = logging.getLogger("graftmem.llama")

#: the KV cache types a config may name, as ggml type ids
KV_TYPES = {
    "f32": C.GGML_TYPE_F32, "f16": C.GGML_TYPE_F16, "bf16": getattr(C, "GGML_TYPE_BF16", 30),
    "q8_0": C.GGML_TYPE_Q8_0, "q4_0": C.GGML_TYPE_Q4_0, "q4_1": C.GGML_TYPE_Q4_1,
    "q5_0": C.GGML_TYPE_Q5_0, "q5_1": C.GGML_TYPE_Q5_1,
}


_backend_lock = threading.Lock()
_backend_ready = False


#: While a model loads, llama.cpp's log is also collected here (under `_load_lock`): the load log is
#: the only place llama.cpp names the buffer types it put the weights in.
_load_log: Optional[list[str]] = None
_load_lock = threading.Lock()


@C.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every tensor on load; route it to logging at DEBUG instead of stderr.
    if _load_log is not None:
        _load_log.append(text.decode("utf-8", "replace"))
    if _llama_log.isEnabledFor(logging.DEBUG):
        _llama_log.debug(text.decode("utf-8", "replace").rstrip())


_MODEL_BUFFER = re.compile(r"(\S+)\s+model buffer size\s*=")


def _weight_buffers(load_log: Sequence[str]) -> str:
    """The weight buffer types named in a load log ("load_tensors: CPU_REPACK model buffer size =
    ..."), "+"-joined and sorted; host memory, mapped or not, is "CPU"."""
    names = {("CPU" if m.group(1) in ("CPU_Mapped", "CPU") else m.group(1))
             for m in _MODEL_BUFFER.finditer("".join(load_log))}
    return "+".join(sorted(names)) or "CPU"


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            C.llama_log_set(_log_callback, ctypes.c_void_p(0))
            C.llama_backend_init()
            _backend_ready = True



def llama_cpp_version() -> str:
    """The llama-cpp-python package version (a fingerprint field)."""
    return str(llama_cpp.__version__)


def llama_build() -> str:
    """llama.cpp's own build string, "unknown" where the bindings do not export it (a fingerprint field)."""
    return C.llama_version().decode() if hasattr(C, "llama_version") else "unknown"


def schema_converter_module() -> ModuleType:
    """llama-cpp-python's JSON-schema-to-GBNF converter module (``llama_cpp.llama_grammar``), imported on
    first use: `graftmem.core.grammar` builds on it."""
    from llama_cpp import llama_grammar

    return llama_grammar


def file_sha256(path: Path) -> str:
    """SHA-256 of a GGUF, memoized beside graftmem's model cache by (path, size, mtime)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = model_cache_dir() / "sha256" / key
    try:
        cached = memo.read_text().strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(memo.name + f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache only costs a re-hash next time
        pass
    return digest


def _cpu_features() -> str:
    info = C.llama_print_system_info().decode("utf-8", "replace")
    # keep the feature flags, drop volatile parts; the string is stable for one build on one CPU
    return " ".join(info.split())


def _backend_devices() -> list[str]:
    """The ggml devices this build registered ("CPU: AMD EPYC ...", "CUDA0: NVIDIA H200"), read
    through ggml's device registry; empty where the shared library does not export it."""
    try:
        from llama_cpp._ggml import libggml as G

        G.ggml_backend_dev_count.restype = ctypes.c_size_t
        G.ggml_backend_dev_get.restype = ctypes.c_void_p
        G.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        G.ggml_backend_dev_name.restype = ctypes.c_char_p
        G.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
        G.ggml_backend_dev_description.restype = ctypes.c_char_p
        G.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
        out = []
        for i in range(G.ggml_backend_dev_count()):
            dev = G.ggml_backend_dev_get(i)
            out.append(f"{G.ggml_backend_dev_name(dev).decode()}: {G.ggml_backend_dev_description(dev).decode()}")
        return out
    except (ImportError, AttributeError, OSError):
        return []


def system_report() -> dict[str, Any]:
    """What llama.cpp sees on this machine, before any model is loaded (so it can be printed before
    anything can crash): its CPU feature line, the devices of this build, whether it can offload."""
    init_backend()
    return {"llama_cpp_version": llama_cpp_version(), "llama_build": llama_build(),
            "system_info": _cpu_features(), "devices": _backend_devices(),
            "gpu_offload": bool(C.llama_supports_gpu_offload())}


def _backend_of(weight_buffers: str) -> str:
    """"cpu", or the lower-cased name of the first non-host buffer ("cuda0", "metal") when layers
    were offloaded."""
    gpu = [b for b in weight_buffers.split("+") if b not in ("CPU", "CPU_REPACK", "AMX") and not b.startswith("CPU")]
    return gpu[0].lower() if gpu else "cpu"



class _LoadedModel:
    """One ``llama_model`` (the weights), shared by every engine of this process that loads the same
    file with the same model parameters, and freed when the last of them closes.

    Why: llama.cpp's contexts only read the model, so a pool of N contexts needs the weights once,
    not N times (``graftmem serve --engines N`` held N copies). The key is what decides the loaded
    bytes: the file's path and SHA-256 (a file replaced on disk is loaded anew), the offloaded layers
    and the weight buffer choice; the context settings (n_ctx, KV types, threads) stay per engine.
    """

    _open: dict[tuple[str, str, int, bool], "_LoadedModel"] = {}
    _lock = threading.Lock()

    def __init__(self, key: tuple[str, str, int, bool], ptr: Any, weight_buffers: str) -> None:
        self.key, self.ptr, self.weight_buffers = key, ptr, weight_buffers
        self.refs = 1

    @classmethod
    def acquire(cls, path: Path, model_sha256: str, n_gpu_layers: int, extra_bufts: bool) -> "_LoadedModel":
        """The loaded model for this key, loading it the first time (under the lock: two engines
        created at once load it once)."""
        key = (str(path.resolve()), model_sha256, n_gpu_layers, extra_bufts)
        with cls._lock:
            loaded = cls._open.get(key)
            if loaded is not None:
                loaded.refs += 1
                return loaded
            mparams = C.llama_model_default_params()
            # CPU unless asked: the CPU backend is the one measured exact; GPU offload is probed (docs/exactness.md)
            mparams.n_gpu_layers = n_gpu_layers
            # plain weight buffers unless chosen: llama.cpp's repack/AMX buffers are other kernels, and the
            # AMX ones crashed the first decode on a Sapphire Rapids VM (docs/exactness.md)
            mparams.use_extra_bufts = extra_bufts
            global _load_log
            load_log: list[str] = []
            with _load_lock:
                _load_log = load_log
                try:
                    ptr = C.llama_model_load_from_file(str(path).encode(), mparams)
                finally:
                    _load_log = None
            if not ptr:
                raise EngineError(f"llama.cpp could not load {path}")
            loaded = cls._open[key] = cls(key, ptr, _weight_buffers(load_log))
            return loaded

    def release(self) -> None:
        """One engine fewer on this model; the last one frees the weights."""
        with self._lock:
            self.refs -= 1
            if self.refs == 0:
                del self._open[self.key]
                C.llama_model_free(self.ptr)



_LIBS: Optional[list[tuple[str, int, str]]] = None


def library_identity() -> list[tuple[str, int, str]]:
    """(name, size, BLAKE3 of the content) of each llama.cpp / ggml shared library this process loaded from.

    Why: the verdicts this module caches on disk (a probe child's crash, the load-time exactness probe)
    belong to the compiled libraries, and llama.cpp's version string does not change when they are
    rebuilt with other flags. Measured on an H200 host: a CUDA build that crashed while loading was fixed
    by a relink (bench/gpu_check.sh), and the crash cached under the old key kept being reported until
    the cache was deleted by hand. The content, not the file times: a reinstall of the same wheel (a fresh
    virtual environment, CI's fresh clone) keeps its verdicts (with file times, a fresh clone's suite
    re-ran every probe: +83 s). Hashed once per process (tens of MB, milliseconds with BLAKE3's threads)."""
    global _LIBS
    if _LIBS is None:
        base = Path(getattr(C, "_base_path", Path(llama_cpp.__file__).parent / "lib"))
        out: list[tuple[str, int, str]] = []
        try:
            for f in sorted(base.iterdir()):
                if f.name.startswith(("libllama", "libggml", "llama", "ggml")) and f.is_file():
                    data = f.read_bytes()
                    out.append((f.name, len(data), blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()[:32]))
        except OSError:
            pass
        _LIBS = out
    return _LIBS
