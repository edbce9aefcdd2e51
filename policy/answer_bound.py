"""The answer cache's error bound, pure: from the scores of question pairs known to need different
answers (traps), the lowest score cut at which the cache can still promise that at most a set share
of traps is served, at 95% confidence, and its own estimate of that share.

A false hit rate here is the share of traps served: what an operator's `max_false_hit_rate` bounds.
The bound is a one-sided Clopper-Pearson interval over the known traps, so with few traps nothing
can be promised and the cut stays closed (a cold cache serves exact repeats only, never a guess).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# One-sided: the chance that the true share is above the reported upper bound.
ALPHA = 0.05


def _log_binomial_cdf(k: int, n: int, p: float) -> float:
    """log P(X <= k) for X ~ Binomial(n, p), summed in log space (n runs to thousands)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 0.0 if k >= n else -math.inf
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


def upper_bound(k: int, n: int, alpha: float = ALPHA) -> float:
    """Clopper-Pearson: the largest share p with P(X <= k | n, p) >= alpha; 1.0 with no trials."""
    if n <= 0 or k >= n:
        return 1.0
    low, high, target = k / n, 1.0, math.log(alpha)
    for _ in range(60):  # bisection to about 1e-18: the CDF falls as p rises
        mid = (low + high) / 2
        if _log_binomial_cdf(k, n, mid) >= target:
            low = mid
        else:
            high = mid
    return high


@dataclass(frozen=True)
class Cut:
    """Serve a candidate only with a score above `score` (-inf: any score; inf: none)."""

    score: float
    traps: int  # known traps in the pool
    served: int  # of them, how many score above the cut
    bound: float  # the promised share (the setting)

    @property
    def estimate(self) -> float:
        """The share of traps served, by the rule of succession ((k + 1) / (n + 2)): the cut is set where
        few known traps pass it, so k / n reads low on traps it never saw, and 0 would claim too much."""
        return (self.served + 1) / (self.traps + 2)

    @property
    def upper(self) -> float:
        return upper_bound(self.served, self.traps)

    def admits(self, score: float) -> bool:
        return score > self.score


def most_served(n: int, bound: float, alpha: float = ALPHA) -> int:
    """The largest k with upper_bound(k, n) <= bound; -1 when even k = 0 is too many (n too small).
    Galloping from 0, as k is usually a small share of n and each try costs O(k)."""
    if n <= 0 or upper_bound(0, n, alpha) > bound:
        return -1
    low, step = 0, 1  # upper_bound rises with k: low is allowed, find a high that is not
    while low + step < n and upper_bound(low + step, n, alpha) <= bound:
        low, step = low + step, step * 2
    high = min(low + step, n)
    while high - low > 1:
        mid = (low + high) // 2
        if upper_bound(mid, n, alpha) <= bound:
            low = mid
        else:
            high = mid
    return low


def cut_for(trap_scores: list[float], bound: float, alpha: float = ALPHA) -> Cut:
    """The lowest cut that serves at most `most_served` of the known traps. Scores of traps a hard
    rule refused are -inf and count in the pool (they are traps the cache did not serve)."""
    scores = sorted(trap_scores, reverse=True)
    n, k = len(scores), most_served(len(scores), bound, alpha)
    if k < 0:
        return Cut(math.inf, n, 0, bound)
    if k >= n:
        return Cut(-math.inf, n, n, bound)
    # Strictly above the (k+1)-th highest: ties with it are refused, so no more than k are served.
    cut = scores[k]
    served = sum(1 for s in scores if s > cut)
    return Cut(cut, n, served, bound)


def served_share(trap_scores: list[float], cut: float) -> tuple[int, int]:
    """(traps scoring above the cut, traps): what a cut would have served of a pool."""
    ordered = sorted(trap_scores)
    return len(ordered) - bisect.bisect_right(ordered, cut), len(ordered)
