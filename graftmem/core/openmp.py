"""How llama.cpp's CPU threads wait for each other: set before the shared library loads (issue #44).

llama.cpp's CPU backend, as llama-cpp-python builds it, runs a graph on an OpenMP team and meets at a
barrier after every node (hundreds per ``llama_decode`` call). libgomp's default makes a thread that
reaches a barrier first spin (300,000 iterations) before it sleeps. On a machine whose cores are shared
(a 2-core host with other processes, or this server's own writer, event loop and client on the same
cores), the partner thread is often descheduled, and the spinning one burns the slice the partner
needs: every barrier can cost a scheduler slice, so a call's time follows its number of barriers, not
its work. Measured on a 2-core Xeon at load average 9-10 (SmolLM2, 2 threads, 600 cached tokens,
medians of 5, two alternations each, ``/tmp`` script of bench/turns.py's investigation; docs/benchmarks.md):
an 81-token call 7.7-13.3 s spinning vs 2.3-5.3 s with ``OMP_WAIT_POLICY=passive``, a one-token call
2.4-3.0 s vs 65-84 ms, eight one-token decode calls 17.7-18.8 s vs 0.49-0.74 s.

A passive wait changes when a thread sleeps, never what it computes (the work of each thread is split
by its index, the same at every barrier), so the bytes and the fingerprint do not change. It is set
only where the process has not chosen (``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` unset) and only if
this module runs before libgomp loads (`graftmem.core.backend` imports it before ``llama_cpp``); set
``OMP_WAIT_POLICY=active`` (or ``GOMP_SPINCOUNT=300000``, libgomp's default) to get the spinning back on a
machine whose cores are this process's alone: there a sleeping thread wakes later than a spinning one,
measured idle at ~5 ms (~20 %) more per one-token call and ~10 % more per short prefill.
"""

from __future__ import annotations

import os

__all__ = ["WAIT_POLICY"]

#: the wait policy graftmem gives libgomp when the process did not choose one
WAIT_POLICY = "passive"

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
