"""The decisions about upstream servers, pure: a circuit breaker per upstream, which upstream takes
the next request, and whether a failed attempt may be retried.

The engine holds the state and the clock; these functions only compute the next state, so they
are tested without a network.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerPolicy:
    failures_to_open: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 30.0  # how long an open breaker refuses before one probe may pass


@dataclass(frozen=True)
class Breaker:
    """Closed: requests pass. Open: they fail at once, without touching the network, until the
    cooldown has passed. Half open: exactly one probe is let through; its outcome closes the
    breaker or opens it for another cooldown."""

    state: BreakerState = "closed"
    failures: int = 0  # consecutive, while closed
    opened_at: float = 0.0
    probing: bool = False  # half open with the probe in flight

    def reopens_at(self, policy: BreakerPolicy) -> float:
        return self.opened_at + policy.cooldown_s


def may_pass(breaker: Breaker, policy: BreakerPolicy, now: float) -> bool:
    """Would a request be let through now (without claiming the probe)?"""
    if breaker.state == "closed":
        return True
    if breaker.state == "open":
        return now >= breaker.reopens_at(policy)
    return not breaker.probing


def admit(breaker: Breaker, policy: BreakerPolicy, now: float) -> Breaker | None:
    """The breaker after letting one request through, or None when it refuses. A request let
    through an open breaker past its cooldown is the half-open probe."""
    if not may_pass(breaker, policy, now):
        return None
    if breaker.state == "closed":
        return breaker
    return replace(breaker, state="half_open", probing=True)


def succeeded(breaker: Breaker) -> Breaker:
    return Breaker()


def failed(breaker: Breaker, policy: BreakerPolicy, now: float) -> Breaker:
    if breaker.state == "closed":
        failures = breaker.failures + 1
        if failures >= policy.failures_to_open:
            return Breaker("open", failures, now)
        return replace(breaker, failures=failures)
    return Breaker("open", breaker.failures + 1, now)


def released(breaker: Breaker) -> Breaker:
    """A probe that ended without a verdict (the caller went away): the next request may probe."""
    return replace(breaker, probing=False) if breaker.state == "half_open" else breaker


@dataclass(frozen=True)
class Candidate:
    """One upstream of an alias as the balancer sees it."""

    outstanding: int  # requests this process has in flight there
    passes: bool  # its breaker would let a request through
    healthy: bool = True  # the last health check answered (unknown counts as healthy)


def pick(candidates: Sequence[Candidate], exclude: frozenset[int] = frozenset(), turn: int = 0) -> int | None:
    """Least outstanding requests among the upstreams whose breakers pass, preferring those whose
    health check answered; `exclude` holds upstreams this request already failed on (used only
    when nothing else is left), and `turn` rotates ties so equal upstreams share the load."""
    n = len(candidates)
    order = [(turn + k) % n for k in range(n)] if n else []
    for allowed in (lambda i: i not in exclude, lambda i: True):
        for wants_healthy in (True, False):
            best: int | None = None
            for i in order:
                c = candidates[i]
                if not c.passes or not allowed(i) or (wants_healthy and not c.healthy):
                    continue
                if best is None or c.outstanding < candidates[best].outstanding:
                    best = i
            if best is not None:
                return best
    return None


FailureKind = Literal["connect", "timeout", "overloaded", "server", "client", "broken_stream"]


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    backoff_s: float = 0.25  # the first retry's delay; doubles per retry, with jitter
    backoff_max_s: float = 4.0


def counts_against_upstream(kind: FailureKind) -> bool:
    """A caller's bad request (4xx) says nothing about the upstream's health."""
    return kind != "client"


def may_retry(kind: FailureKind, attempt: int, streamed: bool, policy: RetryPolicy) -> bool:
    """Retry only where the caller cannot tell: nothing has been streamed to it yet, and the
    failure was the upstream's or the network's, not the request's. `attempt` counts from 1."""
    if streamed or kind in ("client", "broken_stream"):
        return False
    return attempt <= policy.max_retries


def backoff(attempt: int, policy: RetryPolicy, rng: random.Random | None = None, retry_after_s: float | None = None) -> float:
    """Seconds to wait before retry number `attempt` (from 1): exponential with full jitter, and
    never shorter than an upstream's Retry-After (capped at backoff_max_s, since a caller waits)."""
    ceiling = min(policy.backoff_max_s, policy.backoff_s * (2 ** (attempt - 1)))
    delay = (rng or random).uniform(ceiling / 2, ceiling)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, policy.backoff_max_s))
    return delay


def classify_status(status: int) -> FailureKind:
    if status in (408, 429, 503):
        return "overloaded"
    if status >= 500:
        return "server"
    return "client"
