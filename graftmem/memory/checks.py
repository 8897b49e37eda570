"""Verifiers: the external check that decides whether a solution may become a block.

The flywheel (`graftmem.memory.flywheel`) deposits a block only when a verifier says yes, so a
verifier's failure modes matter more than its happy path. The rule here is one-sided: anything other
than a clean "yes" (a wrong answer, an exception, a timeout, a program that crashes, runs out of memory
or prints nothing) is **not verified**. No verifier in this module can turn an error into a yes.

* [`ExactMatch`][graftmem.ExactMatch] compares the candidate answer with a known answer (normalized: case, spaces,
  thousands separators, ``391.0 == 391``). A problem it has no answer for is not verified.
* [`ProgramVerifier`][graftmem.ProgramVerifier] runs the candidate's *method*, a Python program, in a sandboxed
  subprocess ([`run_program()`][graftmem.run_program]) and compares what it prints with the expected answer (when one is
  known) and with the candidate's own answer. It checks the method, not only the number.
* [`CallableVerifier`][graftmem.CallableVerifier] wraps any ``fn(problem, candidate) -> bool``, with a timeout.

The sandbox ([`run_program()`][graftmem.run_program]): ``python -I`` (isolated mode: no user site, no PYTHON* env vars, no
cwd on ``sys.path``) reading the program from stdin, in a fresh temporary directory, with an empty
environment, in its own session (a timeout kills the whole process group), and with resource limits
set by a small wrapper inside the child before the program runs: address space (``RLIMIT_AS``), CPU
seconds (``RLIMIT_CPU``), file size (``RLIMIT_FSIZE``) and open files; a child started as root drops
to ``nobody`` (uid/gid 65534, process count limited) before the program runs, or refuses to run it;
common standard-library modules (math, itertools, collections, fractions, re, ...) are imported first,
since the interpreter's own files may not be readable by ``nobody`` (a Python under ``/root``); any
other import then fails, and the program is not verified. The limits are set by the child
itself rather than by ``preexec_fn`` because ``preexec_fn`` is unsafe in a parent that runs threads
(torch, faiss and llama.cpp all do). Network: when ``unshare -n`` works (root, or ``unshare -rn``
with unprivileged user namespaces) the child runs in a new network namespace with no interface but a
down loopback, so it cannot reach anything; otherwise only an in-process guard replaces
``socket.socket``, which a determined program can get around; [`ProgramRun.network_isolated`][graftmem.ProgramRun.network_isolated]
says which one applied. This is a guard against accidents and sloppy generated code, not a security
boundary for hostile code: run untrusted programs in a container or VM.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from typing import Any, Callable, Mapping, Optional, Protocol, Union, runtime_checkable

from pydantic import BaseModel, ConfigDict

from ..core.errors import ConfigError

__all__ = ["Candidate", "Verdict", "Verifier", "ExactMatch", "ProgramVerifier", "CallableVerifier",
           "ProgramRun", "run_program", "normalize_answer", "network_isolation"]

log = logging.getLogger("graftmem")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Candidate(_Strict):
    """A proposed solution: the answer and, when there is one, the method as a Python program that
    prints the answer."""

    answer: Optional[str]
    program: Optional[str] = None


class Verdict(_Strict):
    """A verifier's decision. ``ok`` is True only for a clean yes; ``reason`` says why either way."""

    ok: bool
    reason: str
    verifier: str
    ms: float = 0.0


@runtime_checkable
class Verifier(Protocol):
    """Decides whether ``candidate`` solves ``problem``. Return a [`Verdict`][graftmem.Verdict] (or a bool);
    raising is allowed and counts as *not verified*. ``name`` is recorded in deposited blocks."""

    name: str

    def check(self, problem: str, candidate: Candidate) -> "Verdict | bool":
        ...


# ---------------------------------------------------------------------------------- normalization
_NUM = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?$")


def normalize_answer(answer: Optional[str]) -> Optional[str]:
    """A canonical form for comparing answers: trimmed, case-folded, inner spaces collapsed, a final
    period dropped; numbers lose thousands separators and a zero fraction (``"1,024.0"`` -> ``"1024"``).
    None and blank answers stay None, so they never match anything."""
    if answer is None:
        return None
    s = " ".join(str(answer).strip().split()).casefold().rstrip(".").strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1].strip()
    if not s:
        return None
    if _NUM.match(s):
        s = s.replace(",", "")
        try:
            v = float(s)
        except ValueError:
            return s
        if math.isfinite(v) and v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return repr(v)
    return s


def _verdict(ok: bool, reason: str, name: str, t0: float) -> Verdict:
    return Verdict(ok=ok, reason=reason, verifier=name, ms=(time.perf_counter() - t0) * 1e3)


