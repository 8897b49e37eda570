"""The facade: [`Memory`][graftmem.Memory] (the object an application holds), [`AsyncMemory`][graftmem.AsyncMemory] (the same
verbs as coroutines) and [`RemoteMemory`][graftmem.RemoteMemory] (the same verbs over HTTP, against a running
``graftmem serve``). It owns the resources and composes the layers below; nothing below imports it.

Names are imported on first use (PEP 562), as in ``graftmem``: a client of a running server
(`RemoteMemory`, ``graftmem ls --url``) does not load llama.cpp by importing this package."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .aio import AsyncMemory
    from .memory import Memory
    from .remote import RemoteJSON, RemoteMemory
    from .summary import BlockSummary
    from .stream import AnswerStream, AsyncAnswerStream

_LAZY: dict[str, str] = {
    "AnswerStream": ".stream",
    "AsyncAnswerStream": ".stream",
    "AsyncMemory": ".aio",
    "BlockSummary": ".summary",
    "Memory": ".memory",
    "RemoteJSON": ".remote",
    "RemoteMemory": ".remote",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["AnswerStream", "AsyncAnswerStream", "AsyncMemory", "BlockSummary", "Memory", "RemoteJSON", "RemoteMemory"]
