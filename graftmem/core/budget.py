"""A time budget for Python work that data controls (a chat template's render, its tokenization): past
the deadline the work is interrupted where it runs, and the thread is free again.

Why not a subprocess: a render is a few milliseconds of Python over the request's messages; a
process per render (or a pool fed the messages over a pipe) costs more than the render itself
(measured in docs/security.md: spawning a renderer ~0.35 s, a round-trip to a warm one ~1 ms
of pickling for a 30k-token conversation) and the template, the tokenizer and the engine's vocabulary
would have to live there too. Why not a check inside the template's loops: a looping template needs no
hook of ours (``{% for i in range(99999) %}{% for j in range(99999) %}`` calls nothing), and a trace
function slows every render. Instead a timer raises `Overrun` *in the working thread*
(``PyThreadState_SetAsyncExc``: the exception lands at the thread's next bytecode), so a template that
loops forever stops within the budget and leaves nothing spinning. Work inside one C call (a huge
string operation) is not interrupted until the call returns: the template sandbox bounds those
(`graftmem.core.template`).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Callable, Iterator, Optional, TypeVar

__all__ = ["Overrun", "within", "deadline", "shielded"]

_local = threading.local()


def deadline() -> Optional[float]:
    """When (``time.monotonic()``) the budget of the `within` this thread runs in ends; None outside one.
    Work that waits outside Python (a pipe to a render process: `graftmem.core.renderpool`) waits no
    longer than this, since an interrupt cannot land while a C call blocks."""
    return getattr(_local, "deadline", None)

T = TypeVar("T")


class Overrun(Exception):
    """The work ran past its time budget and was interrupted (raised in the working thread)."""


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` in this thread, interrupted with `Overrun` if it runs longer than ``seconds`` (`deadline`
    tells work inside it when that is).

    The interrupt can only land while ``fn`` runs: the timer fires under a lock that the end of ``fn``
    takes too, and an interrupt already fired is waited for here before returning, so it never
    escapes into whatever this thread runs next (a worker thread goes back to its pool). Work that
    caught the interrupt and carried on is refused all the same: its result is not trusted."""
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False, "landed": False, "shield": 0, "missed": False, "lock": lock}

    class Stop(Overrun):
        def __init__(self, *args: object) -> None:  # runs where the interrupt lands
            state["landed"] = True
            super().__init__(*args)

    def fire() -> None:
        with lock:
            if state["done"]:
                return
            if state["shield"]:  # in a `shielded` block: raised where it ends
                state["missed"] = True
                return
            state["fired"] = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(Stop))

    message = f"the work took longer than its {seconds:g} s budget and was stopped"
    outer, outer_state = deadline(), getattr(_local, "state", None)
    _local.state = state
    _local.deadline = time.monotonic() + seconds if outer is None else min(outer, time.monotonic() + seconds)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            result = fn()
        finally:
            timer.cancel()
            _local.deadline, _local.state = outer, outer_state
            with lock:
                state["done"] = True
            while state["fired"] and not state["landed"]:
                pass  # fired just before the end: the exception is due at the next bytecode
    except Overrun:
        raise Overrun(message) from None
    if state["landed"]:  # interrupted, but the work caught the exception and returned
        raise Overrun(message)
    return result


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A block the budget's interrupt does not land in (cleanup that must finish: killing a render
    process and counting it); an interrupt due meanwhile is raised where the block ends. The block must
    bound its own waits by `deadline`."""
    state = getattr(_local, "state", None)
    if state is None:
        yield
        return
    with state["lock"]:
        state["shield"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["shield"] -= 1
            late = state["shield"] == 0 and state["missed"]
            state["missed"] = state["missed"] and not late
        if late:
            raise Overrun("the work took longer than its budget and was stopped")
