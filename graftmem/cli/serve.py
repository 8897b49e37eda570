"""``graftmem serve``: the server's options read into one call of the API, its endpoints printed."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .common import _home, _memory, _sign_key
from .sharing import _key_mode


def cmd_serve(args: argparse.Namespace) -> int:
    """One long-running server: block sharing, and (unless --blocks-only) the OpenAI-compatible API
    with the persistent prompt cache, on one socket."""
    from .. import ConfigError
    from ..server import ApiKeys, BlockServer, api_server, pool_engines

    token = args.push_token or os.environ.get("GRAFTMEM_PUSH_TOKEN")
    api_key: Any = args.api_key or os.environ.get("GRAFTMEM_API_KEY")
    if args.api_key_file:
        if api_key:
            raise ConfigError("give --api-key (one shared key) or --api-key-file (a key per tenant), not both")
        api_key = ApiKeys.load(args.api_key_file)
    api = not args.blocks_only
    mem = _memory(args) if (token or api) else None  # the API and pushes need the engine
    extra: list[Any] = []
    try:
        if api:
            assert mem is not None
            # one loaded model, threads sized per engine (logged): graftmem.server.pool.pool_engines
            extra = pool_engines(mem.engine, max(1, args.engines))[1:]
            srv = api_server(mem.store, [mem.engine, *extra], host=args.host, port=args.port, api_key=api_key,
                             push_token=token, sign_key=_sign_key(args),
                             check=mem.vetting(rederive=args.rederive),
                             max_queue=args.max_queue, min_prefix_tokens=args.min_prefix_tokens,
                             sightings=args.sightings, learn=not args.no_learn,
                             max_auto_bytes=args.max_auto_mb << 20, auto_storage=args.auto_storage,
                             warm=not args.no_warm, router=lambda: mem.router,  # loaded on the first routed request
                             chat_template=args.chat_template_file, allow_unverified=args.allow_unverified,
                             shared_learned=args.shared_learned,
                             responses_ttl=args.responses_ttl)
        elif mem:
            srv = mem.serve(host=args.host, port=args.port, push_token=token, sign_key=_sign_key(args),
                            rederive=args.rederive)
        else:
            srv = BlockServer(_home(args), host=args.host, port=args.port, sign_key=_sign_key(args),
                              api_key=api_key)
        try:
            _close_on_sigterm()  # before the line that tells a supervisor the server is up
            warmed = getattr(srv, "warm", [])
            what = (f"OpenAI API at {srv.url}/v1 with {1 + len(extra)} engine(s) x {mem.engine.n_threads} "
                    f"thread(s) on one loaded model, " if api and mem else "")
            if warmed:
                what += f"{sum(w['tokens'] for w in warmed)} prompt tokens warm in RAM, "
            print(f"serving {srv.store.home} at {srv.url} ({what}pushes {'on' if token else 'off'}, "
                  f"listings {'signed' if args.sign else 'unsigned'}, "
                  f"API key {_key_mode(api_key)}); Ctrl-C stops", flush=True)
            for line in _endpoint_lines(srv.url, api):
                print(line, flush=True)
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.close()
    finally:
        for e in extra:
            e.close()
        if mem:
            mem.close()
    return 0


def _endpoint_lines(url: str, api: bool) -> list[str]:
    """What ``serve`` answers, one line per route group (printed after the first line, which scripts
    read for the URL)."""
    lines = [f"  blocks      {url}/v1/info, /v1/blocks, /v1/push, /v1/bundles (sharing: pull, push)"]
    if api:
        lines = [f"  openai      {url}/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings",
                 f"  responses   {url}/v1/responses, /v1/responses/{{id}}, /v1/responses/{{id}}/input_items",
                 f"  anthropic   {url}/v1/messages, /v1/messages/count_tokens",
                 f"  memory      {url}/v1/memory/blocks, /learn, /search, /recall, /ask",
                 *lines, f"  ops         {url}/health (no key), /metrics"]
    return lines


def _close_on_sigterm() -> None:
    """Make SIGTERM end ``serve`` through ``srv.close()`` as Ctrl-C does. uvicorn shuts down gracefully on
    it, then raises the signal again with the handler found before it started; with the default one the
    process died there, before ``close()`` waited for the requests' learned prefixes to be written
    (measured: `bench/serve.py` stopping a server lost the last turn's blocks)."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: whoever embeds it handles its signals
        pass
