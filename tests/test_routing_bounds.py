"""bench/routing_bounds.py's bounds: pure choices over stored answers, so that a ceiling it prints is
what the stored answers allow."""

from __future__ import annotations

import numpy as np

from appliance.evaluation.offline_routing import Row, point  # noqa: E402
from bench.routing_bounds import cut, oracle, per_family, pinned, with_programs
from policy.router import Features  # noqa: E402
from policy.router_knn import train  # noqa: E402

BLANK = Features(0, False, 0, 0, False, 0, 0.0, False)


def row(*correct: bool) -> Row:
    return Row(BLANK, tuple(float(c) for c in correct), (1.0, 10.0, 100.0))


def test_the_oracle_pays_for_the_cheapest_right_tier_and_nothing_for_a_lost_answer() -> None:
    rows = [row(False, True, True), row(False, False, True), row(True, True, True), row(False, False, False)]
    chosen = [oracle(r) for r in rows]
    assert chosen == [1, 2, 0, 0]
    assert point(rows, chosen) == (0.75, (10 + 100 + 1 + 1) / 4)


def test_a_pinned_family_goes_to_its_tier_whatever_the_route_chose() -> None:
    assert pinned(["gsm8k", "factual", "gsm8k"], lambda i: 2, {"gsm8k": 1}) == [1, 2, 1]
    assert pinned(["factual"], lambda i: 0, {}) == [0]


def test_one_tier_per_family_loses_at_most_the_slack_in_each() -> None:
    rows = [row(False, True, True), row(False, False, True), row(True, True, True), row(False, True, False)]
    families = ["a", "a", "b", "b"]
    assert per_family(rows, families, 0) == {"a": 2, "b": 0}  # b: the cheapest is as right as the frontier
    assert per_family(rows, families, 1) == {"a": 1, "b": 0}


def test_a_cut_table_keeps_its_rows_together() -> None:
    knn = train(np.eye(3, dtype=np.float32), np.ones((3, 9), dtype=np.float32), np.array([[1, 0], [0, 1], [1, 1]]),
                np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), ("x", "y", "z"), "e")
    kept = cut(knn, np.array([0, 2]))
    assert kept.texts == ("x", "z") and kept.samples == 2
    assert kept.correct.tolist() == [[True, False], [True, True]] and kept.cost_nanos[:, 1].tolist() == [2.0, 6.0]
    assert kept.vectors[1].tolist() == [0.0, 0.0, 1.0]


def test_a_program_that_does_not_evaluate_pays_for_the_worked_answer_too() -> None:
    rows = [row(False, False, True), row(False, False, True), row(False, True, True), row(True, True, True)]
    chosen = [2, 2, 1, 0]
    programs = [(False, 40), ("no step gives a number", 30), (True, 5), None]  # the last family is not asked for a program
    right, cost = with_programs(rows, chosen, programs)
    assert right == 0 + 1 + 1 + 1  # a wrong program stands; the refused one's worked answer is right
    assert cost == 40 + (30 + 100) + 5 + 1
