"""A STAND-IN for a stronger solver: a deterministic program generator for the problem families of
problems.py. It plays the role the paper gives to extra inference (a larger model, best-of-many,
a program-writing model): something expensive that can solve what the 135M model cannot. It is not a
model and does not pretend to be one; its "tokens" are the length of the program it writes, counted
with the engine's tokenizer, i.e. the least a model would have to decode to write the same program.

It knows the families' shapes, not their answers: it writes a program, the flywheel runs it in the
sandbox, and the verifier checks the printed answer, as it would check a real model's program.
"""

from __future__ import annotations

from typing import Callable, Optional

from graftmem import SolverOutput
from graftmem.memory import literals

from problems import FAMILIES, program


def make_solver(count_tokens: Callable[[str], int]) -> Callable[[str, int], Optional[SolverOutput]]:
    shapes = {}
    for f in FAMILIES:
        lits, shape = literals(f.template.format(*f.instances[0]))
        shapes[shape] = f

    def solve(problem: str, budget: int) -> Optional[SolverOutput]:
        lits, shape = literals(problem)
        fam = shapes.get(shape)
        if fam is None:
            return None
        import ast

        args = tuple(ast.literal_eval(x) for x in lits)
        src = program(fam, args)
        n = count_tokens(src)
        if n > budget:
            return None
        return SolverOutput(program=src, tokens=n, name="template-program-generator (stand-in)")

    return solve
