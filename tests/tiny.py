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
