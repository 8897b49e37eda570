"""bench/ as a package with one harness (issue 27, item 4): the one timing summary on known numbers,
the results stamp (command, commit = ``git rev-parse HEAD``, dirty, machine, threads, versions, date),
and, read from the sources, that no bench edits the module search path or keeps a median of its own,
and that importing a bench runs nothing. No model is loaded."""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import graftmem
from bench import harness

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")


def git(*argv: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


# ----------------------------------------------------------------------------- summary
def test_summary_of_known_numbers():
    s = harness.summary([4, 1, 100, 3, 2])
    assert s == {"median": 3.0, "mean": 22.0, "min": 1.0, "max": 100.0, "iqr": 2.0, "n": 5}
    even = harness.summary([1, 2, 3, 4])
    assert even["median"] == 2.5 and even["iqr"] == 1.5 and even["n"] == 4
    one = harness.summary([7.5])
    assert one == {"median": 7.5, "mean": 7.5, "min": 7.5, "max": 7.5, "iqr": 0.0, "n": 1}


def test_summary_units_percentiles_rounding_and_samples():
    xs = [0.123456, 0.5, 0.25, 10.0]
    s = harness.summary(xs, unit="ms", percentiles=(50, 95), digits=2, samples=True)
    assert set(s) == {"median_ms", "mean_ms", "min_ms", "max_ms", "iqr_ms", "p50_ms", "p95_ms", "n", "samples"}
    assert s["p50_ms"] == s["median_ms"] == 0.38 and s["min_ms"] == 0.12
    assert s["samples"] == [0.12, 0.5, 0.25, 10.0]  # in the order measured
    assert harness.summary(iter(xs))["n"] == 4  # a generator is fine
    # the percentiles and quartiles are numpy's default (linear) ones, as routing.py's were
    rng = np.random.default_rng(1)
    for n in (2, 3, 10, 101):
        v = rng.exponential(size=n).tolist()
        got = harness.summary(v, percentiles=(5, 95))
        q1, q3 = np.percentile(v, [25, 75])
        assert got["iqr"] == pytest.approx(q3 - q1) and got["median"] == pytest.approx(np.median(v))
        assert got["p5"] == pytest.approx(np.percentile(v, 5)) and got["p95"] == pytest.approx(np.percentile(v, 95))


def test_summary_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no measurements"):
        harness.summary([])


# ----------------------------------------------------------------------------- the stamp
def test_write_results_stamps_every_field(tmp_path):
    args = argparse.Namespace(reps=3, out=tmp_path / "r.json", threads=3, models=["smollm2"])
    data = {"rows": [{"x": 1}], "machine": {"loadavg_before": [1.0, 2.0, 3.0], "cpus": 99}}
    path = harness.write_results(tmp_path / "sub" / "r.json", data, args=args)
    assert path == tmp_path / "sub" / "r.json" and not list(path.parent.glob("*.tmp"))
    d = json.loads(path.read_text())
    assert d["command"].startswith("python ")
    assert d["commit"] == git("rev-parse", "HEAD")
    assert d.get("dirty", False) == bool(git("status", "--porcelain", "--", ".", ":(exclude)bench/results"))
    assert dt.datetime.fromisoformat(d["date"]).tzinfo is not None
    m = d["machine"]
    assert {"platform", "cpu", "cpu_flags", "cores", "cpus", "loadavg_before"} <= set(m)
    assert m["platform"] == platform.platform() and m["cpu"]
    assert m["cores"] == len(os.sched_getaffinity(0))
    assert m["cpus"] == 99  # the script's own value of a shared key wins
    assert set(m["cpu_flags"]) <= set(harness.CPU_FLAGS)
    if Path("/proc/cpuinfo").exists():
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith(("flags", "Features"))).split(":", 1)[1].split())
        assert set(m["cpu_flags"]) == flags & set(harness.CPU_FLAGS)
    assert d["threads"] == 3  # from args.threads
    assert d["python"] == platform.python_version()
    assert d["packages"]["graftmem"] == graftmem.__version__ and d["packages"]["llama_cpp_python"]
    assert d["args"] == {"reps": 3, "out": str(tmp_path / "r.json"), "threads": 3, "models": ["smollm2"]}
    assert d["rows"] == [{"x": 1}]  # the script's keys, unchanged


