"""policy/programs.py: a model's program is data, so only straight-line arithmetic is evaluated,
every value and step bounded, and anything else is refused without running it."""

from __future__ import annotations

import time

import pytest

from policy.programs import LARGEST, NotStraightLine, number_text, program_of, reply, straight_line, wants_program


def test_straight_line_arithmetic_gives_its_answer() -> None:
    assert straight_line("trays = 2\neggs = trays * 24\neggs -= 10\nanswer = round(eggs / 4, 1)") == 9.5
    assert straight_line("x = 7\nprint(-x + max(3, 4) ** 2)") == 9.0  # no `answer`: the last print
    assert straight_line("a = b = 3\nanswer = a % 2 + b // 2") == 2.0
    assert straight_line("# comments are fine\nanswer = int(7.9) + abs(-1) + float(2) + min(1, 2)") == 11.0
    # without `answer`, the last step that gives a number: an assignment, a bare expression
    assert straight_line("total = 3\nleft = total - 1") == 2.0
    assert straight_line("500\n3 * 500\n500 + 3 * 500 + 500 / 4") == 2125.0


def test_worked_equations_are_computed_not_believed() -> None:
    assert straight_line("52 - 4 = 48\n48 / 2 = 24") == 24.0
    assert straight_line("36 - 11 - 4 = 19") == 21.0  # the model's sum was wrong; the step is what counts
    assert straight_line("x = 4\nx * 3 = 12") == 12.0


@pytest.mark.parametrize(("code", "why"), [
    ("import os\nanswer = 1", "not a straight-line step"),
    ("answer = __import__('os').getpid()", "not arithmetic"),
    ("for i in range(3):\n    x = i\nanswer = x", "not a straight-line step"),
    ("def f():\n    return 1\nanswer = f()", "not a straight-line step"),
    ("answer = (1).bit_length()", "not arithmetic"),
    ("answer = [1, 2][0]", "not arithmetic"),
    ("answer = 'forty'", "not a number"),
    ("answer = True", "not a number"),
    ("answer = 1e400", "out of range"),
    ("answer = unknown + 1", "not arithmetic"),
    ("answer = 10 ** 10 ** 9", "a power out of range"),
    ("answer = 0 ** -1", "a power out of range"),
    ("answer = 1 / 0", "ZeroDivisionError"),
    ("answer = round(1, 2, 3)", "round: "),
    ("answer = print(1)", "not arithmetic"),
    ("'''just words'''", "no step gives a number"),
    ("52 - 4 = 48\nimport os", "not a straight-line step"),
    ("answer = = 3", "not Python"),
    ("answer = 1\x00", "not Python"),
    ("x = 1\n" * 201 + "answer = x", "more than 200 steps"),
])
def test_anything_else_is_refused_unrun(code: str, why: str) -> None:
    with pytest.raises(NotStraightLine, match=why):
        straight_line(code)


def test_a_program_that_grows_its_numbers_stops_at_the_bound_and_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(NotStraightLine, match="out of range"):
        straight_line("x = 10\n" + "x = x * x\n" * 60 + "answer = x")
    with pytest.raises(NotStraightLine, match="out of range"):
        straight_line(f"answer = {int(LARGEST) * 10}")
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("code", [
    "answer = " + "-" * 1200 + "1",  # a tier can be steered into copying it: RecursionError in the walk
    "answer = " + "-" * 5000 + "1",  # ... and in the parser
    "answer = " + "-" * 19000 + "1",  # ... where the parser gives up with MemoryError
    "answer = " + "1 + " * 1200 + "1",
    "x = 1\n" + "#" * 30000,
])
def test_a_program_beyond_the_evaluators_bounds_is_refused_never_an_error(code: str) -> None:
    started = time.monotonic()
    with pytest.raises(NotStraightLine):
        straight_line(code)
    assert time.monotonic() - started < 1.0


def test_a_long_sum_within_the_bounds_still_evaluates() -> None:
    assert straight_line("answer = " + " + ".join(["1"] * 50)) == 50.0


def test_the_program_is_the_first_fenced_block() -> None:
    assert program_of("Here:\n```python\nanswer = 1\n```\nand ```python\nanswer = 2\n```") == "answer = 1\n"
    assert program_of("answer = 3") == "answer = 3"


def test_the_reply_shows_the_program_and_the_number() -> None:
    assert number_text(42.0) == "42" and number_text(2.5) == "2.5" and number_text(1 / 3) == "0.3333333333"
    assert reply("answer = 6 * 7\n\n", 42.0) == "```python\nanswer = 6 * 7\n```\nAnswer: 42"


def test_only_a_listed_family_asking_for_plain_text_gets_a_program() -> None:
    assert wants_program(("gsm8k",), {"family": "gsm8k"}, plain_text=True)
    assert not wants_program(("gsm8k",), {"family": "gsm8k"}, plain_text=False)
    assert not wants_program(("gsm8k",), {"family": "factual"}, plain_text=True)
    assert not wants_program(("gsm8k",), None, plain_text=True) and not wants_program((), {"family": "gsm8k"}, plain_text=True)


def test_a_reason_is_one_line_and_names_the_bound_itself() -> None:
    with pytest.raises(NotStraightLine) as caught:
        straight_line("x = 10 ** 10\nx = x * x\nanswer = x * x")
    assert str(caught.value) == "a number out of range"
    with pytest.raises(NotStraightLine) as caught:
        straight_line("def f(n):\n    return n\nanswer = f(1)")
    assert "\n" not in str(caught.value)
