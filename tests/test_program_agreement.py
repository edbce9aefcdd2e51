"""bench/program_agreement.py's cascade: two cheap programs that agree stand, anything else is the
frontier's, and the cheap pair is paid for either way."""

from __future__ import annotations

from bench.program_agreement import Program, cascade, number

FRONTIER = Program("18", True, 100)


def test_an_agreed_number_stands_even_when_wrong_and_the_frontier_is_not_paid() -> None:
    got = cascade([(Program("7", False, 10), Program("7", False, 12), FRONTIER)])
    assert (got.agree, got.right_where_agreed, got.right, got.cost) == (1, 0, 0, 22)


def test_a_disagreement_or_a_program_that_did_not_evaluate_asks_the_frontier() -> None:
    problems = [(Program("7", False, 10), Program("8", False, 10), FRONTIER),
                (Program(None, False, 10), Program(None, False, 10), FRONTIER)]
    got = cascade(problems)
    assert (got.agree, got.right, got.cost) == (0, 2, 240)


def test_the_number_is_the_evaluated_program_s_and_none_where_it_does_not_evaluate() -> None:
    assert number("```python\neggs = 16 - 3 - 4\nanswer = eggs * 2\n```") == "18"
    assert number("```python\nimport os\nanswer = os.getpid()\n```") is None
