"""What every benchmark shares: one timing summary, one results writer, one engine factory.

Why one of each: the scripts had grown eight private medians, each rounding and naming its keys its own
way, and their result files said neither which commit nor which CPU they measured, so two files could
not be compared without reading the scripts that wrote them. Here:

* :func:`summary`: median, mean, min, max, interquartile range and count of a list of timings (or
  rates), computed and named the same way in every bench;
* :func:`write_results`: the JSON a bench writes, stamped with the exact command line, the commit (and
  whether the working tree differed from it), the machine (CPU model, the CPU flags that decide which
  llama.cpp kernels run, the cores this process may use), the llama.cpp threads, the Python and package
  versions and the date. A script's own keys are kept as they are; only the stamp is added;
* :func:`engine`: a :class:`graftmem.Engine` from a model name and config keywords (checked by
  :class:`graftmem.EngineConfig`, which refuses unknown keys); the threads of the engines it built are
  what the stamp records when the script does not say;
* :func:`example_modules`: an example's modules (``examples/flywheel/solver.py``) for a bench that
  measures the example's own code, without editing the module search path.

Run any bench from the repository root: ``python -m bench.fuzz --mutations 50``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import graftmem
from graftmem import Engine, EngineConfig
from graftmem.core import usable_cores

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: The /proc/cpuinfo flags that decide which llama.cpp kernels run (x86: AVX2, AVX-512 and its VNNI /
#: BF16 dot products, AMX tiles; Arm: NEON (asimd), dot product, int8 matmul, SVE): two results with
#: different flags here did not run the same code. Reported in this order, those present only.
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve", "sve2")

#: The llama.cpp threads of every engine :func:`engine` built in this process (for the stamp).
_engine_threads: list[int] = []


# ----------------------------------------------------------------------------- summary
def _percentile(ordered: Sequence[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default ``percentile``), so that a p50
    is the median and the quartiles are ``statistics.quantiles(method="inclusive")``'s."""
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(xs: Iterable[float], *, digits: Optional[int] = None, unit: str = "",
            percentiles: Sequence[float] = (), samples: bool = False) -> dict[str, Any]:
    """Median, mean, min, max, interquartile range (``iqr``) and ``n`` of some measurements.

    ``digits`` rounds every value; ``unit`` suffixes the keys (``unit="ms"``: ``median_ms``,
    ``min_ms`` ...; ``n`` stays ``n``), so a script keeps the key names its readers know;
    ``percentiles=(95,)`` adds ``p95``; ``samples=True`` keeps the values themselves (in the order
    measured) under ``samples``. The median and the spread, never a mean alone: these machines are
    shared, and one slow round moves a mean but not a median."""
    vals = [float(x) for x in xs]
    if not vals:
        raise ValueError("summary() of no measurements: the loop that should have timed something never ran")
    ordered = sorted(vals)
    stats = {"median": statistics.median(ordered), "mean": statistics.fmean(ordered), "min": ordered[0],
             "max": ordered[-1], "iqr": _percentile(ordered, 75) - _percentile(ordered, 25)}
    stats.update({f"p{p:g}": _percentile(ordered, p) for p in percentiles})
    if digits is not None:
        stats = {k: round(v, digits) for k, v in stats.items()}
    out: dict[str, Any] = {(f"{k}_{unit}" if unit else k): v for k, v in stats.items()}
    out["n"] = len(vals)
    if samples:
        out["samples"] = [round(v, digits) for v in vals] if digits is not None else vals
    return out


# ----------------------------------------------------------------------------- engines
def prose(n_words: int, seed: int) -> str:
    """Deterministic filler of ``n_words`` words from a small agent-manual vocabulary (``seed`` picks the
    sequence): text whose content does not matter to the bench, only its length and that it repeats."""
    import random

    rng = random.Random(seed)
    vocab = "the agent reads a manual and answers the customer about orders refunds shipping codes".split()
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def engine(model: str, **config: Any) -> Engine:
    """An engine for a bench: ``engine("smollm2", n_ctx=4096, probe=False)``. The config keywords are
    :class:`graftmem.EngineConfig`'s (a misspelt one is an error, not a silently default setting); the
    engine's thread count is remembered for the results stamp."""
    eng = Engine(model, EngineConfig(**config))
    _engine_threads.append(eng.n_threads)
    return eng


