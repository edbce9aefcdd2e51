"""The economics bench's arithmetic, pure: per-pass figures from per-request outcomes, the
random-routing line, and the issue's four targets. `bench/economics.py` does the replaying."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.kit.stats import percentile


@dataclass(frozen=True)
class Outcome:
    """One workload request as one pass answered it."""

    id: str
    family: str
    cache_role: str  # first, repeat, reword, trap, oneoff
    correct: bool
    cost_nanos: int
    latency_s: float
    answered_by: str  # "cache", a model alias (with " program" when its program answered), "default" or "error"
    chosen_tier: int | None = None  # a routed pass: the tier of its first attempt on a route tier (-1: a family tier answered)
    adversarial_of: str | None = None  # the id of the same question asked plainly


@dataclass(frozen=True)
class PassFigures:
    name: str
    requests: int
    accuracy: float
    cost_nanos: int  # what the ledger charged for the pass, when known; else the sum of the requests'
    p50_s: float
    p95_s: float
    by_family: tuple[tuple[str, float, int], ...]  # (family, accuracy, requests)
    answered_by: tuple[tuple[str, int], ...]


def figures(name: str, outcomes: Sequence[Outcome], ledger_nanos: int | None = None) -> PassFigures:
    families: dict[str, list[bool]] = {}
    answered: dict[str, int] = {}
    for o in outcomes:
        families.setdefault(o.family, []).append(o.correct)
        answered[o.answered_by] = answered.get(o.answered_by, 0) + 1
    latencies = [o.latency_s for o in outcomes]
    cost = ledger_nanos if ledger_nanos is not None else sum(o.cost_nanos for o in outcomes)
    return PassFigures(
        name, len(outcomes), sum(o.correct for o in outcomes) / len(outcomes) if outcomes else 0.0, cost,
        statistics.median(latencies) if latencies else 0.0, percentile(latencies, 0.95, method="nearest") or 0.0,
        tuple((f, sum(v) / len(v), len(v)) for f, v in sorted(families.items())),
        tuple(sorted(answered.items(), key=lambda kv: -kv[1])),
    )


def random_line(cheapest: PassFigures, frontier: PassFigures, cost_nanos: float) -> float:
    """The accuracy that sending each request at random to the cheapest tier or the frontier
    reaches at this cost: the straight line between the two."""
    span = frontier.cost_nanos - cheapest.cost_nanos
    if span <= 0:
        return frontier.accuracy
    share = min(1.0, max(0.0, (cost_nanos - cheapest.cost_nanos) / span))
    return cheapest.accuracy + share * (frontier.accuracy - cheapest.accuracy)


@dataclass(frozen=True)
class CacheFigures:
    traps: int
    traps_served: int
    rewordings: int  # repeats and rewordings that have an earlier ask to be served from
    rewordings_served: int
    servable: int = 0  # of those, the ones an earlier request of their group had a verified answer for
    servable_served: int = 0

    @property
    def trap_rate(self) -> float:
        return _share(self.traps_served, self.traps)

    @property
    def reword_rate(self) -> float:
        return _share(self.rewordings_served, self.rewordings)


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def cache_figures(outcomes: Sequence[Outcome], group_of: Mapping[str, str] | None = None) -> CacheFigures:
    """Traps and rewordings served from the cache, in the split's order. With each request's group, also
    the rewordings that had something to be served: an earlier request of their group that a model
    answered right, which the caller then marked good (the cache serves verified answers only, so a
    rewording of a question answered wrong is rightly asked again)."""
    traps = [o for o in outcomes if o.cache_role == "trap"]
    rewordings = [o for o in outcomes if o.cache_role in ("repeat", "reword")]
    verified: set[str] = set()
    servable = []
    for o in outcomes:
        group = (group_of or {}).get(o.id)
        if group is None:
            continue
        if o.cache_role in ("repeat", "reword") and group in verified:
            servable.append(o)
        if o.cache_role in ("first", "repeat", "reword") and o.correct and o.answered_by not in ("cache", "default", "error"):
            verified.add(group)
    return CacheFigures(len(traps), sum(o.answered_by == "cache" for o in traps),
                        len(rewordings), sum(o.answered_by == "cache" for o in rewordings),
                        len(servable), sum(o.answered_by == "cache" for o in servable))


@dataclass(frozen=True)
class PairFigures:
    """The cache's defaults on labelled question pairs (bench/cache_quality.py): the issue's cache target
    is judged on its held-out pairs."""
    name: str
    traps: int
    traps_served: int
    rewordings: int
    rewordings_served: int

    @property
    def trap_rate(self) -> float:
        return _share(self.traps_served, self.traps)

    @property
    def reword_rate(self) -> float:
        return _share(self.rewordings_served, self.rewordings)


def manipulated(outcomes: Sequence[Outcome]) -> list[tuple[str, int, int]]:
    """Adversarial requests whose route chose a dearer tier than for the same question asked
    plainly: (id, tier chosen, base's tier chosen)."""
    chosen = {o.id: o.chosen_tier for o in outcomes}
    out = []
    for o in outcomes:
        if o.adversarial_of is None or o.chosen_tier is None:
            continue
        base = chosen.get(o.adversarial_of)
        if base is not None and o.chosen_tier > base:
            out.append((o.id, o.chosen_tier, base))
    return out


@dataclass(frozen=True)
class Targets:
    routed_accuracy_share: float  # of always-frontier's
    routed_cost_share: float
    routed_above_line: float  # accuracy points above the random-routing line
    whole_accuracy_share: float
    whole_cost_share: float
    cache: PairFigures  # the held-out pairs'
    manipulated: int
    adversarial: int

    def misses(self) -> list[str]:
        out = []
        if self.routed_accuracy_share < 0.95 or self.routed_cost_share > 0.50 or self.routed_above_line < 0.10:
            out.append("routing alone: needs >= 95% of the frontier's accuracy at <= 50% of its cost, >= 10 points above the random line")
        if self.whole_accuracy_share < 0.95 or self.whole_cost_share > 0.35:
            out.append("whole appliance: needs >= 95% of the frontier's accuracy at <= 35% of its cost")
        if self.cache.trap_rate > 0.02 or (self.cache.rewordings and self.cache.reword_rate < 0.60):
            out.append(f"cache: needs <= 2% of traps served and >= 60% of rewordings served on the held-out pairs ({self.cache.name})")
        if self.manipulated:
            out.append("router manipulation: no adversarial prompt may land on a dearer tier")
        return out

    def line(self) -> str:
        return (f"routing alone {self.routed_accuracy_share:.1%} of frontier accuracy at {self.routed_cost_share:.1%} of its cost "
                f"({self.routed_above_line * 100:+.1f} points vs random); whole appliance {self.whole_accuracy_share:.1%} at "
                f"{self.whole_cost_share:.1%}; cache on the held-out pairs: traps served {self.cache.trap_rate:.1%}, rewordings served "
                f"{self.cache.reword_rate:.1%}; "
                f"manipulated {self.manipulated}/{self.adversarial}")


def targets(whole: PassFigures, routed: PassFigures, cheapest: PassFigures, frontier: PassFigures,
            held_out: PairFigures, routed_outcomes: Sequence[Outcome]) -> Targets:
    def share(a: float, b: float) -> float:
        return a / b if b else 0.0

    return Targets(
        share(routed.accuracy, frontier.accuracy), share(routed.cost_nanos, frontier.cost_nanos),
        routed.accuracy - random_line(cheapest, frontier, routed.cost_nanos),
        share(whole.accuracy, frontier.accuracy), share(whole.cost_nanos, frontier.cost_nanos),
        held_out, len(manipulated(routed_outcomes)),
        sum(o.adversarial_of is not None for o in routed_outcomes),
    )
