"""The `x-ratelimit-*` response headers, as OpenAI sends them, from the limiter's buckets.

OpenAI reports one limit for requests and one for tokens. Here a caller may be limited at several
levels at once (key, user, tenant, app); each header pair reports the tightest of them: the bucket
with the least remaining, then the smallest limit, then the narrowest level. Resets are how long
until that bucket is full again, written as OpenAI writes them ("20ms", "1s", "6m0s": Go's
duration format).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from policy.limits import LIMIT_LEVELS, LimitState

WHATS = ("requests", "tokens")


def tightest(states: Iterable[LimitState], what: str) -> LimitState | None:
    candidates = [s for s in states if s.what == what]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (math.floor(max(0.0, s.remaining)), s.limit_per_minute, LIMIT_LEVELS.index(s.level)))


def duration_text(seconds: float) -> str:
    """Go's time.Duration format at millisecond precision, rounded up so a caller that waits this
    long finds the bucket full: 0s, 20ms, 1s, 1.5s, 6m0s, 1h2m3.25s."""
    if not math.isfinite(seconds):
        seconds = 24 * 3600.0  # a limit of zero never refills; a day stands in for "not soon"
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def rate_limit_headers(states: Iterable[LimitState]) -> dict[str, str]:
    """`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the kinds that have a limit."""
    states = tuple(states)
    headers: dict[str, str] = {}
    for what in WHATS:
        state = tightest(states, what)
        if state is None:
            continue
        headers[f"x-ratelimit-limit-{what}"] = str(state.limit_per_minute)
        headers[f"x-ratelimit-remaining-{what}"] = str(math.floor(max(0.0, state.remaining)))
        headers[f"x-ratelimit-reset-{what}"] = duration_text(state.reset_s)
    return headers
