"""AsyncMemory: the [`Memory`][graftmem.Memory] verbs as coroutines, for asyncio agents.

Each call runs the synchronous method in a worker thread (``asyncio.to_thread``), so the event loop
keeps serving while llama.cpp prefills or decodes. That is safe because ``Memory`` is: the llama
context is serialized by the engine's lock, the store by its own lock and SQLite, the router by its
lock (the task embedding runs outside it). Calls that need the context queue behind each other;
routing and store reads overlap with them.

The coroutines are generated from [`Memory`][graftmem.Memory]'s public methods (same names, signatures and
docstrings), so a verb added to ``Memory`` is an ``await``-able verb here without a hand-written copy;
a test checks the parity.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from typing import Any, Callable, Optional

from ..core.blocks import Exactness, Fingerprint
from .memory import Memory
from .stream import AsyncAnswerStream

__all__ = ["AsyncMemory"]

#: Memory methods that are not offered as coroutines: ``close`` is ``aclose`` here
_NOT_ASYNC = {"close"}


class AsyncMemory:
    """An asyncio facade over one [`Memory`][graftmem.Memory] (constructed with the same arguments, or given one).

    ```python
    async with AsyncMemory() as mem:
        await mem.learn(manual, name="refunds", when_to_use="refund requests", chat=True)
        r = await mem.recall("Customer NW-20417 wants a refund")
    ```

    Every public method of [`Memory`][graftmem.Memory] (``learn``, ``recall``, ``search``, ``ask``, ``learn_document``,
    ``export``, ``pull``, ...) is available as a coroutine with the same signature.
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
        """Close the wrapped Memory (only when this object created it)."""
        if self._owns:
            await asyncio.to_thread(self.memory.close)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.memory.fingerprint

    @property
    def exactness(self) -> Exactness:
        return self.memory.exactness


def _coroutine(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def call(self: AsyncMemory, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(getattr(self.memory, name), *args, **kwargs)

    return call


def _streaming(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``*_stream`` verbs: the stream starts at once (arguments checked here), read with ``async for``."""
    @functools.wraps(method)
    def call(self: AsyncMemory, *args: Any, **kwargs: Any) -> AsyncAnswerStream:
        return AsyncAnswerStream(getattr(self.memory, name)(*args, **kwargs))

    return call


def async_verbs() -> dict[str, Callable[..., Any]]:
    """The public methods of [`Memory`][graftmem.Memory] that [`AsyncMemory`][graftmem.AsyncMemory] offers as coroutines."""
    return {name: fn for name, fn in inspect.getmembers(Memory, inspect.isfunction)
            if not name.startswith("_") and name not in _NOT_ASYNC}


for _name, _fn in async_verbs().items():
    setattr(AsyncMemory, _name, (_streaming if _name.endswith("_stream") else _coroutine)(_name, _fn))
