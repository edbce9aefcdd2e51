"""bench/family_threshold.py's replay of a cascade on top of a route's choices: pure arithmetic over
stored answers, so that a threshold chosen from it means what the route would do."""

from __future__ import annotations

from bench.family_threshold import replay

TIERS = ("small", "mid", "big")
# each item's stored answer per tier: (right, nano-dollars)
TAUGHT = {
    "sure": {"small": (False, 1), "mid": (True, 10), "big": (True, 100)},
    "unsure": {"small": (False, 1), "mid": (False, 10), "big": (True, 100)},
    "cheap": {"small": (True, 1), "mid": (True, 10), "big": (True, 100)},
    "other": {"small": (False, 1), "mid": (False, 10), "big": (False, 100)},
}
# the cascade tier's own answer, asked with log-probabilities
ROWS = [
    {"id": "sure", "family": "factual", "confidence": 0.9, "correct": True, "cost": 10},
    {"id": "unsure", "family": "factual", "confidence": 0.5, "correct": False, "cost": 10},
    {"id": "cheap", "family": "factual", "confidence": 0.2, "correct": True, "cost": 10},
    {"id": "other", "family": "gsm8k", "confidence": 0.99, "correct": True, "cost": 10},
]
CHOSEN = {"sure": 2, "unsure": 2, "cheap": 0, "other": 2}


def test_no_cascade_is_the_routes_own_answers() -> None:
    assert replay(ROWS, TAUGHT, CHOSEN, TIERS, 1, {}) == (3, 100 + 100 + 1 + 100)


def test_the_cascade_tier_answers_first_only_where_the_route_chose_dearer() -> None:
    # sure: the middle tier's answer stands (10); unsure: it is asked, then the frontier (10 + 100);
    # cheap: the route chose below the cascade tier and keeps its own answer; other: not this family
    assert replay(ROWS, TAUGHT, CHOSEN, TIERS, 1, {"factual": 0.8}) == (1 + 1 + 1 + 0, 10 + 110 + 1 + 100)
    # a threshold nothing reaches only adds the cascade tier's cost
    assert replay(ROWS, TAUGHT, CHOSEN, TIERS, 1, {"factual": 1.0}) == (3, 110 + 110 + 1 + 100)
    # the gsm8k item's sure answer stands though it is right where the route's was not
    assert replay(ROWS, TAUGHT, CHOSEN, TIERS, 1, {"gsm8k": 0.5}) == (4, 100 + 100 + 1 + 10)
