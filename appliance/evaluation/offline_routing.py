"""What a route would have done on a stored run's questions, without a model call: every tier's
answer to every question is stored (`eval_answers`), and a routed answer is the chosen tier's answer
(greedy decoding; docs/performance.md found them equal question by question), so any way of choosing
a tier can be scored from the table. Escalations after a failed validation are not modelled: the
figures are the first choice's. Pure; the CLI (`appliance eval simulate`, `appliance eval calibrate`)
reads the rows and embeds the questions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from policy.router import ALL_FEATURES, HEURISTIC_FEATURES, Calibration, Features, decide, decide_calibrated
from policy.router_knn import Knn, cheapest_within, estimate


@dataclass(frozen=True)
class Row:
    """One question: each tier's result on it, cheapest tier first. `correct` may be a probability
    (an expected outcome, from a bucket's measured accuracy) as well as 0 or 1."""
    features: Features
    correct: tuple[float, ...]
    cost_nanos: tuple[float, ...]


@dataclass(frozen=True)
class Figures:
    name: str
    accuracy: float
    cost_nanos: float  # mean per question
    cost_vs_frontier: float | None
    accuracy_vs_frontier: float | None
    random_line: float | None  # accuracy of routing at random between the cheapest and the frontier tier at this cost
    above_random_line: float | None
    shares: tuple[float, ...]  # of questions sent to each tier


def point(rows: Sequence[Row], chosen: Sequence[int]) -> tuple[float, float]:
    """Mean accuracy and cost per question when question i goes to tier chosen[i]."""
    if not rows:
        return 0.0, 0.0
    return (sum(r.correct[t] for r, t in zip(rows, chosen)) / len(rows), sum(r.cost_nanos[t] for r, t in zip(rows, chosen)) / len(rows))


def figures(name: str, rows: Sequence[Row], chosen: Sequence[int]) -> Figures:
    tiers = len(rows[0].correct) if rows else 0
    accuracy, cost = point(rows, chosen)
    cheap_acc, cheap_cost = point(rows, [0] * len(rows))
    top_acc, top_cost = point(rows, [tiers - 1] * len(rows))
    span = top_cost - cheap_cost
    line = cheap_acc + (top_acc - cheap_acc) * (cost - cheap_cost) / span if span > 0 else None
    shares = tuple(sum(1 for t in chosen if t == tier) / len(chosen) for tier in range(tiers)) if chosen else ()
    return Figures(name, round(accuracy, 4), round(cost, 1), round(cost / top_cost, 4) if top_cost else None,
                   round(accuracy / top_acc, 4) if top_acc else None, round(line, 4) if line is not None else None,
                   round(accuracy - line, 4) if line is not None else None, tuple(round(s, 4) for s in shares))


def manipulated(refs: Sequence[str], adversarial_of: Sequence[str | None], chosen: Sequence[int]) -> list[tuple[str, int, int]]:
    """(ref, its tier, its plain question's tier) for each manipulated copy routed dearer than the
    question it copies (when that question is in the set too)."""
    tier_of = dict(zip(refs, chosen))
    return [(ref, tier, tier_of[base]) for ref, base, tier in zip(refs, adversarial_of, chosen)
            if base is not None and base in tier_of and tier > tier_of[base]]


def heuristic_choices(rows: Sequence[Row], use: tuple[str, ...] = HEURISTIC_FEATURES) -> list[int]:
    tiers = len(rows[0].correct) if rows else 0
    return [decide(r.features, tiers, use=use).tier for r in rows]


def calibrated_choices(rows: Sequence[Row], calibration: Calibration, vectors: np.ndarray | None) -> list[int]:
    """The route's own decision for each row (kNN, then buckets, then heuristics), as it would be served."""
    tiers = len(calibration.tiers)
    return [decide_calibrated(r.features, tiers, calibration, vectors[i] if vectors is not None else None).tier for i, r in enumerate(rows)]


def leave_one_out(knn: Knn, keep: float) -> list[int | None]:
    """Each labelled request's tier from the others alone (None where too few neighbours remain):
    the table's own held-out estimate of what it learned."""
    chosen: list[int | None] = []
    for i in range(knn.samples):
        found = estimate(knn, knn.vectors[i], knn.features[i], leave_out=i)
        chosen.append(cheapest_within(found.accuracy, keep) if found.neighbours >= knn.settings.min_neighbours else None)
    return chosen


def knn_rows(knn: Knn) -> list[Row]:
    """The table's own questions as rows (features are not needed to score a choice)."""
    blank = Features(0, False, 0, 0, False, 0, 0.0, False)
    return [Row(blank, tuple(float(c) for c in knn.correct[i]), tuple(float(c) for c in knn.cost_nanos[i])) for i in range(knn.samples)]


# -- which heuristic features predict ----------------------------------------------------------------

@dataclass(frozen=True)
class FeatureValue:
    """A heuristic feature against measured outcomes. Where the feature changes the heuristics' tier
    (the `moved` questions, against the same heuristics without it), is the tier it picks right more
    often? A feature that moves questions without picking better answers spends for nothing."""
    name: str
    moved: int
    accuracy_gain: float | None  # mean, over the moved questions, of correct(with) - correct(without)
    cost_added: float | None  # mean over the moved questions, nano-dollars
    predicts: bool | None  # None: it moved too few questions to tell


def feature_values(rows: Sequence[Row], use: tuple[str, ...] = ALL_FEATURES, min_n: int = 5, margin: float = 0.05) -> list[FeatureValue]:
    """Each feature of `use`, taken out of `use` in turn. It predicts when the tiers it moves questions
    to answer at least `margin` more of them correctly than the tiers they had without it."""
    full = heuristic_choices(rows, use)
    found = []
    for name in use:
        without = heuristic_choices(rows, tuple(n for n in use if n != name))
        moved = [i for i, (a, b) in enumerate(zip(full, without)) if a != b]
        if not moved:
            found.append(FeatureValue(name, 0, None, None, None))
            continue
        gain = sum(rows[i].correct[full[i]] - rows[i].correct[without[i]] for i in moved) / len(moved)
        cost = sum(rows[i].cost_nanos[full[i]] - rows[i].cost_nanos[without[i]] for i in moved) / len(moved)
        found.append(FeatureValue(name, len(moved), round(gain, 4), round(cost, 1), gain > margin if len(moved) >= min_n else None))
    return found


def kept(values: Sequence[FeatureValue]) -> tuple[str, ...]:
    """The features to score with: those that predict, and those the set could not measure (no evidence
    against them); a measured feature that does not predict is dropped."""
    return tuple(v.name for v in values if v.predicts is not False)
