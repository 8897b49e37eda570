"""The C++ peer for the benches: llama.cpp's own ``llama-server``, built from the vendored sources.

A performance-minded user who wants KV reuse without Python would run llama-server with
``--slot-save-path`` and ``POST /slots/0?action=save|restore``. To compare against it honestly we build
it from exactly the llama.cpp that our engine runs: the sources vendored in the pinned
llama-cpp-python sdist (same commit, same kernels). The build happens once, into a cache directory
outside the repository (``platformdirs.user_cache_dir("graftmem")/llama-server-<version>``); binaries
are never committed.

    python -m bench.peer            # build (or find) llama-server, print its path and the build time

The build runs at ``nice -n 10`` with ``-j2`` (the bench machines are shared); only the
``llama-server`` target is built, without libcurl (nothing downloads at run time).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import platformdirs

from graftmem.core import environ_without_ours  # llama-server runs with libgomp's default wait

VERSION = "0.3.36"  # the pinned llama-cpp-python (scripts/constraints.txt): same llama.cpp as the engine


class PeerUnavailable(RuntimeError):
    """llama-server could not be built or started; the bench reports it and skips the peer columns."""


def cache_dir(version: str = VERSION) -> Path:
    return Path(platformdirs.user_cache_dir("graftmem")) / f"llama-server-{version}"


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        rc = subprocess.call(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise PeerUnavailable(f"{' '.join(cmd[:3])}... failed with exit code {rc}; see {log}:\n{tail}")


def build(version: str = VERSION, jobs: int = 2) -> Path:
    """Return the path of a llama-server built from llama-cpp-python==version's vendored llama.cpp.

    Built once; later calls find the binary (and its build record) in the cache directory.
    """
    root = cache_dir(version)
    exe = root / "bin" / "llama-server"
    if exe.exists():
        return exe
    root.mkdir(parents=True, exist_ok=True)
    # one build at a time per cache directory: a second bench started meanwhile (another engineer's, or
    # bench/concurrency.py next to bench/serve.py) waits here and finds the binary, instead of running
    # cmake and ninja on the same build tree at once (seen: it interrupted the first build)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        return _build_locked(version, root, exe, jobs)


def _build_locked(version: str, root: Path, exe: Path, jobs: int) -> Path:
    log = root / "build.log"
    t0 = time.time()
    src_dir = root / "src"
    if not src_dir.exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                  f"llama-cpp-python=={version}", "-d", tmp], log)
            sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise PeerUnavailable(f"pip download gave no llama-cpp-python sdist in {tmp}; see {log}")
            with tarfile.open(sdists[0]) as tf:
                tf.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            shutil.move(str(vendored), src_dir)
    bdir = root / "build"
    nice = ["nice", "-n", "10"]
    _run(nice + ["cmake", "-S", str(src_dir), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], log)
    _run(nice + ["cmake", "--build", str(bdir), "--target", "llama-server", "-j", str(jobs)], log)
    built = next((p for p in (bdir / "bin" / "llama-server", bdir / "tools" / "server" / "llama-server")
                  if p.exists()), None)
    if built is None:
        raise PeerUnavailable(f"the build finished but no llama-server binary was found under {bdir}")
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, exe)
    (root / "build.json").write_text(json.dumps({"version": version, "build_s": round(time.time() - t0, 1),
                                                  "jobs": jobs, "exe": str(exe)}, indent=2))
    return exe


def build_record(version: str = VERSION) -> dict:
    p = cache_dir(version) / "build.json"
    return json.loads(p.read_text()) if p.exists() else {}


def weight_buffer_args(extra_bufts: bool) -> list[str]:
    """llama-server's flags for the weight buffers graftmem's engine uses: ``--no-repack`` unless the
    engine runs llama.cpp's extra (repack/AMX) buffer types too, so both sides run the same kernels."""
    return [] if extra_bufts else ["--no-repack"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running llama-server on 127.0.0.1 and a client for the calls the bench times.

    One slot (``-np 1``) so slot 0 is the only one; ``cache_prompt`` on every completion so the
    server reuses the restored cells and evaluates only the new tokens.
    """

    def __init__(self, exe: Path, model: Path, slot_dir: Path, *, n_ctx: int, n_batch: int, n_ubatch: int,
                 threads: int, swa_full: bool, cache_type_k: str = "f16", cache_type_v: str = "f16",
                 startup_s: float = 120.0, extra_bufts: bool = False) -> None:
        self.port = free_port()
        self.slot_dir = slot_dir
        cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch), "-fa", "on", "-t", str(threads),
               "-tb", str(threads), "-np", "1", "--slot-save-path", str(slot_dir), "-ctk", cache_type_k,
               "-ctv", cache_type_v, "--no-warmup",
               # only slot save/restore may reuse state: no RAM prompt cache, no context checkpoints
               "--cache-ram", "0", "--ctx-checkpoints", "0", *weight_buffer_args(extra_bufts)]
        if swa_full:
            cmd.append("--swa-full")
        self.cmd = cmd
        self.log = slot_dir / "server.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=environ_without_ours())
        atexit.register(self.close)  # never leave a server behind, also when the bench is stopped
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600.0)
        wait_ready(self.proc, lambda: self.client.get("/health").status_code == 200, "llama-server", self.log,
                   startup_s, self.close)

    def complete(self, tokens: list[int], *, n_predict: int = 1, n_probs: int = 0) -> dict:
        """A completion of exactly these token ids (no BOS added: the ids carry it), greedy."""
        r = self.client.post("/completion", json={
            "prompt": tokens, "n_predict": n_predict, "cache_prompt": True, "temperature": 0.0,
            "top_k": 1, "samplers": ["top_k"], "n_probs": n_probs, "id_slot": 0,
            "post_sampling_probs": False, "return_tokens": True})
        r.raise_for_status()
        return r.json()

    def slot(self, action: str, filename: str) -> dict:
        r = self.client.post("/slots/0", params={"action": action}, json={"filename": filename})
        r.raise_for_status()
        return r.json()

    def erase(self) -> None:
        r = self.client.post("/slots/0", params={"action": "erase"})
        r.raise_for_status()

    def close(self) -> None:
        self.client.close()
        stop(self.proc, 10)
        self._logf.close()


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], name: str, log: Path, startup_s: float,
               close: Callable[[], None]) -> None:
    """Poll ``ready()`` until it is true; a server that exits or misses ``startup_s`` is closed and
    reported (`PeerUnavailable`, with the end of its log). bench/serve.py starts its servers this way too."""
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise PeerUnavailable(f"{name} exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        if time.monotonic() > deadline:
            close()
            raise PeerUnavailable(f"{name} did not become ready in {startup_s:.0f} s; see {log}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen, wait_s: float) -> None:
    """Terminate a server, killing it if it is still there after ``wait_s`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running(exe: Path, model: Path, **kw) -> Iterator[LlamaServer]:
    with tempfile.TemporaryDirectory(prefix="graftmem-peer-") as d:
        srv = LlamaServer(exe, model, Path(d), **kw)
        try:
            yield srv
        finally:
            srv.close()


if __name__ == "__main__":
    t0 = time.time()
    path = build(jobs=int(os.environ.get("JOBS", "2")))
    print(path, build_record(), f"(this call {time.time() - t0:.1f} s)")
