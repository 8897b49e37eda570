"""The facade: :class:`Memory` (the object an application holds) and :class:`AsyncMemory` (the same
verbs as coroutines). It owns the resources and composes the layers below; nothing below imports it."""

from .aio import AsyncMemory
from .memory import Memory

__all__ = ["AsyncMemory", "Memory"]
