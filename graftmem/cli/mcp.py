"""``graftmem mcp``: the memory as an MCP server over stdio (`graftmem.integrations.run_stdio`)."""

from __future__ import annotations

import argparse
import os

from .common import _memory
from .remote import _server


def cmd_mcp(args: argparse.Namespace) -> int:
    """Serve MCP on stdin/stdout until the client closes it: through the server of ``--url`` /
    ``$GRAFTMEM_URL`` (with ``$GRAFTMEM_API_KEY``), else this store with its model loaded here. stdout
    carries MCP's messages only."""
    from .. import ConfigError

    try:
        from ..integrations import run_stdio
    except ImportError as exc:  # the extra is missing: one line naming it, not a traceback
        raise ConfigError(str(exc)) from None
    url = _server(args)
    if url:
        run_stdio(url, api_key=os.environ.get("GRAFTMEM_API_KEY") or None)
    else:
        run_stdio(memory=lambda: _memory(args))
    return 0