def test_the_thread_count_given_then_args_then_engines_then_cores(monkeypatch):
    monkeypatch.setattr(harness, "_engine_threads", [])
    assert harness.stamp()["threads"] == len(os.sched_getaffinity(0))  # what a default engine takes
    harness._engine_threads += [1, 1]  # what harness.engine() records
    assert harness.stamp()["threads"] == 1
    harness._engine_threads.append(2)
    assert harness.stamp()["threads"] == [1, 2]
    assert harness.stamp(argparse.Namespace(threads=4))["threads"] == 4
    assert harness.stamp(argparse.Namespace(threads=None))["threads"] == [1, 2]
    assert harness.stamp(argparse.Namespace(threads=4), threads={"graft": 2})["threads"] == {"graft": 2}


@pytest.mark.parametrize("key", ["command", "commit", "threads", "date", "machine"])
def test_a_script_cannot_overwrite_the_stamp(tmp_path, key):
    with pytest.raises(ValueError, match="stamp"):
        harness.write_results(tmp_path / "r.json", {key: "mine", "rows": []})
    assert not (tmp_path / "r.json").exists()


def test_command_is_the_python_dash_m_line(tmp_path):
    """``python -m bench.X ...`` from the repository root is what the stamp says, quoted for a shell."""
    proc = subprocess.run([sys.executable, "-m", "bench.harness", "--out", str(tmp_path / "a b.json"), "--reps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["command"] == f"python -m bench.harness --out '{tmp_path / 'a b.json'}' --reps 2"
    assert d["commit"] == git("rev-parse", "HEAD")


def test_commit_says_dirty_for_code_changes_not_for_results(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "x.py").write_text("A = 1\n")
    (repo / "bench" / "results" / "x.json").write_text("{}\n")
    git("init", "-q", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init", cwd=repo)
    monkeypatch.setattr(harness, "ROOT", repo)
    head = git("rev-parse", "HEAD", cwd=repo)
    assert harness.commit() == {"commit": head}
    (repo / "bench" / "results" / "x.json").write_text('{"run": 2}\n')  # an earlier run's output
    (repo / "bench" / "results" / "new.json").write_text("{}\n")
    assert harness.commit() == {"commit": head}
    (repo / "bench" / "x.py").write_text("A = 2\n")  # the code measured differs from the commit
    assert harness.commit() == {"commit": head, "dirty": True}
    monkeypatch.setattr(harness, "ROOT", tmp_path / "not-a-repo")
    (tmp_path / "not-a-repo").mkdir()
    assert harness.commit() == {"commit": None}


# ----------------------------------------------------------------------------- the sources
def test_no_bench_edits_the_module_search_path():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in BENCH.rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.path" in line]
    assert not bad, "sys.path edited in:\n" + "\n".join(bad)


def test_one_median_the_harness_one():
    """Timings are summarised by harness.summary alone: no other bench imports statistics or defines a
    median / spread / stats helper of its own."""
    bad = []
    for p in SCRIPTS:
        if p.name == "harness.py":
            continue
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "statistics" for a in node.names):
                bad.append(f"{p.name}:{node.lineno} import statistics")
            elif isinstance(node, ast.ImportFrom) and node.module == "statistics":
                bad.append(f"{p.name}:{node.lineno} from statistics")
            elif isinstance(node, ast.FunctionDef) and node.name in ("median", "spread", "stats", "pct", "percentile"):
                bad.append(f"{p.name}:{node.lineno} def {node.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_bench_imports_without_running(script):
    """``import bench.X`` defines, never measures: the work is under ``if __name__ == "__main__":`` and
    nothing at module level calls ``main``; importing writes no result."""
    tree = ast.parse(script.read_text(), str(script))
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) in (
        "__name__ == '__main__'", '__name__ == "__main__"')]
    if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
        assert guards, f"{script.name} defines main() but has no __main__ guard"
    calls = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert not [c for c in calls if "main(" in c], calls
    before = {p: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()}
    mod = importlib.import_module(f"bench.{script.stem}")
    assert mod.__file__ and Path(mod.__file__).resolve() == script.resolve()
    assert {p: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()} == before
