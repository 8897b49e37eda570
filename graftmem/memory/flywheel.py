"""The verified-knowledge flywheel: solve once with extra inference, verify, deposit, and answer a
recurrence from its block in a few decode tokens (the paper's "Galahad" loop, section 4.6-4.7).

Order of work in [`Flywheel.solve()`][graftmem.Flywheel.solve]:

1. **cache**: an exact lookup (the problem's normalized text, `normalize_task()`,
   recorded in the block's metadata) finds a verified block for a *recurring* problem. The block is
   grafted and the model decodes the answer after it (``Answer:`` is the last thing prefilled, so a
   few tokens suffice). No embedding model is loaded on this path.
2. **transfer**: otherwise the router finds the closest verified block. If the block's method is a
   program and the new problem has the same shape with other literals, the literals are substituted
   and the program is run in the sandbox (*substitution*, zero decode tokens); or the block is
   grafted and the model writes the method for the new problem, which is run (*adaptation*).
3. **live**: otherwise the model itself (best-of-k samples) and then the application's ``solver``
   (a larger model, a program generator, a human...), within a token ``budget``.
4. **verify**: every answer, from any path, goes through the verifier; only a clean yes counts.
5. **deposit**: only verified solutions of steps 2-3 become blocks (kind ``"solution"``): the problem,
   the verified method and the answer, as a chat exchange the model can copy from. A problem the
   model answered right on its own is deposited too: its recurrence then costs a few tokens instead
   of k samples, and an exact recurrence of a verified answer cannot override a better method.

**Do no harm** (paper 4.13: a cached procedure that overrode a method the model already had cost 55
points). Before a *routed* block is used for a new problem, the [`Gate`][graftmem.Gate] asks the model alone a
few times (greedy + temperature samples: self-consistency). If it agrees with itself and the verifier
accepts its answer, no block is grafted. A block found by exact lookup is not gated again: it was
deposited only because the model, unsure or wrong on that very problem, needed it, and greedy
decoding in the same engine fingerprint would repeat the same result. The gate's samples are reused
as the model's best-of-k live attempts, so they are paid for once.

Every step is recorded in [`Solution`][graftmem.Solution] (source, method, tokens decoded, wall time, the block used,
each attempt and its verdict), so the token ratio against the base model can be measured, not guessed.
"""

from __future__ import annotations

import ast
import io
import logging
import re
import time
import tokenize
from collections import Counter
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..core.blocks import SOLUTION_KIND, Block, Fingerprint, Recall, Receipt, SearchHit
from ..core.decoding import Sampling, decode
from ..core.errors import BlockNotFound, ConfigError
from ..core.segments import detect_format, no_format_reason
from .checks import Candidate, Verdict, Verifier, call_with_timeout, normalize_answer, run_program
from .router import normalize_task

#: Routing score below which no solution block is tried for transfer. Lower than recall's
#: DEFAULT_MIN_SCORE (0.38, calibrated to refuse off-topic tasks before grafting a manual): a transfer
#: is always checked by the verifier, so a weak match costs tokens, never a wrong answer, and problems
#: of the same shape with other numbers ("What is 2 + 2?" vs "What is 345 + 678?") share few words.
TRANSFER_MIN_SCORE = 0.25

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.prompt import ChatFormat

__all__ = ["Flywheel", "Solution", "Attempt", "Gate", "GateReport", "SolverOutput", "extract_answer",
           "extract_program", "literals", "substitute_literals", "SOLUTION_KIND"]

log = logging.getLogger("graftmem")

