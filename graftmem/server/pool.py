"""A pool of engine contexts with a bounded wait queue.

Each request holds one engine (one llama.cpp context) from the prefill to its last token, inside an
[`Engine.session()`][graftmem.Engine.session], so no request sees another's state. When every engine is busy a request waits
in a queue of at most ``max_queue``; one more is refused at once with 429 (back-pressure: the client
retries later, rather than the server piling up sockets). A request whose client went away gives its
engine back when its decode loop sees the cancellation (after at most one token).

All methods but `run` run on the event loop's thread, which is what makes the counters safe without a
lock (a worker thread hands its engine back with ``loop.call_soon_threadsafe``).

Each engine computes on one thread of its own for the pool's whole life (`EnginePool.run`), never on a
thread per request: llama.cpp's CPU backend (built with OpenMP, as llama-cpp-python's wheel is) keeps its
team of worker threads per *calling* thread, and the first decode on a thread that never decoded builds
that team. Measured (SmolLM2, 2 threads, a one-token decode over 2,560 cells, 15 pairs): 29 ms on a
thread that decoded before, 53 ms on a new thread; a thread per request paid those 24 ms on every
request's first call, which is most of a short turn's time to first token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

from .http import HTTPError

if TYPE_CHECKING:
    from ..core.engine import Engine

__all__ = ["EnginePool", "EngineThread", "pool_engines"]

log = logging.getLogger("graftmem")

T = TypeVar("T")


class EngineThread:
    """One long-lived daemon thread that runs what is submitted to it, in order (the engine's own thread:
    see the module docstring). A daemon, as the request threads it replaces were: a process that exits
    while an answer decodes does not wait for it (`concurrent.futures.ThreadPoolExecutor` joins its
    workers at exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.SimpleQueue[Optional[tuple[Future[Any], Callable[[], Any]]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """``fn()`` on this thread, after what was submitted before; its result (or exception) in the future."""
        fut: Future[T] = Future()
        self._jobs.put((fut, fn))
        return fut

    def close(self) -> None:
        """The thread ends once what was submitted before has run."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)


def pool_engines(first: "Engine", n: int) -> list["Engine"]:
    """``first`` and ``n - 1`` siblings on its loaded model (one copy of the weights for the pool, see
    [`Engine.sibling()`][graftmem.Engine.sibling]), each with its own context, for `EnginePool`.

    Threads: where the configuration leaves ``n_threads`` unset, each engine's calls of two tokens or
    more (prefill) get `threads_per_engine` (``max(1, cores // n)``): N requests prefill at once, and N
    contexts of ``cores`` threads each would make every step wait on threads that are not running. Its
    one-token calls (decoding) keep the configured count: their bytes depend on it (llama.cpp's flash
    attention splits a one-token call by thread: `Engine.one_token_calls_split`), and a request's answer
    must not depend on how many engines serve it (measured: with one-token calls sized too, 8 of 40
    answers of 8 concurrent agents differed from the same requests served alone; bench/concurrency.py).
    The fingerprint, hence every block, stays the same. An explicit ``n_threads`` is kept, with a warning
    when the pool asks for more threads than there are cores. The caller closes the siblings.
    """
    from ..core.engine import threads_per_engine, usable_cores

    if n < 1:
        raise ValueError(f"a pool needs at least one engine, not {n}")
    cores = usable_cores()
    engines = [first]
    try:
        engines += [first.sibling() for _ in range(n - 1)]
        configured = first.config.n_threads
        sized = configured is None
        batch = threads_per_engine(n, cores) if sized else first.n_threads_batch
        for e in engines:  # every engine's one-token calls on the first's count (the same bytes), prefill on ``batch``
            if (e.n_threads, e.n_threads_batch) != (first.n_threads, batch):
                e.set_threads(first.n_threads, batch)
        if configured is None:
            threads = batch
            how = f"for prefill, sized to the cores (n_threads unset); {first.n_threads} for one-token calls"
        else:
            threads = configured
            how = "as configured"
            if n * threads > cores:
                log.warning("serve: %d engines x %d threads exceed the %d usable cores: concurrent decodes will "
                            "wait on each other (leave n_threads unset to size it per engine)", n, threads, cores)
    except BaseException:
        for e in engines[1:]:
            e.close()
        raise
    log.info("serve: %d engine context(s) on one loaded model (%s), %d thread(s) each %s, %d usable core(s)",
             n, first.model_path.name, threads, how, cores)
    return engines


class EnginePool:
    """``engines`` (same model and settings) shared by requests; ``max_queue`` requests may wait."""

    def __init__(self, engines: Sequence["Engine"], *, max_queue: int = 16, background_share: float = 0.25) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        digests = {e.fingerprint.digest() for e in engines}
        if len(digests) != 1:
            raise ValueError("the engines of a pool must share one fingerprint (same model and settings)")
        self.engines = list(engines)
        self.max_queue = max_queue
        self._free: deque["Engine"] = deque(engines)
        self._waiters: deque[asyncio.Future["Engine"]] = deque()
        #: waiters of background work (embeddings): an engine goes to them only when no request waits
        self._background: deque[asyncio.Future["Engine"]] = deque()
        #: the most of the engines' time background work takes while requests come in (`background_allowed`)
        self.background_share = background_share
        self._bg_next = 0.0  #: when (monotonic) the next background slice may start while requests come in
        self._fg_seen = False  #: a request took an engine since the last background slice started
        self._kick: Optional[asyncio.TimerHandle] = None
        #: notified on every release: `wait_all_free()` (graceful shutdown, tests) waits on it
        self._released = threading.Condition()
        self._threads = {id(e): EngineThread(f"graftmem-engine-{i}") for i, e in enumerate(self.engines)}

    def run(self, engine: "Engine", fn: Callable[[], T]) -> "Future[T]":
        """``fn()`` on ``engine``'s own thread (any thread may call this): whatever computes on an engine
        of the pool (a request, a REST verb, the warm start's graft) runs there, so llama.cpp's thread
        team is built once per engine, not once per request (module docstring)."""
        return self._threads[id(engine)].submit(fn)

    def close(self) -> None:
        """End the engines' threads (after what they run now): the server closes its pool last."""
        for t in self._threads.values():
            t.close()

    @property
    def size(self) -> int:
        return len(self.engines)

    @property
    def in_use(self) -> int:
        return len(self.engines) - len(self._free)

    @property
    def busy(self) -> list["Engine"]:
        """The engines serving a request now (`graftmem.server.fleet.kv_usage`)."""
        return [e for e in self.engines if e not in self._free]

    @property
    def waiting(self) -> int:
        return sum(1 for w in (*self._waiters, *self._background) if not w.done())

    async def acquire(self, prefer: Optional[Callable[["Engine"], tuple[bool, int]]] = None, *,
                      background: bool = False, admitted: bool = False) -> "Engine":
        """An engine for one request; with ``prefer``, the free engine it scores highest
        (`graftmem.server.generate.engine_fit`), the least recently released among equals (the free
        engines are kept in the order they were released).

        ``background``: work that yields to requests (embeddings): it gets a released engine only when no
        request waits, so a flood of it delays a chat turn by one of its slices at most, never by a queue
        of them. ``admitted``: the next slice of work already admitted (no 429 between its slices)."""
        fg_waiting = any(not w.done() for w in self._waiters)
        bg_ahead = background and any(not w.done() for w in self._background)
        if self._free and not fg_waiting and not bg_ahead and                 (not background or self.background_allowed(time.monotonic())):
            self._fg_seen = not background  # a request took an engine / a background slice starts
            if prefer is not None and len(self._free) > 1:
                best = max(self._free, key=prefer)
                self._free.remove(best)
                return best
            return self._free.popleft()
        if self.waiting >= self.max_queue and not admitted:
            raise HTTPError(429, f"the server is busy: {self.size} engine(s) in use and {self.waiting} "
                            "request(s) waiting; retry later", code="queue_full",
                            headers={"Retry-After": "1"})
        fut: asyncio.Future["Engine"] = asyncio.get_running_loop().create_future()
        (self._background if background else self._waiters).append(fut)
        if background and self._free:
            self._wake_background()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed an engine just as the waiter went away
                self.release(fut.result())
            raise

    async def on_engine(self, fn: Callable[["Engine"], T], gone: "Optional[asyncio.Future[None]]" = None,
                        cancel: Optional[threading.Event] = None, *, background: bool = False,
                        admitted: bool = False) -> T:
        """``fn(engine)`` on an engine of the pool, on that engine's thread (`run`), admitted as every
        request is (a 429 when the queue is full). With ``gone`` (done once the client went away,
        `graftmem.server.http.client_gone`): a client that leaves while waiting gives up its place (a
        499), one that leaves while ``fn`` runs sets ``cancel``, which ``fn`` checks to stop early.
        ``background`` / ``admitted``: as `acquire`'s."""
        acquire = asyncio.ensure_future(self.acquire(background=background, admitted=admitted))
        if gone is not None:
            await asyncio.wait((acquire, gone), return_when=asyncio.FIRST_COMPLETED)
            if not acquire.done():
                acquire.cancel()  # an engine handed to the leaving waiter is given back
                raise HTTPError(499, "the client went away", code="client_closed_request")
        engine = await acquire
        t0 = time.monotonic()
        try:
            work = asyncio.wrap_future(self.run(engine, lambda: fn(engine)))
            if gone is not None:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
                if not work.done() and cancel is not None:
                    cancel.set()
            return await work
        finally:
            if background:
                self.background_done(time.monotonic() - t0)
            self.release(engine)

    def background_allowed(self, now: float) -> bool:
        """Whether background work may start a slice now: always when no request took an engine since its
        last slice started (the engines are otherwise idle), else once that slice's time, scaled to
        `background_share`, has passed (a share of 0.25: a 0.2 s slice, then 0.6 s for requests).
        Without it, background work took the engine at every instant no request happened to wait
        (between an agent's turns) and an embeddings flood took most of it: 8 agents' p95 time to first
        token 2.5x (`bench/hostile.py`)."""
        return not self._fg_seen or now >= self._bg_next

    def background_done(self, seconds: float) -> None:
        """A background slice ran ``seconds``: the next one waits its share (`background_allowed`)."""
        share = min(max(self.background_share, 0.01), 1.0)
        self._bg_next = time.monotonic() + seconds * (1.0 / share - 1.0)

    def _wake_background(self) -> None:
        """Hand a free engine to a background waiter once `background_allowed` (a timer until then)."""
        if self._kick is not None or not self._free or not self._background:
            return
        now = time.monotonic()
        if self.background_allowed(now) and not any(not w.done() for w in self._waiters):
            while self._background and self._free:
                fut = self._background.popleft()
                if not fut.done():
                    self._fg_seen = False
                    fut.set_result(self._free.popleft())
                    return
            return

        def kick() -> None:
            self._kick = None
            self._wake_background()

        self._kick = asyncio.get_running_loop().call_later(max(0.001, self._bg_next - now), kick)

    def release(self, engine: "Engine") -> None:
        while self._waiters:  # requests first
            fut = self._waiters.popleft()
            if not fut.done():
                self._fg_seen = True
                fut.set_result(engine)
                return
        if self._background and self.background_allowed(time.monotonic()):  # then background work, in its share
            while self._background:
                fut = self._background.popleft()
                if not fut.done():
                    self._fg_seen = False
                    fut.set_result(engine)
                    return
        with self._released:
            self._free.append(engine)
            self._released.notify_all()
        if self._background:
            self._wake_background()

    def wait_all_free(self, timeout: float = 60.0) -> bool:
        """Wait (from any thread but the event loop's) until no request holds an engine: a request's
        worker may have finished while the loop has yet to hand its engine back (a streamed answer's
        last chunk is sent just before). False if some engine is still held at ``timeout``."""
        with self._released:
            return self._released.wait_for(lambda: len(self._free) == len(self.engines), timeout)
