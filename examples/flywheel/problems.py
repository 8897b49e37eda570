"""The flywheel's problem set: 10 families x 3 instances (the 30 problems of run 1 and run 2) plus one
held-out variant per family with new numbers (the transfer set). Answers are computed here, in plain
Python, so they are known exactly; they are what the ExactMatch verifier compares with.

Each family also has a *reference program*: what the stand-in solver (solver.py) emits. Problems avoid
apostrophes so that quoted strings are unambiguous literals (see graftmem.memory.flywheel.literals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    template: str                      # str.format template of the problem
    program: str                       # str.format template of the reference program (prints the answer)
    answer: Callable[..., object]      # the known answer, computed directly
    instances: tuple[tuple, ...]       # run 1 / run 2 problems
    variants: tuple[tuple, ...]        # held-out: same shape, new literals


FAMILIES: tuple[Family, ...] = (
    Family("multiply", "What is {} * {}?", "print({} * {})", lambda a, b: a * b,
           ((17, 23), (46, 38), (125, 12)), ((19, 42),)),
    Family("add", "What is {} + {}?", "print({} + {})", lambda a, b: a + b,
           ((345, 678), (1289, 4567), (999, 999)), ((528, 794),)),
    Family("subtract", "What is {} - {}?", "print({} - {})", lambda a, b: a - b,
           ((1000, 357), (842, 399), (5003, 1248)), ((731, 456),)),
    Family("apples", "Tom has {} apples and buys {} bags with {} apples in each bag. How many apples does Tom have now?",
           "print({} + {} * {})", lambda a, b, c: a + b * c,
           ((12, 3, 5), (7, 4, 9), (30, 6, 8)), ((15, 7, 6),)),
    Family("train", "A train travels at {} km per hour for {} hours. How many km does it travel?",
           "print({} * {})", lambda a, b: a * b,
           ((85, 7), (120, 13), (64, 9)), ((95, 11),)),
    Family("letters", "How many times does the letter '{}' appear in the word '{}'?",
           "print({!r}.count({!r}))", None,  # filled below: the program swaps the argument order
           (("r", "strawberry"), ("s", "mississippi"), ("e", "cheeseburger")), (("o", "chocolate"),)),
    Family("divisible", "How many whole numbers from {} to {} inclusive are divisible by {}?",
           "print(len([n for n in range({}, {} + 1) if n % {} == 0]))",
           lambda a, b, c: len([n for n in range(a, b + 1) if n % c == 0]),
           ((1, 100, 7), (50, 250, 9), (10, 99, 4)), ((20, 180, 6),)),
    Family("minutes", "How many minutes are there in {} hours and {} minutes?", "print({} * 60 + {})",
           lambda a, b: a * 60 + b, ((3, 25), (7, 48), (12, 5)), ((9, 37),)),
    Family("sum_range", "What is the sum of the whole numbers from {} to {}?", "print(sum(range({}, {} + 1)))",
           lambda a, b: sum(range(a, b + 1)), ((1, 50), (1, 120), (1, 77)), ((1, 64),)),
    Family("square", "What is {} squared?", "print({} ** 2)", lambda a: a * a,
           ((37,), (112,), (95,)), ((58,),)),
)


def _letters_answer(ch: str, word: str) -> int:
    return word.count(ch)


def problem(f: Family, args: tuple) -> str:
    return f.template.format(*args)


def program(f: Family, args: tuple) -> str:
    if f.name == "letters":
        ch, word = args
        return f.program.format(word, ch) + "\n"
    return f.program.format(*args) + "\n"


def answer(f: Family, args: tuple) -> str:
    if f.name == "letters":
        return str(_letters_answer(*args))
    return str(f.answer(*args))


def problem_set() -> list[dict]:
    """The 30 problems of runs 1 and 2: family, problem text, known answer."""
    return [{"family": f.name, "problem": problem(f, a), "answer": answer(f, a)}
            for f in FAMILIES for a in f.instances]


def variants() -> list[dict]:
    """The held-out variants (new numbers, same shape): the transfer set."""
    return [{"family": f.name, "problem": problem(f, a), "answer": answer(f, a)}
            for f in FAMILIES for a in f.variants]


# Problems the 135M model already answers correctly on its own: the do-no-harm set for the gate.
EASY: tuple[dict, ...] = (
    {"family": "easy", "problem": "What is 2 + 2?", "answer": "4"},
    {"family": "easy", "problem": "What is 3 + 5?", "answer": "8"},
    {"family": "easy", "problem": "What is 10 + 10?", "answer": "20"},
    {"family": "easy", "problem": "What is 1 + 1?", "answer": "2"},
)


def answers() -> dict[str, str]:
    """Every known answer (problem set, variants, easy set), for the ExactMatch verifier."""
    return {p["problem"]: p["answer"] for p in problem_set() + variants() + list(EASY)}
