"""The kernel probe: whether llama.cpp's chosen weight-buffer kernels run, and graft exactly, on this
machine, decided in a child process and cached per build, library files, CPU and setting.

Why a module of its own: it is the one place that runs llama.cpp in another process (a crashing
kernel, measured with the AMX weight buffers on a Sapphire Rapids VM, kills only the child) and the
one owner of `EngineConfig.extra_bufts`' rule (`choose_extra_bufts`). The child runs
``graftmem.core.engine._probe_child_main`` (named as text here, not imported: the engine imports
this module).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, TypeVar

from pydantic import BaseModel, ConfigDict

from .backend import C, init_backend, library_identity, system_report, file_sha256
from .blocks import EXTRA_BUFTS_ENV, EngineConfig
from .errors import EngineError
from .models import model_cache_dir, resolve_model

__all__ = ["KernelVerdict", "choose_extra_bufts", "kernel_verdict", "probe_kernels"]

log = logging.getLogger("graftmem")


#: Set in the child process of a kernel probe: that engine decides nothing and spawns no child.
_CHILD_ENV = "GRAFTMEM_KERNEL_PROBE_CHILD"
#: Fault injection for the tests of the crash path: the probe child dereferences NULL right before its
#: first decode (a real SIGSEGV in a real child process), as the AMX kernels did on some Xeons; "on" or
#: "off" crash only the children probing that weight-buffer choice, any other value every child.
_CRASH_ENV = "GRAFTMEM_TEST_CRASH_PROBE_CHILD"
_STAGE = "graftmem-probe-stage"
_CHILD_TIMEOUT_S = 600.0


class KernelVerdict(BaseModel):
    """What a probe in a child process found for one weight-buffer choice on this build and CPU: whether
    the first decode ran (a native crash there kills only the child) and whether graft == fresh."""

    model_config = ConfigDict(frozen=True)

    extra_bufts: bool
    ran: bool
    exact: bool = False
    weight_buffers: str = ""
    reason: str = ""
    key: str = ""



def _kernel_key(model_sha256: str, config: EngineConfig, extra: bool) -> str:
    """The verdict cache key: what decides which kernels run (build, the library files, CPU, weights,
    buffer choice, offload, attention and KV types); n_ctx and threads do not change whether a kernel
    crashes."""
    info = system_report()
    blob = json.dumps({"model": model_sha256, "version": info["llama_cpp_version"], "build": info["llama_build"],
                       "libraries": library_identity(),
                       "cpu": info["system_info"], "devices": info["devices"], "extra_bufts": extra,
                       "n_gpu_layers": config.n_gpu_layers, "flash_attn": config.flash_attn,
                       "type_k": config.type_k, "type_v": config.type_v, "swa_full": config.swa_full},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_V = TypeVar("_V", bound=BaseModel)


def _read_verdict(path: Path, kind: type[_V]) -> Optional[_V]:
    """A verdict kept in the model cache (`kernel_verdict`, `Engine._probe_once`), or None (absent, or
    unreadable: decided again)."""
    try:
        return kind.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def _keep_verdict(path: Path, verdict: BaseModel) -> None:
    """Write a verdict for the next process, atomically (temp file, rename); a read-only cache only
    costs deciding it again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(verdict.model_dump_json())
        os.replace(tmp, path)
    except OSError:
        pass


def kernel_verdict(model_path: Path, model_sha256: str, config: EngineConfig, extra: bool) -> KernelVerdict:
    """The cached verdict for these kernels on this machine, probing in a child process the first time.

    Why a child: a kernel that crashes (llama.cpp's AMX weight buffers segfaulted in the first
    ``llama_decode`` on a Sapphire Rapids VM) takes the whole process down with a bare "Segmentation
    fault". In a child, the crash becomes a verdict the caller can report with the setting to change.
    The verdict is cached under the model cache by `_kernel_key`, so a machine pays this once per
    build, CPU and kernel choice.
    """
    key = _kernel_key(model_sha256, config, extra)
    path = model_cache_dir() / "kernel-probes" / f"{key}.json"
    cached = _read_verdict(path, KernelVerdict)
    if cached is not None:
        return cached
    child_cfg = config.model_copy(update={"extra_bufts": "on" if extra else "off", "probe": True,
                                          "n_ctx": min(config.n_ctx, 4096), "n_threads": config.n_threads})
    env = {**os.environ, _CHILD_ENV: "1"}
    code = ("import json,sys;from graftmem.core.engine import _probe_child_main;"
            "_probe_child_main(sys.argv[1],sys.argv[2])")
    log.info("probing %s weight buffers for %s in a child process (once per build and CPU)",
             "extra" if extra else "plain", model_path.name)
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(model_path), child_cfg.model_dump_json()],
                              capture_output=True, text=True, env=env, timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return KernelVerdict(extra_bufts=extra, ran=False, key=key, reason=(
            f"the probe child did not finish within {_CHILD_TIMEOUT_S:.0f} s"))  # not cached: may be load
    if proc.returncode == 0:
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            verdict = KernelVerdict(extra_bufts=extra, ran=True, exact=bool(out["exact"]), key=key,
                                    weight_buffers=str(out["weight_buffers"]), reason=str(out["reason"]))
        except (ValueError, KeyError, IndexError):
            return KernelVerdict(extra_bufts=extra, ran=False, key=key,
                                 reason=f"the probe child printed no verdict: {proc.stderr[-500:]}")
    elif proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else proc.returncode
        stages = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.startswith(_STAGE)]
        where = "in its first decode" if stages[-1:] == ["decode"] else "while loading the model (before any decode)"
        verdict = KernelVerdict(extra_bufts=extra, ran=False, key=key, reason=(
            f"llama.cpp died with {sig} {where} with "
            f"{'extra (repacked/AMX)' if extra else 'plain'} weight buffers on this machine"))
    else:  # a Python error in the child (a bad model, a bad config): not a kernel verdict, not cached
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return KernelVerdict(extra_bufts=extra, ran=False, key=key, reason=f"the probe child failed: {tail}")
    _keep_verdict(path, verdict)
    return verdict


