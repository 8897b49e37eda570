"""The flywheel: nothing unverified is deposited; a recurring problem is served from its block with
identical output in a new process; the gate keeps a block away from a problem the model already
solves; the sandbox refuses crashes, timeouts, memory hogs and the network.

What the model writes is the point of the cache, gate and transfer tests (SmolLM2 answers "391" after
the graft, "4" to "2 + 2", writes print(19 * 42)): those stay on SmolLM2. The refusals (nothing
unverified deposited, bad programs, bad arguments) hold whatever the model writes: they run on the tiny
random-weight Llama 3.1 (`tiny_mem`), whose decode costs ~1/100th of SmolLM2's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from graftmem import (CallableVerifier, Candidate, ConfigError, ExactMatch, Flywheel, Gate, ProgramVerifier,
                      SolverOutput, Verdict, run_program)
from graftmem.memory.flywheel import extract_answer, extract_program, literals, substitute_literals

PROBLEM = "What is 17 * 23?"


@pytest.fixture(scope="module")
def smol1():
    """SmolLM2 with ONE thread: on a shared, oversubscribed CPU, llama.cpp's two spinning threads
    decoded 40x slower than one (0.3 vs 14 tokens/s measured), and these tests decode."""
    from graftmem import EngineConfig
    from graftmem.core.engine import Engine

    with Engine("smollm2", EngineConfig(n_threads=1)) as e:
        yield e


@pytest.fixture
def mem(smol1, minilm, tmp_path):
    """SmolLM2 (one thread) and the session's MiniLM (the router loads it once, not once per test)."""
    from graftmem import Memory

    with Memory(engine=smol1, home=tmp_path / "store", embedder=minilm) as m:
        yield m
ANSWERS = {PROBLEM: "391", "What is 19 * 42?": "798", "What is 2 + 2?": "4", "What is 345 + 678?": "1023"}


def program_solver(problem: str, budget: int):
    """Writes the program for 'What is A op B?' (a stand-in for a stronger solver)."""
    lits, _ = literals(problem)
    op = "*" if "*" in problem else "+"
    return SolverOutput(program=f"print({lits[0]} {op} {lits[1]})\n", tokens=7, name="test-solver")


def fast(mem, verifier, **kw):
    """A flywheel that spends few tokens live: one greedy sample of at most 8 tokens."""
    kw.setdefault("solver", program_solver)
    kw.setdefault("gate", None)
    kw.setdefault("samples", 1)
    kw.setdefault("budget", 8)
    return Flywheel(mem, verifier, **kw)


# ------------------------------------------------------------------------------ pure helpers
def test_helpers():
    assert extract_answer("17 * 23 = 391\n\nThe answer is: 391.") == "391"
    assert extract_answer("It is 1,024 apples") == "1024"
    assert extract_answer("Paris") == "Paris" and extract_answer("") is None
    assert extract_program("print(19 * 42)\nAnswer: 798") == "print(19 * 42)\n"
    assert extract_program("```python\nprint(1)\n```") == "print(1)\n"
    assert extract_program("print(19 *") is None
    lits, shape = literals("How many times does the letter 'r' appear in 'strawberry'? Use 3 tries.")
    assert lits == ["'r'", "'strawberry'", "3"]
    assert literals("What is 19 * 42?")[1] == literals("what is 7 *  8?")[1]
    assert substitute_literals("print('strawberry'.count('r'))", ["'r'", "'strawberry'"], ["'o'", "'chocolate'"]) \
        == "print('chocolate'.count('o'))"
    assert substitute_literals("print(3 * 60 + 25)", ["3", "25"], ["9", "37"]) == "print(9 * 60 + 37)"
    assert substitute_literals("print(1 + 2)", ["1", "1"], ["5", "6"]) is None  # one old value, two new ones
    assert substitute_literals("print(1 + 2)", ["1"], ["'a'"]) is None           # kinds differ


