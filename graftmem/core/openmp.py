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

A passive wait (``OMP_WAIT_POLICY=passive``, which graftmem set until the fourth stop) cured that but
made every barrier a futex sleep and wake-up: measured idle on a 2-core AMD EPYC (``python -m bench.omp_wait``,
SmolLM2, 3,000 cached tokens, bench/results/omp_wait.json) a one-token call took 25.6 ms passive vs 11.7 ms
spinning, eight decode calls 206 vs 87 ms, a 40-token tail 277 vs 259 ms. A *short* spin keeps both: a
thread spins ``GOMP_SPINCOUNT`` = 1,000 times (tens of microseconds, about the gap between two graph nodes)
and then sleeps. Idle it is as fast as libgomp's default (one-token 11.7 ms, decode 87.5 ms); with 2 busy
processes on the 2 cores (omp_wait.json) a 40-token tail 557 ms like passive's 557 (libgomp's default:
874); with 6 (omp_wait_busy6.json) 1,321 ms vs passive's 1,480, decode 755 vs 762 ms, the one-token call
108 vs 70 ms.

The price of the short spin, measured at the fifth stop (docs/benchmarks.md, "After an idle gap"): on this
VM a one-token call that follows an idle gap (a restarted server's first request, 2 s after it is ready)
took 28-38 ms with 1,000 vs 14-16 ms with 100,000 or libgomp's default (``python -m bench.turns --pause 2``);
but with 6 spinners on the 2 cores a spin of 100,000 made a 40-token call 3,853 ms vs 1,342 and 8 decode
calls 6,684 vs 763 ms (``python -m bench.omp_wait --burners 6``). The default stays the one that is safe on
a shared host; on cores that are the server's own, ``GOMP_SPINCOUNT=100000`` (or ``OMP_WAIT_POLICY=active``)
buys back the idle gap.
The wait changes when a thread sleeps, never what it computes (the work of each thread is split by its
index, the same at every barrier), so the bytes and the fingerprint do not change. It is set only where
the process has not chosen (``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` unset) and only if this module runs
before libgomp loads (`graftmem.core.backend` imports it before ``llama_cpp``): ``OMP_WAIT_POLICY=passive``
for the most loaded hosts, ``OMP_WAIT_POLICY=active`` on cores that are this process's alone.
"""

from __future__ import annotations

import os

__all__ = ["SPIN_COUNT", "SET_HERE", "environ_without_ours"]

#: the spins before a thread waiting at a barrier sleeps, when the process did not choose a wait policy
SPIN_COUNT = "1000"

#: whether this module set ``GOMP_SPINCOUNT`` (the process had chosen nothing)
SET_HERE = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ

if SET_HERE:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def environ_without_ours() -> dict[str, str]:
    """This process's environment without the wait graftmem chose for itself: what another program it
    starts (a benchmark's llama-server) would have seen had graftmem not been imported, so that program
    runs with its own default and not ours."""
    env = dict(os.environ)
    if SET_HERE and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del env["GOMP_SPINCOUNT"]
    return env
