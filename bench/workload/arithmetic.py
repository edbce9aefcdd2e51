"""Arithmetic and short word problems made by code from a fixed seed, each with its exact answer
and a near-miss twin (one number changed, so another answer) that the cache must not serve."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    name: str
    text: Callable[..., str]
    solve: Callable[..., int]
    ranges: dict[str, tuple[int, int]]
    bump: str  # the parameter a trap raises by one


PERCENTS = (5, 10, 15, 20, 25, 50, 75)
TEMPLATES = (
    Template("add", lambda a, b: f"What is {a} + {b}?", lambda a, b: a + b, {"a": (100, 999), "b": (100, 999)}, "b"),
    Template("subtract", lambda a, b: f"What is {a} - {b}?", lambda a, b: a - b, {"a": (500, 999), "b": (100, 499)}, "b"),
    Template("multiply", lambda a, b: f"What is {a} times {b}?", lambda a, b: a * b, {"a": (12, 99), "b": (3, 19)}, "b"),
    Template("divide", lambda b, q: f"What is {b * q} divided by {b}?", lambda b, q: q, {"b": (3, 12), "q": (11, 60)}, "q"),
    # a multiple of 20 keeps every one of these percentages whole
    Template("percent", lambda i, k: f"What is {PERCENTS[i]}% of {20 * k}?", lambda i, k: PERCENTS[i] * 20 * k // 100,
             {"i": (0, len(PERCENTS) - 1), "k": (1, 20)}, "k"),
    Template("brackets", lambda a, b, c: f"What is ({a} + {b}) times {c}?", lambda a, b, c: (a + b) * c,
             {"a": (5, 30), "b": (5, 30), "c": (2, 9)}, "c"),
    Template("boxes", lambda a, b: f"A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b,
             {"a": (6, 24), "b": (3, 15)}, "b"),
    Template("stickers",
             lambda a, b: f"Tom had {a} stickers and gave {b} of them to his sister. How many stickers does he have left?",
             lambda a, b: a - b, {"a": (30, 90), "b": (5, 29)}, "b"),
    Template("train", lambda a, b: f"A train travels at {a} km per hour for {b} hours. How many kilometres does it travel?",
             lambda a, b: a * b, {"a": (40, 120), "b": (2, 6)}, "b"),
    Template("notebooks", lambda a, b: f"A notebook costs ${a}. How many dollars do {b} notebooks cost?", lambda a, b: a * b,
             {"a": (2, 9), "b": (4, 15)}, "b"),
    Template("groups", lambda g, q: f"{g * q} students are split into groups of {g}. How many groups are there?",
             lambda g, q: q, {"g": (3, 8), "q": (4, 12)}, "q"),
    Template("pages", lambda a, b: f"Anna reads {a} pages a day. How many pages does she read in {b} days?", lambda a, b: a * b,
             {"a": (10, 40), "b": (3, 14)}, "b"),
    Template("parking",
             lambda a, b, c: (f"A parking lot has {a} cars. {b} more cars arrive and then {c} cars leave. "
                              "How many cars are in the lot now?"),
             lambda a, b, c: a + b - c, {"a": (20, 60), "b": (5, 30), "c": (3, 19)}, "b"),
    Template("bakery",
             lambda a, b: (f"A bakery bakes {a} loaves in the morning and has {b} left at closing time. "
                           "How many loaves did it sell?"),
             lambda a, b: a - b, {"a": (40, 120), "b": (2, 15)}, "b"),
)


@dataclass(frozen=True)
class Problem:
    key: str
    template: str
    question: str
    answer: int
    trap_question: str
    trap_answer: int


def _render(template: Template, params: dict[str, int]) -> tuple[str, int]:
    return template.text(**params), template.solve(**params)


def problems(count: int, seed: int) -> list[Problem]:
    """`count` problems, the templates taking turns; no question or trap appears twice; the same
    seed gives the same list."""
    rng = random.Random(seed)
    found: list[Problem] = []
    seen: set[str] = set()
    while len(found) < count:
        template = TEMPLATES[len(found) % len(TEMPLATES)]
        params = {name: rng.randint(lo, hi) for name, (lo, hi) in template.ranges.items()}
        question, answer = _render(template, params)
        # a trap changes one number, which changes the answer in every template
        bumped = {**params, template.bump: params[template.bump] + 1}
        trap_question, trap_answer = _render(template, bumped)
        if question in seen or trap_question in seen:  # no trap may be another problem's question
            continue
        seen.update((question, trap_question))
        found.append(Problem(f"arith-{len(found) + 1:03d}", template.name, question, answer, trap_question, trap_answer))
    return found
