"""One exception tree for graftmem, grouped by what the caller does next.

::

    GraftmemError                      catch-all for anything graftmem raises on purpose
    ├── ConfigError                    a wrong argument or setting: fix the call
    │   └── UnsupportedFeature         this model's architecture cannot do that exactly: use what it names
    ├── ModelNotFound                  the GGUF is not installed: run the install command in the message
    ├── EngineError                    llama.cpp refused an operation (decode failed, context full, ...)
    ├── ClosedError                    the Memory/Engine was used after close()
    ├── StoreError                     the store cannot be used as asked
    │   ├── BlockNotFound              no block with that id: list the store, check the id
    │   ├── StoreLocked                another process holds the store lock past the timeout: retry
    │   ├── StoreFull                  the disk is full: free space; nothing was half-written
    │   └── StoreReadOnly              the home is read-only: reading works, learning does not
    ├── BlockRejected                  a block exists but must not be grafted
    │   ├── BlockCorrupted             its bytes do not match their digest (flipped, truncated, tampered)
    │   ├── IncompatibleBlock          it was made by another engine fingerprint (model, n_ctx, KV type...)
    │   └── UnverifiedBlock            nothing here vouches for its state: re-derive it or allow_unverified
    ├── BundleRejected                 a bundle or pushed upload is malformed or unsafe; nothing was written
    │   └── UntrustedBundle            unsigned, or signed by a key the trust policy does not list
    └── TransferError                  an HTTP transfer failed or was cut: retry (downloads resume)
        └── AccessDenied               the server refused the push token: pass the right token

Foreign exceptions (OSError, ValueError from pydantic, llama.cpp return codes) are translated at the
module boundary with ``raise ... from exc``, so the original cause stays visible in tracebacks.
Nothing is called ``MemoryError``: that name belongs to Python.

Over HTTP the tree travels by name: a server answers an error with its class name (the block routes'
``{"error": "<name>", "message": ...}``, the memory REST routes' OpenAI-shaped ``error.code``), and every
client turns the response back into the same class with `from_response` (one mapping for the block
client and `RemoteMemory`).
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "BlockCorrupted",
    "BlockNotFound",
    "BlockRejected",
    "BundleRejected",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "GraftmemError",
    "IncompatibleBlock",
    "ModelNotFound",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreReadOnly",
    "TransferError",
    "UnsupportedFeature",
    "UntrustedBundle",
    "UnverifiedBlock",
    "from_response",
]


class GraftmemError(Exception):
    """Base class of every error graftmem raises on purpose."""


class ConfigError(GraftmemError, ValueError):
    """An argument or setting is invalid; the message names it and the allowed values."""


class UnsupportedFeature(ConfigError):
    """A feature cannot be exact on this model's architecture (trimming a recurrent state back to a
    shorter prefix, ...); raised before any work. The message names the architecture, the feature and
    what works instead; ``arch`` and ``feature`` carry the first two (`graftmem.core.memkind`)."""

    def __init__(self, message: str, *, arch: str = "", feature: str = "") -> None:
        super().__init__(message)
        self.arch, self.feature = arch, feature


class ModelNotFound(GraftmemError):
    """The requested model is neither a known installed package nor an existing GGUF path."""


class EngineError(GraftmemError):
    """llama.cpp refused an operation (tokenize, decode, state restore)."""


class ClosedError(GraftmemError):
    """The object was used after ``close()``."""


class StoreError(GraftmemError):
    """The block store cannot do what was asked."""


class BlockNotFound(StoreError, KeyError):
    """No block with the given id (or id prefix) exists in the store."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class StoreLocked(StoreError):
    """Another process held the store lock for longer than the timeout."""


class StoreFull(StoreError):
    """The disk ran out of space during a write; the partial file was removed."""


class StoreReadOnly(StoreError):
    """The store's home cannot be written (a read-only mount, no write permission): it was opened
    read-only, so listing, reading, asking and verifying work and every mutation raises this."""


class BlockRejected(GraftmemError):
    """A block exists but must not reach llama.cpp."""


class BlockCorrupted(BlockRejected):
    """A block file's bytes do not match the digest recorded when it was written."""

    def __init__(self, message: str, *, path: str | None = None,
                 expected: str | None = None, actual: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class IncompatibleBlock(BlockRejected):
    """A block was made under another engine fingerprint; ``fields`` lists what differs."""

    def __init__(self, message: str, *, fields: dict[str, tuple[object, object]] | None = None) -> None:
        super().__init__(message)
        self.fields = fields or {}


class UnverifiedBlock(BlockRejected):
    """The block's provenance is ``unverified`` (it arrived without re-derivation or a trusted
    signature): grafting it could answer from a state that is not its text's. Re-derive it
    (``Memory.rederive``) or pass ``allow_unverified=True``."""


class BundleRejected(GraftmemError):
    """A bundle (or an upload) is malformed or unsafe: truncated, a member that escapes its directory,
    a link or device, an oversized or unexpected member, a manifest that does not parse. Raised before
    anything reaches the store, which is left exactly as it was."""


class UntrustedBundle(BundleRejected):
    """The trust policy requires a signature from a listed key and the bundle has none, or its key is
    not listed, or the signature does not verify."""


class TransferError(GraftmemError):
    """An HTTP transfer failed (connection refused or cut, bad status). Nothing was added to the store;
    a partial download is kept and resumed by the next pull."""


class AccessDenied(TransferError):
    """The server refused the request's token (push without a token, or a wrong one), or the key's tenant
    may not change that block (one shared with every tenant: the operator's, or another tenant's share)."""


def from_response(status: int, body: bytes, what: str) -> GraftmemError:
    """The exception a graftmem server's error response stands for, to raise at the client.

    The class is the one the server named (block routes: ``{"error": "<class>", "message": ...}``;
    OpenAI-shaped routes: ``{"error": {"message", "code": "<class>", "param"}}``), so a missing block is
    `BlockNotFound` on both sides of the wire and a bad argument a `ConfigError` with its ``param``. A
    name that is not one of ours (a proxy's page, an HTTP-level refusal) is a `TransferError`; a 401 or
    403 is always an `AccessDenied` (a wrong key or token: the caller fixes its credentials). The message
    is ``"<what>: server answered <status>: <the server's message>"``."""
    import json

    name, param = "TransferError", None
    msg = body[:200].decode("utf-8", "replace")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, str):
            name, msg = err, str(data.get("message", ""))
        elif isinstance(err, dict):
            msg = str(err.get("message", msg))
            code = err.get("code")
            name = code if isinstance(code, str) else name
            param = err.get("param") if isinstance(err.get("param"), str) else None
    cls = globals().get(name) if name in __all__ else None
    if not (isinstance(cls, type) and issubclass(cls, GraftmemError)):
        cls = TransferError
    if status in (401, 403) and not issubclass(cls, AccessDenied):
        cls = AccessDenied
    exc = cls(f"{what}: server answered {status}: {msg}")
    if param is not None:
        exc.param = param  # type: ignore[attr-defined]
    return exc