Method = Literal["graft", "substitution", "adaptation", "model", "solver"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gate(_Strict):
    """Self-consistency gate: ``samples`` answers from the model alone (the first greedy, the rest at
    ``temperature``, seeded); the model is *confident* when at least ``agree`` of them give the same
    answer. Each sample decodes at most ``max_tokens``.

    Defaults from a sweep on SmolLM2-135M (bench/flywheel.py, docs/flywheel.md): at T=0.8 the model
    disagrees with itself even on "2 + 2"; at T=0.5 with 5 samples and 3 agreeing, easy problems pass
    and most multi-digit ones do not. A confident but wrong answer costs nothing but tokens: the
    verifier rejects it and the block is used after all.

    Frozen: `Flywheel`'s default is one shared instance."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples: int = Field(5, ge=1, le=32)
    temperature: float = Field(0.5, gt=0.0)
    agree: float = Field(0.6, gt=0.0, le=1.0)
    max_tokens: int = Field(32, ge=1)
    seed: int = 0


class GateReport(_Strict):
    """What the model said on its own, and whether the gate trusts it."""

    answers: list[Optional[str]]
    majority: Optional[str]
    agreement: float
    greedy_logprob: float          #: mean log-probability of the greedy sample's tokens
    confident: bool
    tokens: int
    ms: float


class Attempt(_Strict):
    """One candidate tried by [`Flywheel.solve()`][graftmem.Flywheel.solve] and the verifier's verdict on it."""

    method: Method
    answer: Optional[str]
    program: Optional[str] = None
    verified: bool
    reason: str
    tokens: int = 0
    ms: float = 0.0
    block_id: Optional[str] = None


class Solution(_Strict):
    """The outcome of [`Flywheel.solve()`][graftmem.Flywheel.solve].

    ``source``: ``cache`` (exact lookup of a recurring problem), ``transfer`` (a routed block's method
    adapted to a new problem), ``live`` (the model or the solver, now), ``unsolved``. ``method`` says
    which path produced the verified answer. ``tokens_decoded`` counts every token the model decoded
    for this problem (gate and failed attempts included); ``solver_tokens`` what the solver reported.
    """

    problem: str
    key: str
    answer: Optional[str]
    verified: bool
    source: Literal["cache", "transfer", "live", "unsolved"]
    method: Optional[Method] = None
    block_id: Optional[str] = None
    score: Optional[float] = None
    deposited: Optional[str] = None
    tokens_decoded: int = 0
    solver_tokens: int = 0
    wall_s: float = 0.0
    gate: Optional[GateReport] = None
    attempts: list[Attempt] = Field(default_factory=list)
    receipt: Optional[Receipt] = None

    @property
    def solved(self) -> bool:
        return self.verified


class SolverOutput(_Strict):
    """What an application's solver returns: an answer, or a program that prints it, or both;
    ``tokens`` is what the solver decoded (for the ledger)."""

    answer: Optional[str] = None
    program: Optional[str] = None
    tokens: int = 0
    name: str = "solver"


Solver = Callable[[str, int], Union[SolverOutput, None]]


# ---------------------------------------------------------------------------------- text helpers
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> Optional[str]:
    """The answer in a model's reply: the last number in it (``"17 * 23 = 391"`` -> ``"391"``), or,
    when it has none, its first non-empty line. None for an empty reply."""
    nums = _NUMBER.findall(text)
    if nums:
        return nums[-1].replace(",", "")
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


def extract_program(text: str) -> Optional[str]:
    """A Python program in a model's reply: code fences removed, cut before an ``Answer:`` /
    ``Problem:`` / ``The verified answer`` line, then trailing lines dropped until it compiles
    (compiling runs nothing). None if no prefix of it compiles."""
    m = re.search(r"```(?:python)?\n(.*?)(?:```|$)", text, re.S)
    body = m.group(1) if m else text
    lines: list[str] = []
    for line in body.splitlines():
        if re.match(r"\s*((answer|problem)\s*:|the verified answer)", line, re.I):
            break
        lines.append(line)
    while lines:
        src = "\n".join(lines).strip()
        if src:
            try:
                compile(src, "<program>", "exec")
                return src + "\n"
            except (SyntaxError, ValueError):
                pass
        lines.pop()
    return None


def program_lead(program: Optional[str]) -> str:
    """The start of a cached program's first line, up to and including its first ``(``
    (``"print("``, ``"def solve("``): the adaptation prompt shows it so that the model writes a
    method of the same form rather than prose. Empty when there is no such start."""
    if not program:
        return ""
    first = program.lstrip().splitlines()[0] if program.strip() else ""
    m = re.match(r"[A-Za-z_][\w.]*\s*\(", first) or re.match(r"def\s+\w+\s*\(", first)
    return m.group(0) if m else ""


_LITERAL = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"|(?<![\w.])\d+(?:\.\d+)?(?![\w.]|\.\d)")


