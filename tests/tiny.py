"""The tiny real-family models of scripts/tiny_models.py, for the tests: built once per machine into
graftmem's model cache (a rerun finds them by key), loaded once per test session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tiny_models.py"


def tiny_models() -> ModuleType:
    """scripts/tiny_models.py as a module (scripts/ is not a package)."""
    mod = sys.modules.get("graftmem_tiny_models")
    if mod is None:
        spec = importlib.util.spec_from_file_location("graftmem_tiny_models", _SCRIPT)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["graftmem_tiny_models"] = mod
        spec.loader.exec_module(mod)
    return mod


def tiny_path(family: str) -> Path:
    return tiny_models().build(family)


def template_path(name: str) -> Path:
    return tiny_models().templates_dir() / f"{name}.jinja"


#: A tall tiny Llama 3.1 (128 layers of n_embd 64): 32 KiB of KV cache a token where the 2-layer one has
#: 512 B, so 300 tokens make a block of over 9 MiB (the fleet store's ranged downloads start at 8 MiB)
#: in a prefill several times cheaper than the one of SmolLM2 that makes a block as large.
TALL = {"n_embd": 64, "n_layer": 128}


def tall_path() -> Path:
    return tiny_models().build("llama31", **TALL)


def arch_path(name: str) -> Path:
    """The tiny GGUF of a real llama.cpp architecture (`scripts/tiny_models.py` `ARCHS`)."""
    return tiny_models().build_arch(name)


def scripted_path(name: str) -> Path:
    """A model that writes one fixed answer in a family's format (`scripts/tiny_models.py` `SCRIPTS`)."""
    return tiny_models().build_scripted(name)
