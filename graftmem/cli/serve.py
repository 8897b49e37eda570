"""``graftmem serve``: the server's flags read into one `ServeConfig`, served through the API, its endpoints
printed."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from typing import Any, Optional

from .common import _home, _memory, _sign_key
from .sharing import _key_mode

log = logging.getLogger("graftmem")


def cmd_serve(args: argparse.Namespace) -> int:
    """One long-running server: block sharing, and (unless --blocks-only) the OpenAI-compatible API
    with the persistent prompt cache, on one socket. The flags become one `ServeConfig`, served by
    `Memory.serve` (the same call an application makes), or without a model by `block_server`."""
    from .. import ConfigError
    from ..server import ApiKeys, block_server

    token = args.push_token or os.environ.get("GRAFTMEM_PUSH_TOKEN")
    api_key: Any = args.api_key or os.environ.get("GRAFTMEM_API_KEY")
    if args.api_key_file:
        if api_key:
            raise ConfigError("give --api-key (one shared key) or --api-key-file (a key per tenant), not both")
        api_key = ApiKeys.load(args.api_key_file)
    config = serve_config(args, api_key=api_key, push_token=token,
                          metrics_key=args.metrics_key or os.environ.get("GRAFTMEM_METRICS_KEY"))
    if config.api:
        return _serve_api(args, config)
    mem = _memory(args) if token else None  # pushes need the engine
    try:
        srv = mem.serve(config) if mem is not None else block_server(_home(args), config)
        try:
            _close_on_sigterm()  # before the line that tells a supervisor the server is up
            _announce(srv, args, config)
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.close()
    finally:
        if mem:
            mem.close()
    return 0


def _serve_api(args: argparse.Namespace, config: Any) -> int:
    """The API server, bound before its model loads: ``/health`` answers 503 ``loading`` from the first
    second (an orchestrator's probe reads "loading", not "connection refused"), 200 once the engines are
    loaded and warmed. The engines load in a thread while this (the main) thread serves, so Ctrl-C and
    SIGTERM are handled throughout; the first line (which scripts read for the URL) is printed once the
    server answers."""
    from ..server import bind

    runner = bind(config.host, config.port, config.limits)
    log.info("serve: listening on %s; loading the model (/health answers 503 until it is ready)", runner.url)
    made: dict[str, Any] = {}
    stopping = threading.Event()

    def load() -> None:
        try:
            made["mem"] = mem = _memory(args)
            made["srv"] = srv = mem.serve(config, runner=runner)  # the same call an application makes
            if stopping.is_set():  # Ctrl-C / SIGTERM while loading: closed by the main thread, never opened
                return
            srv.start()  # the gate opens: requests reach the routes
            warmed = getattr(srv, "warm", [])
            what = (f"OpenAI API at {srv.url}/v1 with {config.engines} engine(s) x {mem.engine.n_threads_batch} "
                    f"prefill thread(s) ({mem.engine.n_threads} for one-token calls) on one loaded model, ")
            if warmed:
                what += f"{sum(w['tokens'] for w in warmed)} prompt tokens warm in RAM, "
            _announce(srv, args, config, what)
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread
            made["error"] = exc
            runner.stop()

    loader = threading.Thread(target=load, name="graftmem-load", daemon=True)
    try:
        _close_on_sigterm()
        loader.start()
        runner.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stopping.set()
        runner.stop()
        loader.join()  # a load under way finishes before its engines are closed
        srv = made.get("srv")
        if srv is not None:
            srv.close()
        else:
            runner.close()
        if made.get("mem") is not None:
            made["mem"].close()
    if "error" in made:
        raise made["error"]
    return 0


def _announce(srv: Any, args: argparse.Namespace, config: Any, what: str = "") -> None:
    """The first line (scripts read the URL from it; printed once the server answers), then the endpoints."""
    print(f"serving {srv.store.home} at {srv.url} ({what}pushes {'on' if config.push_token else 'off'}, "
          f"listings {'signed' if args.sign else 'unsigned'}, "
          f"API key {_key_mode(config.api_key)}); Ctrl-C stops", flush=True)
    for line in _endpoint_lines(srv.url, config.api, config.ui, mcp=bool(config.mounts)):
        print(line, flush=True)


def serve_config(args: argparse.Namespace, *, api_key: Any, push_token: Optional[str],
                 metrics_key: Optional[str] = None) -> Any:
    """``serve``'s flags as the `ServeConfig` they mean (checked there: a wrong value is a
    `ConfigError` naming the option)."""
    import dataclasses

    from .. import ServeConfig
    from ..server import Limits

    limits = Limits(max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client,
                    min_body_rate=args.min_body_rate, body_grace=args.body_grace, write_timeout=args.write_timeout,
                    max_embedding_inputs=args.max_embedding_inputs, max_embedding_chars=args.max_embedding_chars,
                    render_timeout=args.render_timeout, max_messages=args.max_messages,
                    refusal_delay=args.refusal_delay,
                    grammar=dataclasses.replace(Limits().grammar, max_repeat=args.max_schema_repeat,
                                                max_enum_values=args.max_enum_values))
    return ServeConfig(
        host=args.host, port=args.port, api=not args.blocks_only, api_key=api_key, metrics_key=metrics_key,
        push_token=push_token,
        sign_key=_sign_key(args), rederive=args.rederive, allow_unverified=args.allow_unverified,
        engines=args.engines, max_queue=args.max_queue, learn=not args.no_learn,
        min_prefix_tokens=args.min_prefix_tokens, sightings=args.sightings,
        max_auto_bytes=args.max_auto_mb * (1 << 20), auto_storage=args.auto_storage, warm=not args.no_warm,
        chat_template=args.chat_template_file, shared_learned=args.shared_learned,
        responses_ttl=args.responses_ttl, limits=None if limits == Limits() else limits, ui=args.ui,
        mounts=_mounts(args), preload_router=args.preload_router)


def _mounts(args: argparse.Namespace) -> tuple:
    """``--mcp``: MCP's streamable HTTP at /mcp (`graftmem.integrations.McpDoor`, extra ``graftmem[mcp]``)."""
    if not getattr(args, "mcp", False):
        return ()
    from .. import ConfigError

    if args.blocks_only:
        raise ConfigError("--mcp needs the memory's routes: drop --blocks-only")
    try:
        from ..integrations import McpDoor
    except ImportError as exc:  # the extra is missing: one line naming it, not a traceback
        raise ConfigError(str(exc)) from None
    return (("/mcp", McpDoor(host=args.host)),)


def _endpoint_lines(url: str, api: bool, ui: bool = False, mcp: bool = False) -> list[str]:
    """What ``serve`` answers, one line per route group (printed after the first line, which scripts
    read for the URL)."""
    lines = [f"  blocks      {url}/v1/info, /v1/blocks, /v1/push, /v1/bundles (sharing: pull, push)"]
    if api:
        lines = [f"  openai      {url}/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings",
                 f"  responses   {url}/v1/responses, /v1/responses/{{id}}, /v1/responses/{{id}}/input_items",
                 f"  anthropic   {url}/v1/messages, /v1/messages/count_tokens",
                 f"  memory      {url}/v1/memory/blocks, /learn, /search, /recall, /ask, /verify",
                 *([f"  mcp         {url}/mcp (streamable HTTP: learn, recall, search, ask, verify, forget, list, show)"]
                   if mcp else []),
                 *lines, f"  ops         {url}/health (no key), /metrics"]
    if ui:
        lines.append(f"  web page    {url}/ui (the page asks for the API key; docs/ui.md)")
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
