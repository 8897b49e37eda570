"""One exception tree for graftmem, grouped by what the caller does next.

::

    GraftmemError                      catch-all for anything graftmem raises on purpose
    ├── ConfigError                    a wrong argument or setting: fix the call
    ├── ModelNotFound                  the GGUF is not installed: run the install command in the message
    ├── EngineError                    llama.cpp refused an operation (decode failed, context full, ...)
    ├── ClosedError                    the Memory/Engine was used after close()
    ├── StoreError                     the store cannot be used as asked
    │   ├── BlockNotFound              no block with that id: list the store, check the id
    │   ├── StoreLocked                another process holds the store lock past the timeout: retry
    │   └── StoreFull                  the disk is full: free space; nothing was half-written
    └── BlockRejected                  a block exists but must not be grafted
        ├── BlockCorrupted             its bytes do not match their digest (flipped, truncated, tampered)
        └── IncompatibleBlock          it was made by another engine fingerprint (model, n_ctx, KV type...)

Foreign exceptions (OSError, ValueError from pydantic, llama.cpp return codes) are translated at the
module boundary with ``raise ... from exc``, so the original cause stays visible in tracebacks.
Nothing is called ``MemoryError``: that name belongs to Python.
"""

from __future__ import annotations

__all__ = [
    "BlockCorrupted",
    "BlockNotFound",
    "BlockRejected",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "GraftmemError",
    "IncompatibleBlock",
    "ModelNotFound",
    "StoreError",
    "StoreFull",
    "StoreLocked",
]


class GraftmemError(Exception):
    """Base class of every error graftmem raises on purpose."""


class ConfigError(GraftmemError, ValueError):
    """An argument or setting is invalid; the message names it and the allowed values."""


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
