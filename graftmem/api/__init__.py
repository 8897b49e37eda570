"""The facade: [`Memory`][graftmem.Memory] (the object an application holds) and [`AsyncMemory`][graftmem.AsyncMemory] (the same
verbs as coroutines). It owns the resources and composes the layers below; nothing below imports it."""

from .aio import AsyncMemory
from .memory import Memory
from .stream import AnswerStream, AsyncAnswerStream

__all__ = ["AnswerStream", "AsyncAnswerStream", "AsyncMemory", "Memory"]
