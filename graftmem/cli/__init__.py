"""The ``graftmem`` command: argument parsing and printing only; every verb calls the public API.

One module per idea: `parser` (the sub-commands and their options), `common` (output, store, config
and sampling from the arguments), `verbs` (the memory's verbs), `sharing` (buckets, bundles, pull,
push, keys), `serve`, `doctor`, `demo`, `remote` (the client for ``--url``), `main` (the entry point).

Errors print one line (``error: ...``) and exit 2; ``verify`` exits 1 on any mismatch.
"""

from __future__ import annotations

from .main import main
from .parser import build_parser

__all__ = ["main", "build_parser"]
