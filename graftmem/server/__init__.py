"""Server: graftmem over HTTP. Today the block-sharing server (:class:`BlockServer`); it is given a store,
a fingerprint and an optional admission check, never a :class:`graftmem.Memory`."""

from .blocks import BlockServer

__all__ = ["BlockServer"]
