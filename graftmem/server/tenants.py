"""Tenants: who is asking, derived on the server from the API key, never from the request.

Why: one server's clients used to share everything: every client's prompts became automatic blocks any
key holder could read (``/v1/memory/blocks/<id>``, ``/v1/blocks``), and a guessed secret in another
client's system prompt was confirmed by ``cached_tokens`` and by latency (the prompt-cache side channel
of Gu et al., ICML 2025). As providers do (per organization) and as vLLM does (a salt per tenant set by
the server), each key names a tenant, and the tenant is mixed into every automatic block's id and every
prefix-index key (`graftmem.server.prefix`), so one tenant's cached prefixes cannot be found, read,
listed, deleted or evicted by another. Blocks a tenant *learns* through the server are its own too
(salted the same way); sharing them is an explicit choice (``shared: true``, ``serve --shared-learned``),
and the operator's blocks (learned into the home with the SDK or the CLI) are shared with every tenant.
Who sees what is decided in one place for every door: `graftmem.memory.access.Access`.

The key file (``serve --api-key-file``) holds one tenant per line, the key hashed (a leaked file does not
give the keys away)::

    # name    sha256 of the key
    alice     sha256:2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90
    bob       sha256:81b637d8fcd2c6da6359e6963113a1170de795e4b725b84d1e0b4cfd9ec58ce9

(``printf %s "$KEY" | sha256sum`` gives the hex). A request's key is hashed and compared with every
entry in constant time (`hmac.compare_digest`, no early exit), so timing does not tell which prefix of a
key matched. Two tenants with the same hash are refused at start, naming both (the first of them could
never log in: every request with that key would be the other's). The operator's ``serve --metrics-key``
is none of these keys (`check_metrics_key`): it reads the whole server's ``/metrics`` and ``/v1/info``. Without keys the server is one local trust domain: every client is the same tenant
(``None``), and ``graftmem serve`` says so at start-up (and warns when it listens beyond loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import ConfigError
from ..memory.access import owner_of, visible

__all__ = ["ApiKeys", "hash_key", "tenant_of", "visible", "owner_of", "TENANT_STATE", "check_metrics_key"]

#: where the tenant of a request is kept in its ASGI scope's ``state``
TENANT_STATE = "graftmem.tenant"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HASH = re.compile(r"sha256:([0-9a-f]{64})")


def hash_key(key: str) -> str:
    """The at-rest form of an API key: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    """Tenant names and the SHA-256 digests of their keys; `tenant()` finds who a key belongs to."""

    entries: tuple[tuple[str, bytes], ...]
    #: whether the keys name tenants (a key file) or are one shared key (``--api-key``: one trust domain)
    named: bool = True

    def __post_init__(self) -> None:
        # two tenants with one key: every request with it would be the last one's (`tenant()` keeps the
        # last match), and the first could never log in; refused at start, naming both, never the key
        first: dict[bytes, str] = {}
        for name, digest in self.entries:
            if digest in first:
                raise ConfigError(f"tenants {first[digest]!r} and {name!r} have the same API key (the same "
                                  "sha256 in the key file): give each tenant its own key")
            first[digest] = name

    @classmethod
    def single(cls, key: str) -> "ApiKeys":
        """One shared key (``--api-key``): every client that has it is the same tenant (``None``)."""
        if len(key) < 8:
            raise ConfigError("the API key is too short: use at least 8 characters")
        return cls(((None, hashlib.sha256(key.encode("utf-8")).digest()),), named=False)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: "str | os.PathLike[str]") -> "ApiKeys":
        """Read a key file (see the module doc); every malformed line is a `ConfigError` naming it."""
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the API key file {os.fspath(path)!r}: {exc}") from exc
        entries: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not _NAME.fullmatch(parts[0]) or not _HASH.fullmatch(parts[1]):
                raise ConfigError(f"{os.fspath(path)}:{n}: expected 'NAME sha256:<64 hex digits>' (the key "
                                  "hashed: printf %s \"$KEY\" | sha256sum), got a line that is not")
            if parts[0] in seen:
                raise ConfigError(f"{os.fspath(path)}:{n}: tenant {parts[0]!r} is listed twice")
            seen.add(parts[0])
            entries.append((parts[0], bytes.fromhex(parts[1][7:])))
        if not entries:
            raise ConfigError(f"the API key file {os.fspath(path)!r} lists no key")
        return cls(tuple(entries))

    def tenant(self, key: str) -> tuple[bool, Optional[str]]:
        """(whether ``key`` is valid, its tenant). Every entry is compared, in constant time."""
        if not key:
            return False, None
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found, who = False, None
        for name, want in self.entries:
            if hmac.compare_digest(digest, want):  # no early exit: the time does not depend on which
                found, who = True, name
        return found, who


def check_metrics_key(api_key: "str | ApiKeys | None", metrics_key: Optional[str]) -> None:
    """The operator's metrics key (``serve --metrics-key``) is at least 8 characters, guards something (a
    server without keys serves ``/metrics`` to anyone) and is nobody's API key (that key would read both
    its tenant's and the whole server's counters, depending on nothing but the path). `ConfigError`."""
    if metrics_key is None:
        return
    if not isinstance(metrics_key, str) or len(metrics_key) < 8:
        raise ConfigError("the metrics key is too short: use at least 8 characters")
    if api_key is None:
        raise ConfigError("a metrics key needs API keys (--api-key or --api-key-file): without them /metrics "
                          "is open to every client")
    keys = ApiKeys.single(api_key) if isinstance(api_key, str) else api_key
    ok, who = keys.tenant(metrics_key)
    if ok:
        raise ConfigError("the metrics key is also " + (f"tenant {who!r}'s API key" if who else "the API key")
                          + ": give the operator a key of its own")


def tenant_of(scope: Any) -> Optional[str]:
    """The tenant the API key middleware found for this request (None: no keys, one trust domain)."""
    state = scope.get("state") if isinstance(scope, dict) else None
    return state.get(TENANT_STATE) if isinstance(state, dict) else None