# ----------------------------------------------------------------------------- examples
def example_modules(folder: str, *names: str) -> list[ModuleType]:
    """Modules of an example, ``examples/<folder>/<name>.py``, loaded in the order given:
    ``problems, solver = example_modules("flywheel", "problems", "solver")``.

    The examples are scripts a reader runs from their folder, not a package: they import their
    siblings by bare name (``from problems import ...``). So each module is registered under its bare
    name before it runs, and a later one finds an earlier one; the module search path is left alone."""
    out = []
    for name in names:
        path = ROOT / "examples" / folder / f"{name}.py"
        mod = sys.modules.get(name)
        if mod is None or Path(getattr(mod, "__file__", "") or "").resolve() != path:
            if not path.is_file():
                raise FileNotFoundError(f"no example module {path}")
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[name]
                raise
        out.append(mod)
    return out


# ----------------------------------------------------------------------------- the stamp
def command_line() -> str:
    """The command that started this process, as it is typed from the repository root:
    ``python -m bench.fuzz --mutations 50`` (the arguments quoted for a POSIX shell)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = f"python -m {spec.name.removesuffix('.__main__')}"
    else:  # not started with -m (imported by a test, or python path/to/script.py)
        head = "python " + sys.argv[0]
    return " ".join([head, *map(shlex.quote, sys.argv[1:])])


def _git(*argv: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def commit() -> dict[str, Any]:
    """``{"commit": <git rev-parse HEAD>}``, plus ``"dirty": True`` when the working tree differs from it
    (tracked changes or new files), so a number measured on uncommitted code says so. Changes under
    bench/results/ do not count: they are this or an earlier run's output, not the code measured.
    ``{"commit": None}`` outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": None}
    out: dict[str, Any] = {"commit": head.strip()}
    changes = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    if changes and changes.strip():
        out["dirty"] = True
    return out


def _cpuinfo() -> tuple[Optional[str], list[str]]:
    """The CPU model and the kernel-relevant flags of the first processor in /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return None, []
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu model")
    present = set((fields.get("flags") or fields.get("features") or "").split())
    return model, [f for f in CPU_FLAGS if f in present]


def machine() -> dict[str, Any]:
    """Where the numbers were measured: platform, CPU model and flags, the cores this process may use
    (its CPU affinity: a container's or taskset's share, what llama.cpp's threads get) and the host's."""
    model, flags = _cpuinfo()
    return {"platform": platform.platform(), "cpu": model or platform.processor() or platform.machine(),
            "cpu_flags": flags, "cores": usable_cores(), "cpus": os.cpu_count()}


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)  # a Path, an enum: its text


def stamp(args: Optional[argparse.Namespace] = None, *, threads: Any = None) -> dict[str, Any]:
    """What :func:`write_results` adds to every result: command, commit (+ dirty), date, machine,
    threads, python, packages and, given ``args``, every parsed option (defaults included, which the
    command line does not spell).

    ``threads``: the llama.cpp threads of the run, when the script knows them; else ``args.threads``;
    else those of the engines :func:`engine` built (one number, or the list when they differed); else
    what an engine with the default config takes (the usable cores)."""
    if threads is None and args is not None:
        threads = getattr(args, "threads", None)
    if threads is None and _engine_threads:
        seen = sorted(set(_engine_threads))
        threads = seen[0] if len(seen) == 1 else seen
    if threads is None:
        threads = usable_cores()
    out: dict[str, Any] = {"command": command_line(), **commit(),
                           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           "machine": machine(), "threads": threads, "python": platform.python_version(),
                           "packages": {"graftmem": graftmem.__version__,
                                        "llama_cpp_python": _version("llama_cpp_python")}}
    if args is not None:
        out["args"] = _jsonable(vars(args))
    return out


def write_results(path: os.PathLike | str, data: dict[str, Any], *, args: Optional[argparse.Namespace] = None,
                  threads: Any = None, indent: int = 2, default: Optional[Callable[[Any], Any]] = None) -> Path:
    """Write a bench's results as JSON at ``path`` (its folder made), the :func:`stamp` first, then the
    script's own keys unchanged. Returns the path.

    A script key that is also a stamp key must be a dict next to a dict (``machine``: the script's
    load averages join the stamp's CPU; the script's value wins a shared key); any other clash is an
    error, because the stamp is the one place that says which command, commit and threads a number
    belongs to. Written to a temporary file and renamed: an interrupted run never leaves half a file
    where the last good one was."""
    st = stamp(args, threads=threads)
    clash = sorted(k for k, v in data.items() if k in st and not (isinstance(v, dict) and isinstance(st[k], dict)))
    if clash:
        raise ValueError(f"results keys {clash} are the harness's stamp: leave them out of the data "
                         "(write_results fills them; pass threads= for the thread count)")
    out = dict(st)
    for k, v in data.items():
        out[k] = {**st[k], **v} if k in st else v
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=indent, default=default) + "\n")
    os.replace(tmp, dest)
    return dest


if __name__ == "__main__":  # python -m bench.harness: what a result written here and now would be stamped with
    print(json.dumps(stamp(), indent=2))