def literals(problem: str) -> tuple[list[str], str]:
    """The literals of a problem (quoted strings and numbers, in order) and its *shape*: the text with
    each literal replaced by a placeholder. Two problems with one shape are variants of each other."""
    lits = _LITERAL.findall(problem)
    shape = _LITERAL.sub("\x00", normalize_task(problem))
    return lits, shape


def _lit_value(lit: str) -> Any:
    try:
        return ast.literal_eval(lit)
    except (ValueError, SyntaxError):
        return lit


def substitute_literals(program: str, old: Sequence[str], new: Sequence[str]) -> Optional[str]:
    """Mechanical transfer: replace in ``program`` each number or string literal equal to ``old[i]``
    by ``new[i]``. None when the literals do not pair up (different counts or kinds, or one old
    value asked to become two new ones). Constants of the program that are not literals of the old
    problem stay as they are (the paper's "hard-coded constant" failure shows up at verification)."""
    if len(old) != len(new):
        return None
    mapping: dict[Any, Any] = {}
    for o, n in zip(old, new):
        ov, nv = _lit_value(o), _lit_value(n)
        if type(ov) is not type(nv) and not (isinstance(ov, (int, float)) and isinstance(nv, (int, float))):
            return None
        key = (type(ov).__name__ if isinstance(ov, str) else "num", ov)
        if key in mapping and mapping[key] != nv:
            return None
        mapping[key] = nv
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(program).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    starts = [0]
    for line in program.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    edits = []
    for t in toks:
        if t.type not in (tokenize.NUMBER, tokenize.STRING):
            continue
        v = _lit_value(t.string)
        key = ("str", v) if isinstance(v, str) else ("num", v)
        if key in mapping:
            a = starts[t.start[0] - 1] + t.start[1]
            b = starts[t.end[0] - 1] + t.end[1]
            edits.append((a, b, repr(mapping[key])))
    out = program
    for a, b, rep in sorted(edits, reverse=True):
        out = out[:a] + rep + out[b:]
    return out


ANSWER_LEAD = "The verified answer is"


def block_text(problem: str, program: Optional[str], answer: str, verifier: str, fmt: "ChatFormat") -> str:
    """The body of a solution block (learned with ``chat=True``, so it becomes a system turn).

    It holds the problem, the verified method and the answer, and then the exchange itself: the
    problem as a user turn and the answer as the assistant's turn. A recurrence prefills the same user
    turn and the assistant's lead (``The verified answer is``), so the model's continuation repeats a
    turn it has just seen: measured on the 30 problems of examples/flywheel, 30/30 copied, about
    5 decode tokens each, against 25/30 with the answer only in the system turn and 11/30 without
    the lead (bench notes in docs/flywheel.md).
    """
    method = program.strip() if program else "(no program; the answer was checked directly)"
    system = (f"Verified solution (checked by {verifier}).\nProblem: {problem}\n"
              f"Method (Python program):\n{method}\n{ANSWER_LEAD} {answer}.")
    return (f"{system}{fmt.block_tail}{fmt.task_head}Problem: {problem}{fmt.task_tail}"
            f"{ANSWER_LEAD} {answer}.")


