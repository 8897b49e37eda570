"""A warm interpreter that runs docs snippets as ``__main__``, one after the other, for tests/test_docs.py.

Why: each ``python snippet.py`` spent most of its ~10 s importing torch, sentence-transformers and
graftmem before doing a few seconds of work. This process imports them once and then, per request,
runs a script as ``python script.py`` would: a fresh ``__main__`` globals dict (runpy), ``sys.argv``
and ``sys.path[0]`` set for the script, the request's cwd and environment (GRAFTMEM_HOME in the
test's tmp dir), stdin on /dev/null, file descriptors 1 and 2 pointed at capture files (so native
output, llama.cpp's included, lands where it would in a real process), the exit status as a real
process would give it (``SystemExit`` honoured, an uncaught exception prints its traceback and is 1).

Nothing of one snippet may reach the next: after each run the non-daemon threads it started are
joined and the thread pools it never shut down are stopped (as interpreter shutdown does), every Memory, engine, store or server it left open is closed,
the per-process caches of graftmem that a fresh process would start without are emptied, and cwd,
environment, sys.argv/sys.path/std streams, logging and warnings are restored. The one thing shared on
purpose is the loaded model weights (``graftmem.core.engine._LoadedModel``: this process holds one
default engine, so a snippet's ``Memory()`` reuses the weights instead of loading them); no context,
KV cache, store or Memory is shared. If what a snippet left cannot be cleaned (an engine that is
unreachable but still holds the model, a thread still running), the runner says so and exits after
answering, and the client starts a fresh one for the next snippet.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout (both on private
copies of the descriptors: the snippets' fds 0, 1, 2 are never the protocol's). The client side is
`SnippetRunner`; start the server with ``python -m tests.snippet_runner``.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

#: thread name prefixes of process-wide daemons that a fresh process also keeps for its whole life:
#: tqdm's progress-bar monitor (a daemon, started by the first bar; it only watches bars)
_PROCESS_THREADS = ("tqdm_monitor",)


# ----------------------------------------------------------------------------------------- server side
def _open_resources(before: set[int]) -> list[tuple[Any, Callable[[Any], bool]]]:
    """graftmem objects not in ``before`` that are still open, reachable or not yet collected, with
    their is-open test, in the order they must be closed: servers, memories, engines, stores."""
    import sqlite3

    if "graftmem" not in sys.modules:  # nothing of graftmem was ever imported here
        return []
    from graftmem import Memory
    from graftmem.core.engine import Engine
    from graftmem.server.blocks import BlockServer
    from graftmem.server.runner import ServerThread
    from graftmem.store.local import Store

    def db_open(store: Store) -> bool:
        try:
            store._db.total_changes  # noqa: B018 - raises once the connection is closed
            return True
        except sqlite3.ProgrammingError:
            return False

    is_open: dict[type, Callable[[Any], bool]] = {
        BlockServer: lambda o: not o._server._closed, ServerThread: lambda o: not o._closed,
        Memory: lambda o: not o._closed, Engine: lambda o: not o._closed, Store: db_open}
    found: dict[type, list[Any]] = {kind: [] for kind in is_open}
    for obj in _graftmem_objects():
        if id(obj) in before:
            continue
        mro = type(obj).__mro__
        for kind in is_open:
            if kind in mro:
                if is_open[kind](obj):
                    found[kind].append(obj)
                break
    return [(o, is_open[kind]) for kind, objs in found.items() for o in objs]


def _graftmem_objects() -> list[Any]:
    """The graftmem objects alive now (held, so that no id among them is reused while they are compared)."""
    import gc

    def ours(o: Any) -> bool:
        mod = getattr(type(o), "__module__", None)
        return isinstance(mod, str) and mod.startswith("graftmem")

    return [o for o in gc.get_objects() if ours(o)]


def _model_refs() -> int:
    if "graftmem.core.engine" not in sys.modules:
        return 0
    from graftmem.core.engine import _LoadedModel

    with _LoadedModel._lock:
        return sum(m.refs for m in _LoadedModel._open.values())


def _forget_process_caches() -> None:
    """Empty graftmem's per-process caches that a new process starts without (the loaded weights stay)."""
    if "graftmem" not in sys.modules:
        return
    from graftmem.memory import checks
    from graftmem.store import chain, verified

    with verified._lock:
        verified._seen.clear()  # file versions whose bytes passed the BLAKE3 check in this process
    with verified._pool_lock:
        pool, verified._pool = verified._pool, None  # the read pool: made again on first use
    if pool is not None:
        pool.shutdown(wait=True)
    chain._PLACING.clear()
    checks.network_isolation.cache_clear()


