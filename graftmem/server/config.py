"""`ServeConfig`: every option of a graftmem server in one frozen, checked object.

Why one object: ``graftmem serve`` used to compose the server itself with 15 keyword arguments to
`api_server`, because `Memory.serve` took only six of them (no engines, queue, learning, storage
limits, warm start, tenants' sharing, responses' lifetime). Each layer then spelled the same option
list with its own defaults. Now the CLI reads its flags into a `ServeConfig`, `Memory.serve` takes it
(or keyword arguments that build one), and `api_server` reads it: the options, their defaults and
their checks live here once, and a wrong value is a `ConfigError` naming the field before any socket
is bound or engine opened.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from ..memory import validate as check
from ..share.trust import SigningKey
from .http import Limits
from .responses import DEFAULT_TTL
from .tenants import ApiKeys, check_metrics_key

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """What a server listens on, whom it lets in, and how it learns; frozen (`replace` makes a changed
    copy) and checked on construction.

    ``api``: ``False`` serves block sharing only (`BlockServer`: listings, pulls, pushes if
    ``push_token``); ``True`` adds what ``graftmem serve`` answers: the OpenAI-compatible, Responses and
    Anthropic APIs with the persistent prefix cache, ``/v1/embeddings`` and the memory's REST routes.
    The other fields are documented where they take effect (`graftmem.server.api_server`); in short:

    * ``host`` / ``port``: where to listen (loopback and a free port by default);
    * ``api_key``: one key (one trust domain) or `ApiKeys` (a tenant per key, ``serve --api-key-file``);
      ``metrics_key``: the operator's key, which reads ``/metrics`` and ``/v1/info`` only, the whole
      server's (with tenants, a tenant's key reads its own counters); ``push_token``: accept pushed
      bundles with it; ``sign_key``: sign listings;
    * ``rederive``: re-prefill each pushed block no trusted key signed, refusing it unless the state is
      equal (``False`` lands them ``unverified``); ``allow_unverified``: graft such blocks anyway;
    * ``engines``: engine contexts (requests decoded at once; `Memory.serve` opens the extra ones and
      closes them with the server); ``max_queue``: requests that may wait (more get 429);
    * ``learn`` / ``min_prefix_tokens`` / ``sightings``: learn a prompt prefix of at least
      ``min_prefix_tokens`` tokens once it was seen ``sightings`` times; ``max_auto_bytes`` (None: no
      bound) and ``auto_storage`` (``"full"`` or ``"delta"``) for those automatic blocks;
    * ``warm``: graft the most recently learned prefixes into the engines before serving;
    * ``chat_template``: a Jinja file that renders chat requests instead of the GGUF's template;
    * ``shared_learned``: with tenants, blocks learned through REST are shared by default;
    * ``responses_ttl``: seconds a stored ``/v1/responses`` response is kept (None: until evicted);
    * ``model_id``: the name ``/v1/models`` reports (default: the model's); ``limits``: bounds per request;
    * ``ui``: serve the web page ``/ui`` (`graftmem.server.ui`: what the memory holds, behind the same keys);
      off unless asked for, and only with ``api`` (the page reads the memory's REST routes).
    * ``preload_router``: load the router (torch and the embedder: seconds of CPU, ~0.5 GB) before serving
      instead of on the first request that routes or embeds, so that request (an embeddings flood's
      first, say) does not stall the others while it loads; off by default (a server that never routes
      never pays for it).
    * ``mounts``: ``(path, ASGI app)`` pairs answered at those paths behind the same keys, for doors built
      above the server (``serve --mcp`` mounts `graftmem.integrations.mcp.McpDoor` at ``/mcp``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    api: bool = False
    api_key: Union[str, ApiKeys, None] = None
    metrics_key: Optional[str] = None
    push_token: Optional[str] = None
    sign_key: Optional[SigningKey] = None
    rederive: bool = True
    allow_unverified: bool = False
    engines: int = 1
    max_queue: int = 16
    learn: bool = True
    min_prefix_tokens: int = 256
    sightings: int = 2
    max_auto_bytes: Optional[int] = 2 << 30
    auto_storage: Literal["full", "delta"] = "full"
    warm: bool = True
    chat_template: Optional[str] = None
    shared_learned: bool = False
    responses_ttl: Optional[float] = DEFAULT_TTL
    model_id: Optional[str] = None
    limits: Optional[Limits] = None
    ui: bool = False
    mounts: tuple[tuple[str, Any], ...] = ()
    preload_router: bool = False

    def __post_init__(self) -> None:
        check.text("host", self.host)
        check.integer("port", self.port, lo=0, hi=65535)
        check.flag("api", self.api)
        if not (self.api_key is None or isinstance(self.api_key, ApiKeys)):
            check.text("api_key", self.api_key)
            if len(self.api_key) < 8:
                raise check._error("api_key", "api_key is too short: use at least 8 characters")
        check.text("metrics_key", self.metrics_key, optional=True)
        check_metrics_key(self.api_key, self.metrics_key)
        check.text("push_token", self.push_token, optional=True)
        check.instance("sign_key", self.sign_key, SigningKey)
        for name in ("rederive", "allow_unverified", "learn", "warm", "shared_learned", "preload_router"):
            check.flag(name, getattr(self, name))
        check.integer("engines", self.engines, lo=1, hi=256)
        check.integer("max_queue", self.max_queue, lo=0)
        check.integer("min_prefix_tokens", self.min_prefix_tokens, lo=1)
        check.integer("sightings", self.sightings, lo=1)
        check.integer("max_auto_bytes", self.max_auto_bytes, lo=0, optional=True)
        check.choice("auto_storage", self.auto_storage, ("full", "delta"))
        if self.chat_template is not None:
            check.path("chat_template", self.chat_template)
            object.__setattr__(self, "chat_template", os.fspath(self.chat_template))
        if self.responses_ttl is not None:
            ttl = self.responses_ttl
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < float("inf"):
                raise check._error("responses_ttl", f"responses_ttl must be a number of seconds >= 0 (or None: "
                                                    f"until evicted), got {ttl!r:.40}")
        check.text("model_id", self.model_id, optional=True)
        check.instance("limits", self.limits, Limits)
        check.flag("ui", self.ui)
        if self.ui and not self.api:
            raise check._error("ui", "ui=True needs api=True: the page reads the memory's REST routes "
                                     "(graftmem serve --ui without --blocks-only)")
        if not isinstance(self.mounts, tuple) or not all(
                isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str) and m[0].startswith("/")
                and callable(m[1]) for m in self.mounts):
            raise check._error("mounts", "mounts must be a tuple of (path starting with '/', ASGI app) pairs")

    @classmethod
    def of(cls, config: Optional["ServeConfig"] = None, /, **overrides: Any) -> "ServeConfig":
        """``config`` (or the defaults) with ``overrides`` applied: how the keyword arguments of
        `Memory.serve` and `api_server` keep working. An unknown name is a `ConfigError` naming it and
        the known ones (a misspelt option must not be silently ignored)."""
        if config is not None and not isinstance(config, cls):
            raise check._error("config", f"config must be a ServeConfig, got {type(config).__name__}")
        unknown = sorted(set(overrides) - set(cls.fields()))
        if unknown:
            raise check._error(unknown[0], f"unknown server option(s) {', '.join(unknown)}: give "
                                           f"{', '.join(cls.fields())}")
        if config is None:
            return cls(**overrides)
        return dataclasses.replace(config, **overrides) if overrides else config

    def replace(self, **changes: Any) -> "ServeConfig":
        """A copy with ``changes`` applied, checked like a new one."""
        return ServeConfig.of(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))
