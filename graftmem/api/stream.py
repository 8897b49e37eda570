"""Streams of answer text: [`Memory.ask_stream()`][graftmem.Memory.ask_stream] and
[`Memory.recall_stream()`][graftmem.Memory.recall_stream], and their asyncio form.

Why a thread: llama.cpp decodes in a blocking call loop that holds the engine's lock; the answer is
computed in a worker thread exactly as `ask`/`recall` compute it (same prefill, same decode loop, same
receipt), and the text reaches the caller through a queue as it becomes final (`AnswerText`: no half
UTF-8 character, nothing that may still become a stop string). Closing the stream early (``close()``,
leaving a ``with`` block, ``break`` in an ``async for`` then ``aclose()``) cancels the decode at the
next token and releases the engine.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable, Iterator, Optional

from ..core.blocks import Recall
from ..memory.answer import OnText

__all__ = ["AnswerStream", "AsyncAnswerStream"]

_END = object()


class AnswerStream(Iterator[str]):
    """The text of one answer as it is decoded. Iterate for the pieces; ``result`` is the whole
    [`Recall`][graftmem.Recall] (text, tokens, block, receipt), available once the answer is complete.

    ```python
    with mem.ask_stream(block.id, "\\nQ: what do I ask first?\\nA:", max_tokens=16) as s:
        for piece in s:
            print(piece, end="", flush=True)
    print(s.result.receipt)
    ```

    An error of the answer (a corrupted block, a closed memory) is raised by the iteration or by
    ``result``. ``"".join(pieces) == result.text``.
    """

    def __init__(self, run: Callable[[OnText], Recall]) -> None:
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._result: Optional[Recall] = None
        self._error: Optional[BaseException] = None
        self._ended = False
        self._thread = threading.Thread(target=self._work, args=(run,), name="graftmem-stream", daemon=True)
        self._thread.start()

    def _work(self, run: Callable[[OnText], Recall]) -> None:
        try:
            self._result = run(self._on_text)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._error = exc
        finally:
            self._queue.put(_END)

    def _on_text(self, delta: str) -> bool:
        self._queue.put(delta)
        return self._cancel.is_set()

    def __iter__(self) -> "AnswerStream":
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._ended = True
            if self._error is not None:
                raise self._error
            raise StopIteration
        assert isinstance(item, str)
        return item

    @property
    def result(self) -> Recall:
        """The complete answer (waits for it). After ``close()`` its ``finish_reason`` is ``cancelled``."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def close(self) -> None:
        """Stop decoding at the next token and wait until the engine is released. Idempotent."""
        self._cancel.set()
        self._thread.join()

    def __enter__(self) -> "AnswerStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAnswerStream:
    """[`AnswerStream`][graftmem.AnswerStream] for asyncio: ``async for piece in stream``,
    ``await stream.result()``, ``await stream.aclose()`` (also ``async with``)."""

    def __init__(self, stream: AnswerStream) -> None:
        self._stream = stream

    def __aiter__(self) -> "AsyncAnswerStream":
        return self

    async def __anext__(self) -> str:
        item = await asyncio.to_thread(next, self._stream, _END)
        if item is _END:
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def result(self) -> Recall:
        return await asyncio.to_thread(lambda: self._stream.result)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._stream.close)

    async def __aenter__(self) -> "AsyncAnswerStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