# ---------------------------------------------------------------------------------- exact match
class ExactMatch:
    """Compare with a known answer. ``answers`` maps problems to answers (looked up by the problem's
    normalized text, see `normalize_task()`) or is a function returning the
    answer for a problem (None: unknown). An unknown problem is *not verified*."""

    def __init__(self, answers: Union[Mapping[str, Any], Callable[[str], Any]], *, name: str = "exact-match") -> None:
        from .router import normalize_task

        self.name = name
        self._norm = normalize_task
        if callable(answers):
            self._lookup: Callable[[str], Any] = answers
        else:
            table = {normalize_task(k): v for k, v in answers.items()}
            self._lookup = lambda p: table.get(normalize_task(p))

    def expected(self, problem: str) -> Optional[str]:
        v = self._lookup(problem)
        return None if v is None else str(v)

    def check(self, problem: str, candidate: Candidate) -> Verdict:
        t0 = time.perf_counter()
        want = normalize_answer(self.expected(problem))
        if want is None:
            return _verdict(False, "no known answer for this problem", self.name, t0)
        got = normalize_answer(candidate.answer)
        if got is None:
            return _verdict(False, "the candidate has no answer", self.name, t0)
        if got == want:
            return _verdict(True, f"answer {got!r} matches", self.name, t0)
        return _verdict(False, f"answer {got!r} != expected {want!r}", self.name, t0)


# ---------------------------------------------------------------------------------- sandbox
class ProgramRun(_Strict):
    """What a sandboxed program did."""

    ok: bool                      #: exited 0 within the limits
    stdout: str
    stderr: str
    returncode: Optional[int]
    timed_out: bool
    ms: float
    network_isolated: bool        #: ran in a fresh network namespace (else only the socket guard)

    @property
    def answer(self) -> Optional[str]:
        """The last non-empty line printed, the convention for a program's answer."""
        lines = [ln.strip() for ln in self.stdout.splitlines() if ln.strip()]
        return lines[-1] if lines else None


# Runs inside the child before the program: limits first, then a socket guard, then the program.
_WRAPPER = r"""
import resource, sys
def _lim(kind, v):
    try:
        resource.setrlimit(kind, (v, v))
    except (ValueError, OSError):
        pass
_lim(resource.RLIMIT_AS, {mem})
_lim(resource.RLIMIT_CPU, {cpu})
_lim(resource.RLIMIT_FSIZE, {fsize})
_lim(resource.RLIMIT_NOFILE, 64)
_lim(resource.RLIMIT_CORE, 0)
import os
# modules a generated program may import, loaded while the interpreter's files are still readable
# (after dropping to nobody a Python installed under /root could not import anything new)
for _m in ("math", "cmath", "itertools", "functools", "collections", "fractions", "decimal", "re", "string",
           "statistics", "operator", "heapq", "bisect", "datetime", "json", "random", "socket"):
    try:
        __import__(_m)
    except ImportError:
        pass
if os.getuid() == 0:  # never run generated code as root: drop to nobody
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError:
        sys.stderr.write("graftmem sandbox: could not drop root privileges\n")
        sys.exit(97)
    _lim(resource.RLIMIT_NPROC, 64)
del os
import socket as _s
class _NoNet(_s.socket):
    def __init__(self, family=-1, *a, **k):
        if family in (-1, _s.AF_INET, _s.AF_INET6):
            raise PermissionError("network access is disabled in the graftmem sandbox")
        super().__init__(family, *a, **k)
_s.socket = _NoNet
_s.create_connection = lambda *a, **k: (_ for _ in ()).throw(PermissionError("network access is disabled in the graftmem sandbox"))
del _s, _NoNet, _lim, resource
_src = sys.stdin.read()
sys.stdin = open("/dev/null")
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile(_src, "<program>", "exec"), _g)
"""


@lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The command prefix that puts a child in a new network namespace, or () when none works here.

    Probed once per process: ``unshare -n`` (needs CAP_SYS_ADMIN, e.g. root), then ``unshare -rn``
    (unprivileged user namespaces)."""
    exe = shutil.which("unshare")
    if exe is None:
        log.warning("sandbox: `unshare` not found; programs run with only an in-process network guard")
        return ()
    for prefix in ((exe, "-n"), (exe, "-rn")):
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    log.warning("sandbox: cannot create a network namespace (not root, no user namespaces); programs run "
                "with only an in-process network guard")
    return ()


def run_program(source: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 1 << 16,
                isolate_network: bool = True) -> ProgramRun:
    """Run ``source`` with ``python -I`` in a sandboxed subprocess (see the module docstring).

    A timeout kills the process group and returns ``timed_out=True, ok=False``; output beyond
    ``max_output`` characters is cut. Never raises for anything the program does.
    """
    if timeout_s <= 0 or memory_mb < 32:
        raise ConfigError("timeout_s must be > 0 and memory_mb at least 32")
    prefix = network_isolation() if isolate_network else ()
    wrapper = _WRAPPER.format(mem=memory_mb << 20, cpu=max(1, math.ceil(timeout_s)) + 1, fsize=1 << 20)
    cmd = [*prefix, sys.executable, "-I", "-c", wrapper]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="graftmem-sandbox-") as cwd:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, env=env, start_new_session=True, text=True, errors="replace")
        except OSError as exc:
            return ProgramRun(ok=False, stdout="", stderr=f"could not start the sandbox: {exc}", returncode=None,
                              timed_out=False, ms=(time.perf_counter() - t0) * 1e3, network_isolated=False)
        timed_out = False
        try:
            out, err = proc.communicate(source, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            out, err = proc.communicate()
    ms = (time.perf_counter() - t0) * 1e3
    rc = proc.returncode
    return ProgramRun(ok=(rc == 0 and not timed_out), stdout=(out or "")[:max_output], stderr=(err or "")[-max_output:],
                      returncode=rc, timed_out=timed_out, ms=ms, network_isolated=bool(prefix))


# ---------------------------------------------------------------------------------- program verifier
class ProgramVerifier:
    """Run the candidate's program in the sandbox; verified when it exits cleanly and its printed
    answer equals the expected answer (if ``expected`` knows one) and the candidate's own answer.

    ``expected``: like [`ExactMatch`][graftmem.ExactMatch]'s ``answers`` (a mapping or a function), or None to check
    only that the method reproduces the claimed answer. A candidate without a program is *not
    verified*: this verifier vouches for methods.
    """

    def __init__(self, expected: Union[Mapping[str, Any], Callable[[str], Any], None] = None, *,
                 timeout_s: float = 5.0, memory_mb: int = 512, name: str = "program") -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._expected = ExactMatch(expected) if expected is not None else None

    def check(self, problem: str, candidate: Candidate) -> Verdict:
        t0 = time.perf_counter()
        if not candidate.program or not candidate.program.strip():
            return _verdict(False, "no program to run", self.name, t0)
        run = run_program(candidate.program, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if run.timed_out:
            return _verdict(False, f"program timed out after {self.timeout_s:g} s", self.name, t0)
        if not run.ok:
            last = (run.stderr.strip().splitlines() or ["(no stderr)"])[-1][:200]
            return _verdict(False, f"program failed (exit {run.returncode}): {last}", self.name, t0)
        printed = normalize_answer(run.answer)
        if printed is None:
            return _verdict(False, "program printed nothing", self.name, t0)
        if candidate.answer is not None and normalize_answer(candidate.answer) != printed:
            return _verdict(False, f"program prints {printed!r}, the candidate says "
                                   f"{normalize_answer(candidate.answer)!r}", self.name, t0)
        if self._expected is not None:
            want = normalize_answer(self._expected.expected(problem))
            if want is None:
                return _verdict(False, "no known answer for this problem", self.name, t0)
            if printed != want:
                return _verdict(False, f"program prints {printed!r}, expected {want!r}", self.name, t0)
        return _verdict(True, f"program prints {printed!r}", self.name, t0)


# ---------------------------------------------------------------------------------- callable verifier
def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (True, result) or (False, reason) on exception or timeout.

    A thread cannot be killed: on timeout it is abandoned (it keeps running until it returns), which
    is why [`ProgramVerifier`][graftmem.ProgramVerifier] uses a subprocess instead."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - any failure is "not verified"
            box["error"] = exc

    th = threading.Thread(target=target, name="graftmem-verifier", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return False, f"timed out after {timeout_s:g} s"
    if "error" in box:
        exc = box["error"]
        return False, f"raised {type(exc).__name__}: {exc}"
    return True, box.get("value")


class CallableVerifier:
    """Any ``fn(problem, candidate) -> bool | Verdict`` as a verifier. Only ``True`` (or a Verdict
    with ``ok=True``) verifies; an exception, a timeout or any other return value does not."""

    def __init__(self, fn: Callable[[str, Candidate], Any], *, name: Optional[str] = None,
                 timeout_s: float = 30.0) -> None:
        if not callable(fn):
            raise ConfigError("CallableVerifier needs a callable fn(problem, candidate) -> bool")
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", "callable"))
        self.timeout_s = timeout_s

    def check(self, problem: str, candidate: Candidate) -> Verdict:
        t0 = time.perf_counter()
        done, value = call_with_timeout(lambda: self.fn(problem, candidate), self.timeout_s)
        if not done:
            return _verdict(False, f"verifier {value}", self.name, t0)
        if isinstance(value, Verdict):
            return value.model_copy(update={"ok": value.ok is True})
        if value is True:
            return _verdict(True, "callable returned True", self.name, t0)
        return _verdict(False, f"callable returned {value!r}", self.name, t0)
