"""Chat-template renders in child processes, killed when they overrun their request's budget.

Why processes: a GGUF's template is code the operator did not write, run on text a client did. Run in a
thread of the server (interrupted at its budget by `graftmem.core.budget.within`), a template that loops
on a trigger word held the server's GIL for the whole budget: `bench/hostile.py` measured two clients
sending the trigger beside 8 honest agents at 20x the agents' p95 time to first token, the event loop and
the engines' threads waiting on the GIL behind a loop doing nothing. A child process has its own
interpreter: the loop costs one core of the OS's time, shared fairly, and past the budget the process is
killed (SIGKILL: nothing left spinning) and replaced.

Each worker holds the templates it was sent (by digest) and renders exactly as `ChatTemplate.render`
does in the server's process (the same class, the same sandbox). A render's arguments and text travel
over a pipe: ~0.1-0.3 ms a render for an agent's conversation (measured in docs/security.md); the
server's render cache (`graftmem.server.chat`) keeps most renders of a growing conversation from
being asked again.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from .budget import Overrun, deadline, shielded
from .template import ChatTemplate, TemplateError

__all__ = ["RenderPool"]

log = logging.getLogger("graftmem")


def _serve(conn: Connection) -> None:
    """A worker's loop: ``(template fields, messages, kwargs)`` in, ``(True, text)`` or ``(False, message)`` out.

    At the lowest CPU priority (nice 19): a render is a fraction of a millisecond, but a template that
    loops runs until its budget, and beside the engines' threads (llama.cpp's threads meet at spinning
    barriers) one more busy process on the cores slowed every honest request ~20x (`bench/hostile.py`)."""
    if hasattr(os, "nice"):
        try:
            os.nice(19)
        except OSError:  # a platform that refuses: the budget still bounds the render
            pass
    templates: dict[tuple, ChatTemplate] = {}
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        key, msgs, kwargs = job
        try:
            tpl = templates.get(key)
            if tpl is None:
                source, name, bos, eos, strip_bos, now = key
                tpl = templates[key] = ChatTemplate(source=source, name=name, bos_token=bos, eos_token=eos,
                                                    strip_bos=strip_bos, now=now)
                if len(templates) > 16:
                    templates.pop(next(iter(templates)))
            out: tuple[bool, str] = (True, tpl.render(msgs, **kwargs))
        except TemplateError as exc:
            out = (False, str(exc))
        except Exception as exc:  # noqa: BLE001 - a template's own failure goes back as a refusal
            out = (False, f"chat template {key[1]!r} failed: {exc!r:.300}")
        try:
            conn.send(out)
        except (EOFError, OSError):
            return


class _Worker:
    """One render process: ``python -m graftmem.core.renderpool FD``, a socket pair between the two. Not
    `multiprocessing`'s spawn, which re-imports the parent's main module in the child: a user's script that
    starts a server at its top level, without a ``__main__`` guard, would start one in every worker."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the graftmem this process runs, not another one
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "graftmem.core.renderpool", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # never seen: a killed process is reaped at once
            log.warning("serve: render process %d did not end after SIGKILL", self.pid)
        self.conn.close()


class RenderPool:
    """Up to ``max_workers`` render processes, started as needed (``warm`` of them at once, in the
    background) and reused; `render` waits for a free one within the calling thread's budget."""

    def __init__(self, max_workers: int = 4, warm: int = 1) -> None:
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._busy: dict[int, _Worker] = {}  # by pid: the workers rendering now
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        #: renders killed past their budget (a test and `/metrics`' business)
        self.killed = 0
        if warm:
            threading.Thread(target=self._warm, args=(min(warm, max_workers),), daemon=True,
                             name="graftmem-render-warm").start()

    def _warm(self, n: int) -> None:
        for _ in range(n):
            with self._cond:
                if self._closed or self._count >= self.max_workers:
                    return
                self._count += 1
            try:
                w = _Worker()
            except Exception:  # a render starts its own worker later
                log.exception("serve: could not start a render worker")
                with self._cond:
                    self._count -= 1
                return
            self._give(w)

    def _take(self, until: Optional[float]) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise TemplateError("the server is closing")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.max_workers:
                    self._count += 1
                    break
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    raise Overrun("no render worker became free within the budget")
                self._cond.wait(left)
        try:
            return _Worker()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _give(self, w: _Worker) -> None:
        with self._cond:
            self._busy.pop(w.pid, None)
            if self._closed:
                w.kill()
                self._count -= 1
                return
            self._idle.append(w)
            self._cond.notify()

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._cond:
            self._busy.pop(w.pid, None)
            self._count -= 1
            self._cond.notify()

    def render(self, tpl: ChatTemplate, msgs: list[dict[str, Any]], **kwargs: Any) -> str:
        """``tpl.render(msgs, **kwargs)`` in a worker, within the calling thread's budget (`budget.deadline`:
        past it the worker is killed and `Overrun` raised; no budget: no limit)."""
        until = deadline()
        with shielded():  # the budget is enforced here, by the poll: no interrupt lands mid-exchange
            w = self._take(until)
            with self._cond:
                self._busy[w.pid] = w
            key = (tpl.source, tpl.name, tpl.bos_token, tpl.eos_token, tpl.strip_bos, tpl.now)
            try:
                w.conn.send((key, msgs, kwargs))
                left = None if until is None else max(0.0, until - time.monotonic())
                if not w.conn.poll(left):
                    self.killed += 1
                    log.warning("serve: a chat-template render ran past its budget: its process is killed")
                    self._drop(w)
                    raise Overrun("the render took longer than its budget and its process was killed")
                ok, value = w.conn.recv()
            except (EOFError, OSError) as exc:
                self._drop(w)
                raise TemplateError(f"the render process of chat template {tpl.name!r} died ({exc!r})") from None
            self._give(w)
        if not ok:
            raise TemplateError(value)
        return value

    def busy(self) -> list[int]:
        """The process ids of the workers rendering now."""
        with self._cond:
            return list(self._busy)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()


if __name__ == "__main__":  # a render worker (`_Worker`): serve renders on the socket it was handed
    _serve(Connection(int(sys.argv[1])))
