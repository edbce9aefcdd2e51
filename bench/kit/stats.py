"""Percentiles, medians and spreads of measured figures, the one copy every bench prints with."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Literal


def percentile(values: Sequence[float], q: float, *, method: Literal["linear", "nearest"] = "linear") -> float | None:
    """The q-quantile (0..1) of `values`, None when there are none. "linear" interpolates between the
    closest ranks (numpy's default); "nearest" returns the value at the nearest rank, always one that
    was measured (the economics bench's latencies)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    if method == "nearest":
        return xs[min(len(xs) - 1, max(0, round(pos)))]
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (the mean of the middle two for an even count)."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def spread(values: Iterable[float | None], digits: int = 0) -> str:
    """`min-max` of the values that are not None, or `-`."""
    xs = [v for v in values if v is not None]
    return f"{min(xs):.{digits}f}-{max(xs):.{digits}f}" if xs else "-"