# ---------------------------------------------------------------------------------- the flywheel
class MemoryLike(Protocol):
    """What the flywheel needs of a memory: the verbs of [`Memory`][graftmem.Memory] it calls.

    The flywheel is an application of the memory's public verbs (learn a verified solution, search,
    graft one block), so it is typed against them rather than against the facade class, which sits in
    a layer above this one.
    """

    @property
    def engine(self) -> "Engine": ...

    @property
    def fingerprint(self) -> Fingerprint: ...

    def learn(self, text: str, *, name: Optional[str] = ..., kind: str = ...,
              metadata: Optional[Mapping[str, Any]] = ..., when_to_use: Optional[str] = ...,
              chat: bool = ...) -> Block: ...

    def ask(self, block_id: str, query: str, *, max_tokens: int = ...) -> Recall: ...

    def get(self, block_id: str) -> Block: ...

    def get_all(self, *, kind: Optional[str] = ...) -> list[Block]: ...

    def search(self, task: str, *, top_k: int = ...) -> list[SearchHit]: ...


class Flywheel:
    """Solve, verify, deposit; answer recurrences from blocks. See the module docstring.

    ``memory`` provides the engine, the store and the router; ``verifier`` decides (see
    `graftmem.memory.checks`); ``solver(problem, budget_tokens)`` is the application's stronger
    solver, called when the model alone fails. ``budget`` caps the tokens the model decodes live per
    problem (gate samples included). ``gate=None`` turns the do-no-harm gate off (for measuring it).
    ``transfer`` orders the transfer methods tried on a routed block; ``min_score`` is the routing
    score below which no block is used for transfer. ``answer_hint`` is appended to the problem when
    the model answers alone, ``verify_timeout_s`` bounds any verifier call.
    """

    def __init__(self, memory: MemoryLike, verifier: Verifier, *, solver: Optional[Solver] = None,
                 budget: int = 512, gate: Optional[Gate] = Gate(), samples: Optional[int] = None,
                 transfer: Sequence[Literal["substitution", "adaptation"]] = ("substitution", "adaptation"),
                 min_score: float = TRANSFER_MIN_SCORE, max_answer_tokens: int = 12, max_program_tokens: int = 96,
                 answer_hint: str = "Reply with the final answer only.", kind: str = SOLUTION_KIND,
                 verify_timeout_s: float = 60.0, program_timeout_s: float = 5.0) -> None:
        if not hasattr(verifier, "check"):
            raise ConfigError("verifier must have check(problem, candidate); see graftmem.ExactMatch, "
                              "ProgramVerifier, CallableVerifier")
        if budget < 1:
            raise ConfigError(f"budget must be at least 1 token, got {budget}")
        bad = [t for t in transfer if t not in ("substitution", "adaptation")]
        if bad:
            raise ConfigError(f"unknown transfer method(s) {bad}; use 'substitution' and/or 'adaptation'")
        fmt = detect_format(memory.engine)
        if fmt is None:
            raise ConfigError(f"model {memory.fingerprint.model_name!r} has no chat format for blocks "
                              f"({no_format_reason(memory.engine)}); the flywheel needs one to shape its blocks")
        self.mem = memory
        self.verifier = verifier
        self.verifier_name = str(getattr(verifier, "name", type(verifier).__name__))
        self.solver = solver
        self.budget = budget
        self.gate = gate
        self.samples = samples if samples is not None else (gate.samples if gate else 4)
        self.transfer = tuple(transfer)
        self.min_score = min_score
        self.max_answer_tokens = max_answer_tokens
        self.max_program_tokens = max_program_tokens
        self.answer_hint = answer_hint
        self.kind = kind
        self.verify_timeout_s = verify_timeout_s
        self.program_timeout_s = program_timeout_s
        self.fmt: "ChatFormat" = fmt
        self._sampling = gate or Gate(samples=self.samples)

    # ------------------------------------------------------------------ public
    def solve(self, problem: str) -> Solution:
        """Answer ``problem``: cache, else transfer, else live; verify; deposit what was verified."""
        if not isinstance(problem, str) or not problem.strip():
            raise ConfigError("the problem is empty")
        t0 = time.perf_counter()
        key = normalize_task(problem)
        attempts: list[Attempt] = []
        ledger = {"tokens": 0}

        def done(source: str, att: Optional[Attempt], **kw: Any) -> Solution:
            sol = Solution(problem=problem, key=key, answer=att.answer if att and att.verified else None,
                           verified=bool(att and att.verified), source=source,
                           method=att.method if att and att.verified else None,
                           tokens_decoded=ledger["tokens"], wall_s=time.perf_counter() - t0,
                           attempts=attempts, **kw)
            log.info("flywheel: %s -> %s/%s verified=%s tokens=%d", key[:60], sol.source, sol.method,
                     sol.verified, sol.tokens_decoded)
            return sol

        att: Optional[Attempt]  # each step's attempt; a transfer may find none
        # 1. exact lookup of a recurring problem
        cached = self.lookup(problem)
        if cached is not None:
            att, receipt = self._answer_from_block(cached, problem)
            ledger["tokens"] += att.tokens
            attempts.append(att)
            if att.verified:
                return done("cache", att, block_id=cached.id, receipt=receipt)
            log.warning("flywheel: block %s answered its own problem with %r, not verified (%s); solving again",
                        cached.short_id, att.answer, att.reason)

        # 2. route to the closest verified block; gate; transfer
        gate_rep: Optional[GateReport] = None
        own: list[tuple[Optional[str], int]] = []
        hit = self._route(problem, exclude=cached.id if cached else None)
        if hit is not None and self.gate is not None:
            gate_rep, own = self._ask_model(problem, self.gate, self.budget)
            ledger["tokens"] += gate_rep.tokens
            if gate_rep.confident:
                att = self._check_model_answer(problem, gate_rep.majority)
                attempts.append(att)
                if att.verified:  # the model knows this one: keep the routed block away from it
                    return done("live", att, gate=gate_rep, score=hit[1], deposited=self._deposit(problem, att))
        if hit is not None:
            block, score = hit
            for how in self.transfer:
                if how == "substitution":
                    att = self._substitute(block, problem)
                else:
                    att, _ = self._adapt(block, problem)
                if att is None:
                    continue
                ledger["tokens"] += att.tokens
                attempts.append(att)
                if att.verified:
                    dep = self._deposit(problem, att)
                    return done("transfer", att, block_id=block.id, score=score, deposited=dep, gate=gate_rep)

        # 3. live: the model's best-of-k (the gate's samples if it ran), then the solver
        if gate_rep is None:
            left = self.budget - ledger["tokens"]
            if left > 0:
                gate_rep, own = self._ask_model(problem, self._sampling.model_copy(
                    update={"samples": self.samples}), left)
                ledger["tokens"] += gate_rep.tokens
        tried = {normalize_answer(a.answer) for a in attempts if a.method == "model"}
        by_count = Counter(normalize_answer(a) for a, _ in own if normalize_answer(a) is not None)
        for ans, _ in by_count.most_common():
            if ans in tried:
                continue
            att = self._check_model_answer(problem, ans)
            attempts.append(att)
            if att.verified:
                return done("live", att, gate=gate_rep, deposited=self._deposit(problem, att))
        solver_tokens = 0
        if self.solver is not None:
            att = self._run_solver(problem, max(0, self.budget - ledger["tokens"]))
            solver_tokens = att.tokens
            att = att.model_copy(update={"tokens": 0})  # solver tokens are kept apart from the model's
            attempts.append(att)
            if att.verified:
                dep = self._deposit(problem, att)
                return done("live", att, gate=gate_rep, deposited=dep, solver_tokens=solver_tokens)
        return done("unsolved", None, gate=gate_rep, solver_tokens=solver_tokens)

    def lookup(self, problem: str) -> Optional[Block]:
        """The newest verified solution block of this engine for exactly this (normalized) problem."""
        key = normalize_task(problem)
        digest = self.mem.fingerprint.digest()
        found = [b for b in self.mem.get_all(kind=self.kind)
                 if b.metadata.get("key") == key and b.metadata.get("verified") is True
                 and b.fingerprint.digest() == digest]
        return found[-1] if found else None

    def ask_model(self, problem: str, *, samples: int = 5, max_tokens: Optional[int] = None) -> GateReport:
        """The base model alone, ``samples`` times (greedy first): the comparison arm of a benchmark."""
        g = self._sampling.model_copy(update={"samples": samples, **({"max_tokens": max_tokens} if max_tokens else {})})
        rep, _ = self._ask_model(problem, g, samples * g.max_tokens)
        return rep

    def try_transfer(self, problem: str, how: Literal["substitution", "adaptation"]) -> tuple[Optional[Attempt], Optional[float]]:
        """One transfer method on the block the router picks for ``problem``, without the gate and
        without depositing: for measuring transfer rates. Returns (attempt or None, routing score)."""
        hit = self._route(problem, exclude=None)
        if hit is None:
            return None, None
        block, score = hit
        att = self._substitute(block, problem) if how == "substitution" else self._adapt(block, problem)[0]
        return att, score

    def answer_with_block(self, block_id: str, problem: str) -> Attempt:
        """Graft ``block_id`` and let the model answer ``problem`` after it (the cache path), verified,
        whatever the block is: for measuring what a block does to a problem it was not made for."""
        return self._answer_from_block(self.mem.get(block_id), problem)[0]

    def verify(self, problem: str, candidate: Candidate) -> Verdict:
        """Run the verifier with a timeout; an exception, a timeout or a non-yes is *not verified*."""
        t0 = time.perf_counter()
        ok, value = call_with_timeout(lambda: self.verifier.check(problem, candidate), self.verify_timeout_s)
        ms = (time.perf_counter() - t0) * 1e3
        if not ok:
            return Verdict(ok=False, reason=f"verifier {value}", verifier=self.verifier_name, ms=ms)
        if isinstance(value, Verdict):
            return value if value.ok is True else value.model_copy(update={"ok": False})
        if value is True:
            return Verdict(ok=True, reason="verifier returned True", verifier=self.verifier_name, ms=ms)
        return Verdict(ok=False, reason=f"verifier returned {value!r}", verifier=self.verifier_name, ms=ms)

    # ------------------------------------------------------------------ paths
    def _route(self, problem: str, exclude: Optional[str]) -> Optional[tuple[Block, float]]:
        """The closest verified solution block above ``min_score``; among the candidates, a block whose
        problem has this problem's shape (a variant with other literals) wins over a closer other one,
        because its method is the one that transfers."""
        if not self.mem.get_all(kind=self.kind):
            return None  # nothing to route to: do not load the embedding model
        _, shape = literals(problem)
        best: Optional[tuple[Block, float]] = None
        for h in self.mem.search(problem, top_k=5):
            if h.kind != self.kind or h.block_id == exclude or h.score < self.min_score:
                continue
            try:
                b = self.mem.get(h.block_id)
            except BlockNotFound:
                continue
            if b.metadata.get("verified") is not True:
                continue
            if b.metadata.get("shape") == shape:
                return b, h.score
            if best is None:
                best = (b, h.score)
        return best

    def _answer_from_block(self, block: Block, problem: str) -> tuple[Attempt, Receipt]:
        cont = self.fmt.continuation(f"Problem: {problem}") + ANSWER_LEAD
        r = self.mem.ask(block.id, cont, max_tokens=self.max_answer_tokens)
        ans = extract_answer(r.text)
        v = self.verify(problem, Candidate(answer=ans, program=block.metadata.get("program")))
        return Attempt(method="graft", answer=ans, verified=v.ok, reason=v.reason, tokens=r.receipt.decode_tokens,
                       ms=r.receipt.restore_ms + r.receipt.prefill_ms + r.receipt.decode_ms,
                       block_id=block.id), r.receipt

    def _run(self, program: str) -> tuple[Optional[str], str]:
        run = run_program(program, timeout_s=self.program_timeout_s)
        if not run.ok:
            why = "timed out" if run.timed_out else (run.stderr.strip().splitlines() or ["failed"])[-1][:160]
            return None, f"program did not run: {why}"
        return run.answer, "ran"

    def _substitute(self, block: Block, problem: str) -> Optional[Attempt]:
        program = block.metadata.get("program")
        if not program:
            return None
        t0 = time.perf_counter()
        old, old_shape = block.metadata.get("literals") or [], block.metadata.get("shape")
        new, shape = literals(problem)
        if old_shape is not None and shape != old_shape:
            return Attempt(method="substitution", answer=None, verified=False, block_id=block.id,
                           reason="not a variant: the problem's shape differs from the block's",
                           ms=(time.perf_counter() - t0) * 1e3)
        prog = substitute_literals(program, old, new)
        if prog is None:
            return Attempt(method="substitution", answer=None, verified=False, block_id=block.id,
                           reason="the literals do not pair up", ms=(time.perf_counter() - t0) * 1e3)
        ans, why = self._run(prog)
        if ans is None:
            return Attempt(method="substitution", answer=None, program=prog, verified=False, reason=why,
                           block_id=block.id, ms=(time.perf_counter() - t0) * 1e3)
        v = self.verify(problem, Candidate(answer=ans, program=prog))
        return Attempt(method="substitution", answer=ans, program=prog, verified=v.ok, reason=v.reason,
                       block_id=block.id, ms=(time.perf_counter() - t0) * 1e3)

    def _adapt(self, block: Block, problem: str) -> tuple[Attempt, Optional[Receipt]]:
        t0 = time.perf_counter()
        lead = program_lead(block.metadata.get("program"))
        cont = self.fmt.continuation(f"Problem: {problem}") + "Method (Python program):\n" + lead
        r = self.mem.ask(block.id, cont, max_tokens=self.max_program_tokens)
        prog = extract_program(lead + r.text)
        n = r.receipt.decode_tokens
        if prog is None:
            return Attempt(method="adaptation", answer=None, verified=False, tokens=n, block_id=block.id,
                           reason="the model wrote no runnable program", ms=(time.perf_counter() - t0) * 1e3), r.receipt
        ans, why = self._run(prog)
        if ans is None:
            return Attempt(method="adaptation", answer=None, program=prog, verified=False, reason=why, tokens=n,
                           block_id=block.id, ms=(time.perf_counter() - t0) * 1e3), r.receipt
        v = self.verify(problem, Candidate(answer=ans, program=prog))
        return Attempt(method="adaptation", answer=ans, program=prog, verified=v.ok, reason=v.reason, tokens=n,
                       block_id=block.id, ms=(time.perf_counter() - t0) * 1e3), r.receipt

    def _check_model_answer(self, problem: str, answer: Optional[str]) -> Attempt:
        if answer is None:
            return Attempt(method="model", answer=None, verified=False, reason="the model gave no answer")
        v = self.verify(problem, Candidate(answer=answer))
        return Attempt(method="model", answer=answer, verified=v.ok, reason=v.reason, ms=v.ms)

    def _run_solver(self, problem: str, budget: int) -> Attempt:
        assert self.solver is not None
        t0 = time.perf_counter()
        ok, out = call_with_timeout(lambda: self.solver(problem, budget), max(self.verify_timeout_s, 60.0))  # type: ignore[misc]
        ms = lambda: (time.perf_counter() - t0) * 1e3  # noqa: E731
        if not ok:
            return Attempt(method="solver", answer=None, verified=False, reason=f"solver {out}", ms=ms())
        if out is None:
            return Attempt(method="solver", answer=None, verified=False, reason="the solver gave up", ms=ms())
        if not isinstance(out, SolverOutput):
            try:
                out = SolverOutput.model_validate(out)
            except ValueError as exc:
                return Attempt(method="solver", answer=None, verified=False, ms=ms(),
                               reason=f"the solver returned {type(out).__name__}, not SolverOutput: {exc}")
        ans = out.answer
        if ans is None and out.program:
            ans, why = self._run(out.program)
            if ans is None:
                return Attempt(method="solver", answer=None, program=out.program, verified=False, reason=why,
                               tokens=out.tokens, ms=ms())
        v = self.verify(problem, Candidate(answer=ans, program=out.program))
        return Attempt(method="solver", answer=ans, program=out.program, verified=v.ok, reason=v.reason,
                       tokens=out.tokens, ms=ms())

    # ------------------------------------------------------------------ the model alone
    def _ask_model(self, problem: str, g: Gate, budget: int) -> tuple[GateReport, list[tuple[Optional[str], int]]]:
        """``g.samples`` answers of the model without any block: one prefill, then per sample trim
        back to the prompt (restore its state, on a model with recurrent layers) and decode from its
        logits (greedy first, then seeded temperature)."""
        eng = self.mem.engine
        t0 = time.perf_counter()
        text = self.fmt.continuation(f"{problem}\n{self.answer_hint}" if self.answer_hint else problem)
        ptok = eng.tokenize(text)
        out: list[tuple[Optional[str], int]] = []
        greedy_lp = 0.0
        total = 0
        with eng.session():
            eng.prefill(ptok)
            first = eng.logits()
            # a memory that cannot be trimmed (recurrent layers) is rewound by restoring the prompt's state
            prompt_state = None if eng.memory.trims or g.samples < 2 else eng.capture_copy()
            calls = eng.one_token_calls()
            for i in range(g.samples):
                n_max = min(g.max_tokens, budget - total)
                if n_max < 1:
                    break
                if i and prompt_state is not None:
                    eng.restore(memoryview(prompt_state), len(ptok), calls["from"] if calls else None)
                elif i:
                    eng.trim(len(ptok))
                rng = np.random.default_rng([g.seed, i])
                dec = decode(eng, n_max, first_logits=first, rng=rng,
                             sampling=Sampling(temperature=0.0 if i == 0 else g.temperature))
                toks = dec.tokens
                total += len(toks)
                if i == 0:  # the end-of-generation token's log-probability counts too
                    greedy_lp = (dec.logprob + (dec.stop_logprob or 0.0)) / max(1, len(toks))
                out.append((extract_answer(eng.detokenize(toks)), len(toks)))
        answers = [a for a, _ in out]
        norm = [normalize_answer(a) for a in answers]
        counts = Counter(x for x in norm if x is not None)
        majority, top = (counts.most_common(1)[0] if counts else (None, 0))
        agreement = top / len(out) if out else 0.0
        rep = GateReport(answers=answers, majority=majority, agreement=agreement, greedy_logprob=greedy_lp,
                         confident=bool(majority is not None and agreement >= g.agree and len(out) == g.samples),
                         tokens=total, ms=(time.perf_counter() - t0) * 1e3)
        return rep, out

    # ------------------------------------------------------------------ deposit
    def _deposit(self, problem: str, att: Attempt) -> Optional[str]:
        """Learn a verified solution as a block. Refuses anything not verified (defence in depth: the
        callers only pass verified attempts)."""
        if not att.verified or att.answer is None:
            log.error("flywheel: refusing to deposit an unverified solution for %r", problem[:60])
            return None
        lits, shape = literals(problem)
        meta = {
            "problem": problem, "key": normalize_task(problem), "answer": att.answer, "program": att.program,
            "literals": lits, "shape": shape, "verifier": self.verifier_name, "verified": True,
            "verified_at": datetime.now(timezone.utc).isoformat(), "method": att.method,
        }
        block = self.mem.learn(block_text(problem, att.program, att.answer, self.verifier_name, self.fmt),
                               name=f"solution: {' '.join(problem.split())[:60]}", kind=self.kind,
                               metadata=meta, when_to_use=problem, chat=True)
        log.info("flywheel: deposited block %s for %r", block.short_id, problem[:60])
        return block.id
