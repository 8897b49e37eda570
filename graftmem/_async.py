"""AsyncMemory: the :class:`Memory` verbs as coroutines, for asyncio agents.

Each call runs the synchronous method in a worker thread (``asyncio.to_thread``), so the event loop
keeps serving while llama.cpp prefills or decodes. That is safe because ``Memory`` is: the llama
context is serialized by the engine's lock, the store by its own lock and SQLite, the router by its
lock (the task embedding runs outside it). Calls that need the context queue behind each other;
routing and store reads overlap with them.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from ._memory import Memory

if TYPE_CHECKING:
    from ._blocks import Block, Recall, SearchHit, StoreStats, VerifyReport

__all__ = ["AsyncMemory"]


class AsyncMemory:
    """An asyncio facade over one :class:`Memory` (constructed with the same arguments, or given one).

    >>> async with AsyncMemory() as mem:                         # doctest: +SKIP
    ...     await mem.learn(manual, name="refunds", when_to_use="refund requests", chat=True)
    ...     r = await mem.recall("Customer NW-20417 wants a refund")
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, memory: Optional[Memory] = None,
                 **kwargs: Any) -> None:
        self.memory = memory if memory is not None else Memory(model, **kwargs)
        self._owns = memory is None

    async def __aenter__(self) -> "AsyncMemory":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns:
            await asyncio.to_thread(self.memory.close)

    async def learn(self, text: str, *, name: Optional[str] = None, kind: str = "manual",
                    metadata: Optional[Mapping[str, Any]] = None, when_to_use: Optional[str] = None,
                    chat: bool = False, parent: Optional[str] = None) -> "Block":
        return await asyncio.to_thread(self.memory.learn, text, name=name, kind=kind, metadata=metadata,
                                       when_to_use=when_to_use, chat=chat, parent=parent)

    add = learn

    async def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
                     mode: Literal["graft", "text"] = "graft") -> "Recall":
        return await asyncio.to_thread(self.memory.recall, task, max_tokens=max_tokens,
                                       min_score=min_score, mode=mode)

    async def search(self, task: str, *, top_k: int = 5) -> "list[SearchHit]":
        return await asyncio.to_thread(self.memory.search, task, top_k=top_k)

    async def ask(self, block_id: str, query: str, *, max_tokens: int = 64) -> "Recall":
        return await asyncio.to_thread(self.memory.ask, block_id, query, max_tokens=max_tokens)

    async def get(self, block_id: str) -> "Block":
        return await asyncio.to_thread(self.memory.get, block_id)

    async def get_all(self, *, kind: Optional[str] = None) -> "list[Block]":
        return await asyncio.to_thread(self.memory.get_all, kind=kind)

    async def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        return await asyncio.to_thread(self.memory.delete, block_id, cascade=cascade)

    async def reindex(self) -> int:
        return await asyncio.to_thread(self.memory.reindex)

    async def stats(self) -> "StoreStats":
        return await asyncio.to_thread(self.memory.stats)

    async def verify(self, block_id: str, *, samples: int = 50, cross_process: bool = True) -> "VerifyReport":
        return await asyncio.to_thread(self.memory.verify, block_id, samples=samples,
                                       cross_process=cross_process)
