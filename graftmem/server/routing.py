"""The router as the server holds it: created on the first request that routes (loading torch and the
embedder costs seconds, so a server that never routes never pays it), then kept in step with the
blocks learned and deleted through the server."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from ..core.blocks import Block
    from ..memory.router import Router

__all__ = ["RouterRef"]


class RouterRef:
    """``factory()`` called once, on the first `get()`."""

    def __init__(self, factory: Optional[Callable[[], "Router"]]) -> None:
        self._factory = factory
        self._router: Optional["Router"] = None
        self._pending: dict[str, "Block"] = {}
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._factory is not None

    def get(self) -> "Router":
        with self._lock:
            if self._router is None:
                if self._factory is None:
                    raise RuntimeError("no router factory")
                router = self._factory()
                if self._pending:  # learned here before the first routed request (see `added`)
                    router.add_blocks(list(self._pending.values()))
                    self._pending.clear()
                self._router = router
            return self._router

    def added(self, blocks: Sequence["Block"]) -> None:
        """Route new blocks too. Before the router is loaded they are kept and added on the first `get`:
        the factory may hand over a router loaded before (`Memory.serve`: the app's own), which would
        miss them (the store's data version does not move for writes on the same connection)."""
        with self._lock:
            if self._router is None:
                if self._factory is not None:
                    self._pending.update((b.id, b) for b in blocks)
                return
            router = self._router
        router.add_blocks(list(blocks))

    def removed(self, ids: Sequence[str]) -> None:
        with self._lock:
            for i in ids:
                self._pending.pop(i, None)
            router = self._router
        if router is not None:
            router.remove(list(ids))
