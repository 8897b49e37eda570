"""The CLI's side of ``--url``: which server to ask, the client that asks it (`graftmem.api.RemoteJSON`:
`Memory`'s verbs and exceptions, the server's JSON, no httpx or pydantic imported), and the flags a
server's greedy answers cannot honour."""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional


def _server(args: argparse.Namespace) -> Optional[str]:
    """The running server to ask instead of loading the model (--url or $GRAFTMEM_URL), if any."""
    url = getattr(args, "server_url", None) or os.environ.get("GRAFTMEM_URL")
    return url.rstrip("/") if url else None


def _client(url: str) -> Any:
    """The server at ``url``, with the key of $GRAFTMEM_API_KEY."""
    from ..api import RemoteJSON

    return RemoteJSON.from_env(url)


def _greedy_remote(args: argparse.Namespace) -> None:
    """The memory API of a server answers greedily, whole, from verified blocks: refuse the flags it
    would otherwise ignore."""
    if (args.temperature or args.seed is not None or args.top_p != 1.0 or args.allow_unverified
            or args.stream):
        from .. import ConfigError

        raise ConfigError("--url answers greedily, whole, from verified blocks: drop --temperature/--top-p/"
                          "--seed/--allow-unverified/--stream, or run without --url (the server's OpenAI API "
                          "samples and streams: docs/agents.md)")