def probe_kernels(model: str | os.PathLike[str] | None, config: EngineConfig | Mapping[str, Any] | None = None,
                  *, extra_bufts: bool) -> KernelVerdict:
    """Run (or read the cached verdict of) the child-process kernel probe for a model with llama.cpp's
    extra weight buffers on or off, without loading the model in this process: what `auto` decides on,
    and what a bench or `doctor` can ask before choosing."""
    cfg = EngineConfig.coerce(config)
    _, path = resolve_model(model)
    init_backend()
    return kernel_verdict(path, file_sha256(path), cfg, extra_bufts)


def _child_stage(stage: str) -> None:
    """Tell the parent how far the probe child got (a line on the child's stdout, flushed before the
    step that may crash), so a crash while loading is not reported as a crashing kernel."""
    sys.stdout.write(f"{_STAGE} {stage}\n")
    sys.stdout.flush()



def _setting_hint(value: str) -> str:
    return (f"EngineConfig(extra_bufts={value!r}), graftmem --config '{{\"extra_bufts\": \"{value}\"}}' "
            f"or {EXTRA_BUFTS_ENV}={value}")


def choose_extra_bufts(model_path: Path, model_sha256: str, config: EngineConfig) -> bool:
    """Whether an engine uses llama.cpp's extra weight buffers: resolve `EngineConfig.extra_bufts` and guard the first decode (see `kernel_verdict`).

    ``off``/``on`` are taken as asked; ``auto`` is ``on`` only where a probe child showed the extra
    buffers decode and graft exactly here. With ``probe`` on, the chosen kernels are first run in a
    child once per machine, so a crash is reported as an EngineError naming the setting to change.
    """
    choice = config.extra_bufts
    if os.environ.get(_CHILD_ENV) or not config.probe:
        return choice == "on"
    if choice == "auto":
        trial = kernel_verdict(model_path, model_sha256, config, True)
        if trial.ran and trial.exact:
            return True
        log.info("extra weight buffers not used: %s", trial.reason or "the probe found them inexact")
    want = choice == "on"
    verdict = kernel_verdict(model_path, model_sha256, config, want)
    if not verdict.ran and verdict.reason.startswith("llama.cpp died"):
        if "while loading" in verdict.reason:
            fix = ("no setting of graftmem avoids a crash while loading; "
                   + ("a llama.cpp built with CUDA whose libggml-cuda.so exports a static copy of libstdc++ "
                      "crashes exactly here (measured with CUDA 13.0 and g++ 13.3): rebuild llama-cpp-python "
                      "with CMAKE_ARGS=\"-DGGML_CUDA=on -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL\" "
                      "(docs/exactness.md, GPU offload); otherwise " if C.llama_supports_gpu_offload() else "")
                   + "check the model file (graftmem doctor --model PATH) and report its output")
        elif want:
            fix = f"turn them off with {_setting_hint('off')}"
        else:
            fix = ("no setting of graftmem avoids it; rebuild llama-cpp-python without -march=native "
                   "(CMAKE_ARGS=\"-DGGML_NATIVE=OFF\") and report the CPU flags")
        raise EngineError(f"{verdict.reason} (probed in a child process; verdict cached as "
                          f"{verdict.key}): {fix}")
    if not verdict.ran:
        log.warning("kernel probe inconclusive (%s); loading in this process", verdict.reason)
    return want