def _stop_pool_workers(threads: set[Any]) -> None:
    """Stop the ThreadPoolExecutor workers among ``threads`` and join them, as the interpreter's exit
    hook of concurrent.futures does for a script that never shut its pool down (their work queued
    before is done first)."""
    from concurrent.futures import thread as cf_thread

    workers = {t: q for t, q in list(cf_thread._threads_queues.items()) if t in threads}
    if not workers:
        return
    cf_thread._shutdown = True  # what the exit hook sets: an idle worker woken by None returns
    try:
        for q in workers.values():
            q.put(None)
        for t in workers:
            t.join()
    finally:
        cf_thread._shutdown = False


def _run_one(req: dict[str, Any], held_ids: set[int], baseline_refs: int) -> dict[str, Any]:
    import gc
    import logging
    import runpy
    import threading
    import traceback
    import warnings
    from concurrent.futures import thread as cf_thread

    script = str(req["script"])
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    root = logging.getLogger()
    saved_log = (list(root.handlers), root.level, logging.root.manager.disable)
    saved_warn = list(warnings.filters)
    threads_before = set(threading.enumerate())

    sys.stdout.flush()
    sys.stderr.flush()
    out_fd = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err_fd = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    rc = 0
    g: dict[str, Any] = {}
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = [script]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python script.py` puts first
        try:
            g = runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # as the interpreter turns it into an exit status
            code = exc.code
            if code is None:
                rc = 0
            elif isinstance(code, int):
                rc = code
            else:
                print(code, file=sys.stderr)
                rc = 1
        except BaseException:  # noqa: BLE001 - an uncaught exception: traceback on stderr, status 1
            traceback.print_exc()
            rc = 1
        # interpreter shutdown joins the non-daemon threads the script started (thread pools' workers
        # are told to stop first, below, as concurrent.futures' exit hook does)
        for t in set(threading.enumerate()) - threads_before:
            if not t.daemon and t not in cf_thread._threads_queues:
                t.join()
    finally:
        with_open = []
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a snippet may have closed them
            pass
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        # close what the snippet left open (reachable from its globals or elsewhere), then forget it all
        for obj, still_open in _open_resources(held_ids):
            if not still_open(obj):  # closed with its owner (a Memory's engine and store)
                continue
            with_open.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - reported below, the runner is recycled
                with_open.append(f"  close failed: {exc!r}")
        g.clear()
        del g
        gc.collect()
        _forget_process_caches()
        _stop_pool_workers(set(threading.enumerate()) - threads_before)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        root.handlers[:] = saved_log[0]
        root.setLevel(saved_log[1])
        logging.disable(saved_log[2])
        warnings.filters[:] = saved_warn
        mutated = getattr(warnings, "_filters_mutated", None)  # the filter cache (CPython <= 3.12)
        if mutated is not None:
            mutated()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(_QUIET_FD, 1)
        os.dup2(_LOG_FD, 2)
    left_threads = sorted(t.name for t in set(threading.enumerate()) - threads_before
                          if t.is_alive() and not t.name.startswith(_PROCESS_THREADS))
    refs = _model_refs()
    dirty = []
    if left_threads:
        dirty.append(f"threads still running: {left_threads}")
    if refs != baseline_refs:
        dirty.append(f"{refs - baseline_refs} engine(s) unreachable but still holding a model")
    if any("close failed" in s for s in with_open):
        dirty.append("a resource could not be closed")
    return {"rc": rc, "closed": with_open, "dirty": dirty}


_QUIET_FD = -1
_LOG_FD = -1


def main(warm: bool = True) -> None:
    """Serve requests until stdin closes. Pre-imports what every snippet imports, holds one default
    engine (the shared weights), then answers ``{"ready": ...}``. ``warm=False`` (``--cold``) skips
    both: the same machinery in a process that starts in a fraction of a second, for the tests of the
    runner's own crash and timeout handling."""
    global _QUIET_FD, _LOG_FD
    import faulthandler

    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    _QUIET_FD = os.open(os.devnull, os.O_WRONLY)
    _LOG_FD = os.dup(2)
    devnull_in = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull_in, 0)
    os.close(devnull_in)
    os.dup2(_QUIET_FD, 1)
    faulthandler.enable()  # fd 2: a native crash during a snippet lands in that snippet's stderr

    held = None
    if warm:
        import importlib

        for name in ("graftmem", "graftmem.testing", "sentence_transformers"):  # what costs each snippet seconds
            importlib.import_module(name)
        from graftmem import Engine

        held = Engine()  # the default model: snippets' Memory() share its weights (_LoadedModel), not its context
    held_objs = _graftmem_objects()  # the runner's own (its engine): kept referenced, so their ids stay theirs
    held_ids = {id(o) for o in held_objs}
    baseline_refs = _model_refs()
    proto_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    proto_out.flush()
    try:
        for line in proto_in:
            if not line.strip():
                continue
            ans = _run_one(json.loads(line), held_ids, baseline_refs)
            proto_out.write(json.dumps(ans) + "\n")
            proto_out.flush()
            if ans["dirty"]:
                break  # a fresh runner for the next snippet
    finally:
        if held is not None:
            held.close()


# ----------------------------------------------------------------------------------------- client side
class SnippetRunner:
    """The test-side handle on one warm runner process, started on first use and restarted after a
    crash, a timeout or a snippet that left something the runner could not clean."""

    def __init__(self, *, warm: bool = True, start_timeout: float = 600) -> None:
        self.warm, self.start_timeout = warm, start_timeout
        self.proc: Optional[subprocess.Popen[str]] = None
        self.dir = Path(tempfile.mkdtemp(prefix="graftmem-snippets-"))
        self.starts = 0
        self.runs = 0
        self._buf = b""

    # the runner's own log (its stderr outside snippets): shown when it fails to start or dies
    @property
    def log_path(self) -> Path:
        return self.dir / f"runner-{self.starts}.log"

    def _start(self) -> None:
        self.starts += 1
        self._buf = b""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "w") as log:
            cmd = [sys.executable, "-m", "tests.snippet_runner"] + ([] if self.warm else ["--cold"])
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, start_new_session=True)
        ans = self._answer(self.start_timeout)
        if not ans or "ready" not in ans:
            self.stop()
            raise AssertionError(f"the snippet runner did not start: {self.log_path.read_text()[-3000:]}")

    def _answer(self, timeout: float) -> Optional[dict[str, Any]]:
        """The next JSON line from the runner; None when nothing came within ``timeout``, ``{}`` when
        the runner closed its end (it is exiting)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return {}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        """Kill the runner and whatever it started (its own process group), and reap it."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    def close(self, *, keep_dir: bool = False) -> None:
        """End the runner (closing its stdin: it closes its engine and exits) and, unless ``keep_dir``,
        remove its capture files."""
        if self.proc is not None and self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # end of requests: the runner closes its engine and exits
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.stop()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, script: Path, *, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
        """Run ``script`` as ``python script`` would, in ``cwd`` with ``env``: the exit status and the
        captured stdout and stderr. A runner that dies mid-snippet gives its death as the status (a
        negative signal number, as subprocess does); a snippet over ``timeout`` fails the test with
        what it printed so far. Either way the next call gets a fresh runner."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.runs += 1
        out, err = self.dir / f"{self.runs}.stdout", self.dir / f"{self.runs}.stderr"
        req = {"script": str(script), "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ans = self._answer(timeout)

        def read(p: Path) -> str:
            return p.read_text(encoding="utf-8", errors="replace") if p.exists() else ""

        args = [sys.executable, str(script)]
        if not ans:
            status = self.proc.wait() if ans == {} else None  # {}: it closed its end, it is exiting
            self.stop()
            if status is None:  # a hang: what it printed so far says where
                raise AssertionError(f"{script} did not finish within {timeout:.0f} s (runner killed)\n"
                                     f"--- stdout\n{read(out)[-3000:]}\n--- stderr\n{read(err)[-3000:]}")
            return subprocess.CompletedProcess(args, status or -1, read(out),
                                               read(err) + f"\n[the snippet runner died: status {status}]")
        if ans["dirty"]:  # it exits after this answer; reap it so the next run starts a fresh one
            self.close(keep_dir=True)
        result = subprocess.CompletedProcess(args, ans["rc"], read(out), read(err))
        result.closed_after = ans["closed"]  # type: ignore[attr-defined]
        result.dirty = ans["dirty"]  # type: ignore[attr-defined]
        return result


    @property
    def pid(self) -> Optional[int]:
        """The runner process now serving (None before the first run or after a kill)."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


if __name__ == "__main__":
    main(warm="--cold" not in sys.argv[1:])
