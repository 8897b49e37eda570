"""Shared fixtures: real engines on the real packaged models, one load per session, and a hermetic
store home per test (GRAFTMEM_HOME points into tmp_path, as simonw/llm does with LLM_USER_PATH)."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (``scripts/dev.sh test`` runs one worker per core), each worker runs on its
    own share of the cores, set before any engine exists: llama.cpp sizes its threads by this
    process's affinity (`graftmem.core.engine.usable_cores`), and threads and child processes inherit
    it, so N workers never run N x cores threads that wait on each other (OpenMP threads spin)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker[2:]) % count::count])


_pin_xdist_worker()

#: The files that take longest (seconds summed over their tests, measured with ``--durations=0`` on a 2-core
#: machine), started first: pytest-xdist hands out whole files (``--dist loadfile``) in collection order, so
#: a long file started last would leave the other worker idle at the end. Files not named keep their order,
#: after these; the list is a schedule hint, not a correctness matter.
SLOWEST_FIRST: list[str] = [
    "test_exactness.py", "test_docs.py", "test_docs_shell.py", "test_needle.py", "test_cli.py", "test_packaging.py",
    "test_server_openai.py", "test_chain.py", "test_server_frameworks.py", "test_server_responses.py",
    "test_recall.py", "test_forced_calls.py", "test_fleet.py", "test_fleet_cluster.py", "test_kernels.py",
    "test_server_forced_tools.py", "test_speed_paths.py", "test_server_ram.py", "test_flywheel.py",
    "test_state_cut.py", "test_server_hostile.py", "test_server_chain.py", "test_server_agent_example.py",
    "test_templates.py", "test_http.py", "test_store.py", "test_shared_model.py",
]


def pytest_configure(config: pytest.Config) -> None:
    # xdist otherwise orders the files by their number of tests, which puts one-test files like the fleet
    # cluster last (the controller reads this when it schedules)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: test order inside a file kept


#: The hot tier (`graftmem.store.hot`) is off in the tests, servers they start included: a test of a
#: disk read (a flipped byte refused, a read timed, a receipt's phases) reads the disk. The tests of the
#: hot tier turn it on (tests/test_hot_tier.py).
os.environ.setdefault("GRAFTMEM_HOT_TIER_MB", "0")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The files tests kept as artifacts (``record_property("artifact", path)``: the /ui page's screenshots),
    listed at the end of the run; under pytest-xdist too (a report's properties travel with it)."""
    paths = [v for key in ("passed", "failed") for rep in terminalreporter.getreports(key)
             for k, v in getattr(rep, "user_properties", ()) if k == "artifact"]
    if paths:
        terminalreporter.section("test artifacts")
        for p in dict.fromkeys(paths):
            terminalreporter.write_line(str(p))


from graftmem import Memory  # noqa: E402
from graftmem.core.engine import Engine  # noqa: E402


@pytest.fixture(autouse=True)
def _hermetic_home(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFTMEM_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def smol() -> Engine:
    """SmolLM2-135M (dense), default engine configuration, loaded once."""
    with Engine("smollm2") as e:
        yield e


@pytest.fixture(scope="session")
def gemma() -> Engine:
    """Gemma 3 270M (sliding-window layers), default (exact) configuration, loaded once."""
    with Engine("gemma3-270m") as e:
        yield e


@pytest.fixture(scope="session")
def tiny_llama() -> Engine:
    """The tiny random-weight Llama 3.1 of tests/tiny.py (real tokenizer and template, 2 layers, n_embd 64),
    loaded once: for tests of what surrounds the engine (stores, fleets, servers), where any real model
    does and a prefill costs about a hundredth of SmolLM2's. One thread: a pinned xdist worker gets one
    anyway, and two OpenMP threads on a model this small wait on each other (10x slower on a busy machine)."""
    from tests.tiny import tiny_path

    with Engine(tiny_path("llama31"), {"n_threads": 1}) as e:
        yield e


@pytest.fixture(scope="session")
def minilm():
    """The packaged MiniLM, loaded once for every test module that routes."""
    from graftmem import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder()


@pytest.fixture
def mem(smol, tmp_path) -> Memory:
    """A Memory over the shared SmolLM2 engine and a fresh store."""
    with Memory(engine=smol, home=tmp_path / "store") as m:
        yield m


@pytest.fixture
def gmem(gemma, tmp_path) -> Memory:
    with Memory(engine=gemma, home=tmp_path / "gstore") as m:
        yield m


@pytest.fixture
def tiny_mem(tiny_llama, tmp_path) -> Memory:
    """A Memory over the tiny Llama 3.1 (`tiny_llama`) and a fresh store: for store plumbing that holds on
    any dense model and prefills ~100x cheaper than SmolLM2 (exactness stays on the real models)."""
    with Memory(engine=tiny_llama, home=tmp_path / "tstore") as m:
        yield m


def long_text(n_words: int, seed: int = 0) -> str:
    """Deterministic prose-like text of about n_words words (about 1.3 tokens per word)."""
    import random

    rng = random.Random(seed)
    vocab = ("the agent reads a manual and follows each step before it answers the customer about "
             "orders refunds shipping codes dates numbers tickets policy team desk window cache "
             "layer token state graft block store verify exact bytes logits").split()
    words = []
    for i in range(n_words):
        w = rng.choice(vocab)
        words.append(w.capitalize() if i % 11 == 0 else w)
        if i % 11 == 10:
            words[-1] += "."
    return " ".join(words)


def flip_bit(path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of a file, in place (a corruption to detect)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@contextlib.contextmanager
def no_hang(seconds: int = 30) -> Iterator[None]:
    """Raise TimeoutError if the body runs longer than ``seconds`` (a FIFO opened blocking hangs).
    The store's hostile-file tests and bench/fuzz.py's rounds both use it (main thread only: SIGALRM)."""
    def fire(*_: Any) -> None:
        raise TimeoutError(f"hung for {seconds} s (a FIFO opened blocking?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
