"""`graftmem serve` in a child process of its own, for tests where a crash, a descriptor limit or a
signal must hit that process and not the test's: started on a free loopback port, its URL read from
the banner, terminated (then killed, bounded) on exit."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serve_process(*args: str, home: Path, preexec_fn: Optional[Callable[[], None]] = None
                  ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m graftmem serve --port 0 *args`` on ``home``; yields the process and its URL."""
    env = {**os.environ, "GRAFTMEM_HOME": str(home), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "serve", "--port", "0", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=preexec_fn)
    try:
        url = None
        for _ in range(50):  # bounded: the banner's first lines name the URL
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not start"
        yield proc, url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``, then kill it if it has not ended in 20 s (bounded either way)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)
