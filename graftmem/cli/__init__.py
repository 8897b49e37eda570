"""The ``graftmem`` command: argument parsing and printing only; every verb calls the public API.

One module per idea: `parser` (the sub-commands and their options), `common` (output, store, config
and sampling from the arguments), `verbs` (the memory's verbs), `sharing` (buckets, bundles, pull,
push, keys), `serve`, `doctor`, `demo`, `remote` (the client for ``--url``), `main` (the entry point).

Errors print one line (``error: ...``) and exit 2, or under ``--json`` one object
``{"error": {"type", "message", "fix", "exit_code"}}`` on stdout (`main`); ``verify`` exits 1 on any
mismatch. A mistyped command or option names the nearest one.
"""

from __future__ import annotations

from .main import main
from .parser import build_parser

__all__ = ["main", "build_parser"]
