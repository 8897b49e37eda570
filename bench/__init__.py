"""The benchmarks: one module per measurement, run from the repository root as ``python -m bench.X``.

A package, so that the scripts import each other (``bench.peer``, ``bench.routing_set``) and the shared
harness (``bench.harness``: the one timing summary, the one results writer that stamps command, commit
and machine, the one engine factory) without editing the module search path. Importing a module runs nothing:
each measures only under ``if __name__ == "__main__":``.
"""