def test_sandbox_limits():
    assert run_program("print(6 * 7)").answer == "42"
    r = run_program("while True: pass", timeout_s=1)
    assert r.timed_out and not r.ok
    assert not run_program("x = bytearray(2 ** 31)", memory_mb=128).ok
    assert not run_program("raise SystemExit(3)").ok
    if os.getuid() == 0:  # generated code never runs as root
        assert run_program("import os; print(os.getuid(), os.getgid())").answer == "65534 65534"
    net = run_program("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert not net.ok
    raw = run_program("import _socket; s = _socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 80))")
    if raw.network_isolated:  # a fresh namespace: even the raw socket module reaches nothing
        assert not raw.ok and "unreachable" in raw.stderr.lower()


def test_verifiers_say_no_on_failure():
    ok = Candidate(answer="391", program="print(17 * 23)")
    assert ExactMatch(ANSWERS).check(PROBLEM, ok).ok
    assert not ExactMatch(ANSWERS).check("What is 1 + 1?", ok).ok              # unknown problem
    pv = ProgramVerifier(ANSWERS, timeout_s=1)
    assert pv.check(PROBLEM, ok).ok
    assert not pv.check(PROBLEM, Candidate(answer="391")).ok                    # no method
    assert not pv.check(PROBLEM, Candidate(answer="391", program="print(17 * 24)")).ok
    assert not pv.check(PROBLEM, Candidate(answer="391", program="1 / 0")).ok
    assert not pv.check(PROBLEM, Candidate(answer="391", program="while True: pass")).ok
    assert not CallableVerifier(lambda p, c: 1 / 0).check(PROBLEM, ok).ok
    assert not CallableVerifier(lambda p, c: "yes").check(PROBLEM, ok).ok       # only True is a yes
    assert not CallableVerifier(lambda p, c: time.sleep(5), timeout_s=0.2).check(PROBLEM, ok).ok
    assert CallableVerifier(lambda p, c: c.answer == "391").check(PROBLEM, ok).ok


# ------------------------------------------------------------------------------ never deposit unverified
class Raises:
    name = "raises"

    def check(self, problem, candidate):
        raise RuntimeError("verifier crashed")


class Sleeps:
    name = "sleeps"

    def check(self, problem, candidate):
        time.sleep(3)
        return True  # too late: a timed-out verifier never verifies


class Truthy:
    name = "truthy"

    def check(self, problem, candidate):
        return Verdict(ok=False, reason="no", verifier="truthy")


@pytest.mark.parametrize("verifier", [
    CallableVerifier(lambda p, c: False, name="false"),
    Raises(),
    Sleeps(),
    Truthy(),
    ProgramVerifier(lambda p: "999", timeout_s=1),             # the program prints 391, expected 999
    CallableVerifier(lambda p, c: time.sleep(3) or True, timeout_s=0.3, name="slow"),
], ids=["false", "raises", "times-out", "verdict-no", "program-mismatch", "callable-times-out"])
def test_nothing_unverified_is_deposited(tiny_mem, verifier):
    fw = fast(tiny_mem, verifier, verify_timeout_s=0.5)
    sol = fw.solve(PROBLEM)
    assert not sol.verified and sol.source == "unsolved" and sol.deposited is None and sol.answer is None
    assert any(a.method == "solver" and a.answer == "391" for a in sol.attempts)  # the solver did answer
    assert tiny_mem.get_all(kind="solution") == []


def test_program_timeout_and_crash_are_not_deposited(tiny_mem):
    for prog in ("while True: pass\n", "import os\nos._exit(0)\n" "print(391)\n", "raise ValueError\n"):
        fw = fast(tiny_mem, ExactMatch(ANSWERS), solver=lambda p, b, prog=prog: SolverOutput(program=prog),
                  program_timeout_s=1)
        sol = fw.solve(PROBLEM)
        assert not sol.verified and sol.deposited is None
    assert tiny_mem.get_all(kind="solution") == []


def test_bad_arguments(tiny_mem):
    with pytest.raises(ConfigError):
        Flywheel(tiny_mem, object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Flywheel(tiny_mem, ExactMatch(ANSWERS), budget=0)
    with pytest.raises(ConfigError):
        Flywheel(tiny_mem, ExactMatch(ANSWERS)).solve("  ")


# ------------------------------------------------------------------------------ recurrence from the cache
_CHILD = textwrap.dedent("""
    import json, sys
    from graftmem import ExactMatch, Flywheel, Memory
    problem, answers = sys.argv[1], json.loads(sys.argv[2])
    with Memory("smollm2", home=sys.argv[3], config={"n_threads": 1}) as mem:
        fw = Flywheel(mem, ExactMatch(answers), gate=None)
        sol = fw.solve(problem)
        respaced = fw.solve("  " + problem.lower().replace(" ", "   ") + " ")  # same normalized key
        print(json.dumps({"source": sol.source, "answer": sol.answer, "tokens": sol.tokens_decoded,
                          "sha": sol.receipt.first_logits_sha256 if sol.receipt else None,
                          "respaced": [respaced.source, respaced.answer],
                          "router_loaded": mem.router_loaded}))
""")


def test_recurring_problem_served_from_cache_in_new_process(mem, tmp_path):
    fw = fast(mem, ExactMatch(ANSWERS))
    first = fw.solve(PROBLEM)
    assert first.verified and first.source == "live" and first.method == "solver" and first.deposited
    block = mem.get(first.deposited)
    assert block.kind == "solution" and block.metadata["answer"] == "391"
    assert block.metadata["program"] == "print(17 * 23)\n" and block.metadata["verified"] is True
    assert block.metadata["verifier"] == "exact-match" and block.metadata["verified_at"]

    again = fw.solve(PROBLEM)
    assert again.source == "cache" and again.method == "graft" and again.answer == "391"
    assert again.block_id == block.id and again.tokens_decoded <= 8 and again.deposited is None
    assert again.receipt is not None and again.receipt.tokens_restored == block.n_tokens

    out = subprocess.run([sys.executable, "-c", _CHILD, PROBLEM, json.dumps(ANSWERS),
                          str(mem.store.home)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child == {"source": "cache", "answer": "391", "tokens": again.tokens_decoded,
                     "sha": again.receipt.first_logits_sha256, "respaced": ["cache", "391"],
                     "router_loaded": False}


# ------------------------------------------------------------------------------ do no harm
def test_gate_keeps_block_away_from_a_problem_the_model_solves(mem):
    # a verified block for a problem of the same shape, deposited through the solver
    seed = fast(mem, ExactMatch(ANSWERS)).solve("What is 345 + 678?")
    assert seed.deposited
    # without the gate the problem is routed to the block (a transfer)
    ungated = fast(mem, ExactMatch(ANSWERS)).solve("What is 2 + 2?")
    assert ungated.block_id == seed.deposited and ungated.source == "transfer" and ungated.deposited
    mem.delete(ungated.deposited)  # forget it, so that the gated run must route again
    gated = Flywheel(mem, ExactMatch(ANSWERS), gate=Gate(samples=3, temperature=0.3, agree=0.66, max_tokens=8))
    sol = gated.solve("What is 2 + 2?")
    assert sol.gate is not None and sol.gate.confident and sol.gate.majority == "4"
    assert sol.source == "live" and sol.method == "model" and sol.answer == "4"
    assert sol.block_id is None and sol.score is not None  # a block was routed to, and kept away
    assert all(a.block_id is None for a in sol.attempts)   # nothing was grafted


def test_cli_solve(tmp_path, capsys):
    from graftmem.cli import main

    prog = tmp_path / "p.py"
    prog.write_text("print(17 * 23)\n")
    base = ["--home", str(tmp_path / "cli"), "--config", '{"n_threads": 1}', "--json", "solve", PROBLEM]
    assert main(base + ["--answer", "391", "--program", str(prog), "--no-gate", "--budget", "8"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["source"] == "live" and first["method"] == "solver" and first["deposited"]
    assert main(base) == 0  # no answer given: the cached method must reproduce the decoded answer
    again = json.loads(capsys.readouterr().out)
    assert again["source"] == "cache" and again["answer"] == "391" and again["block_id"] == first["deposited"]
    assert main(base + ["--answer", "390", "--no-gate", "--budget", "8"]) == 1  # wrong known answer: nothing verifies
    assert json.loads(capsys.readouterr().out)["verified"] is False


def test_transfer_to_a_variant_by_substitution_and_by_the_model(mem):
    assert fast(mem, ExactMatch(ANSWERS)).solve(PROBLEM).deposited
    fw = fast(mem, ExactMatch(ANSWERS))
    sub, score = fw.try_transfer("What is 19 * 42?", "substitution")
    assert sub.verified and sub.program == "print(19 * 42)\n" and sub.tokens == 0 and score > 0
    ada, _ = fw.try_transfer("What is 19 * 42?", "adaptation")
    assert ada.method == "adaptation" and 0 < ada.tokens <= fw.max_program_tokens
    assert ada.verified and ada.answer == "798"  # SmolLM2 greedy writes print(19 * 42) after the graft
    assert mem.get_all(kind="solution") and len(mem.get_all(kind="solution")) == 1  # try_transfer deposits nothing
    sol = fw.solve("What is 19 * 42?")  # solve: substitution first, then deposited
    assert sol.source == "transfer" and sol.method == "substitution" and sol.tokens_decoded == 0 and sol.deposited
