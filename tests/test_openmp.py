"""llama.cpp's OpenMP threads spin briefly, then sleep, unless the process chose otherwise (`graftmem.core.openmp`, #44).

What libgomp itself read is checked, not the environment variable: ``OMP_DISPLAY_ENV=verbose`` makes it print
its settings when it loads, and ``GOMP_SPINCOUNT`` there is the number of spins before a thread sleeps at a
barrier (300,000 by default, 0 when passive, graftmem's 1,000). Each case runs in a new process: libgomp reads them once."""

from __future__ import annotations

import os
import subprocess
import sys


def _libgomp_settings(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", "import graftmem.core.backend"], env={**clean, "OMP_DISPLAY_ENV": "verbose",
                          **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr + proc.stdout


def test_llama_cpp_threads_spin_briefly_by_default():
    out = _libgomp_settings()
    assert "GOMP_SPINCOUNT = '1000'" in out, out[-2000:]


def test_a_wait_policy_the_process_chose_is_kept():
    assert "GOMP_SPINCOUNT = '1000'" not in _libgomp_settings(OMP_WAIT_POLICY="active")
    assert "GOMP_SPINCOUNT = '0'" in _libgomp_settings(OMP_WAIT_POLICY="passive")
    assert "GOMP_SPINCOUNT = '1234'" in _libgomp_settings(GOMP_SPINCOUNT="1234")
