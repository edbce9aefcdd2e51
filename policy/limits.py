"""Rate limits: token buckets for requests and tokens per minute, per key, user, tenant and app.

The bucket arithmetic is pure (`Bucket.take`, `Bucket.give`); `RateLimiter` keeps the buckets of
one process in memory, which is where rate limits belong (short windows, reset by a restart).
A request is admitted only if every level admits it, so a refusal at one level charges none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from policy.identity import Principal

LIMIT_LEVELS = ("key", "user", "tenant", "app")


@dataclass(frozen=True)
class Bucket:
    capacity: float
    per_second: float
    level: float
    at: float

    @staticmethod
    def full(capacity: float, per_minute: float, now: float) -> Bucket:
        return Bucket(capacity, per_minute / 60.0, capacity, now)

    def refilled(self, now: float) -> Bucket:
        if now <= self.at:
            return self
        return replace(self, level=min(self.capacity, self.level + (now - self.at) * self.per_second), at=now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be taken; 0 if it can be now. A full bucket admits anything,
        going into debt, so a request larger than the capacity is slow, not impossible."""
        if self.level >= amount or self.level >= self.capacity:
            return 0.0
        need = min(amount, self.capacity) - self.level
        return need / self.per_second if self.per_second > 0 else math.inf

    def take(self, amount: float) -> Bucket:
        return replace(self, level=self.level - amount)

    def give(self, amount: float) -> Bucket:
        return replace(self, level=min(self.capacity, self.level + amount))

    def until_full(self) -> float:
        """Seconds until the bucket is back to its capacity (OpenAI's "reset")."""
        if self.level >= self.capacity:
            return 0.0
        return (self.capacity - self.level) / self.per_second if self.per_second > 0 else math.inf


@dataclass(frozen=True)
class LimitRule:
    level: str  # key, user, tenant, app
    name: str  # "*": each one of that level separately
    requests_per_minute: int | None
    tokens_per_minute: int | None


@dataclass(frozen=True)
class Limited:
    level: str
    name: str
    what: str  # "requests" or "tokens"
    limit_per_minute: int
    retry_after_s: int


@dataclass(frozen=True)
class LimitState:
    """One bucket as a caller may see it: its per-minute limit, what remains now, and the seconds
    until it is full again."""

    level: str
    name: str
    what: str  # "requests" or "tokens"
    limit_per_minute: int
    remaining: float
    reset_s: float


def rule_for(rules: tuple[LimitRule, ...], level: str, name: str) -> LimitRule | None:
    """An exact name beats the level's `*` rule."""
    exact = next((r for r in rules if r.level == level and r.name == name), None)
    return exact or next((r for r in rules if r.level == level and r.name == "*"), None)


def principal_names(principal: Principal) -> tuple[tuple[str, str], ...]:
    return (("key", principal.key_id or "open"), ("user", principal.user), ("tenant", principal.tenant), ("app", principal.app))


class RateLimiter:
    """Not thread-safe: used from the event loop only."""

    def __init__(self, rules: tuple[LimitRule, ...]) -> None:
        self.rules = rules
        self._buckets: dict[tuple[str, str, str], Bucket] = {}

    def admit(self, principal: Principal, estimated_tokens: int, now: float) -> Limited | None:
        """Charge one request and the token estimate at every level, or refuse naming the level."""
        charges: list[tuple[tuple[str, str, str], Bucket, int]] = []
        for level, name in principal_names(principal):
            rule = rule_for(self.rules, level, name)
            if rule is None:
                continue
            for what, per_minute, amount in (("requests", rule.requests_per_minute, 1), ("tokens", rule.tokens_per_minute, estimated_tokens)):
                if per_minute is None:
                    continue
                key = (level, name, what)
                bucket = self._buckets.get(key) or Bucket.full(per_minute, per_minute, now)
                bucket = bucket.refilled(now)
                wait = bucket.wait_for(amount)
                if wait > 0:
                    return Limited(level, name, what, per_minute, max(1, math.ceil(wait)))
                charges.append((key, bucket, amount))
        for key, bucket, amount in charges:
            self._buckets[key] = bucket.take(amount)
        return None

    def settle(self, principal: Principal, estimated_tokens: int, actual_tokens: int, now: float) -> None:
        """Correct the token buckets once the real count is known (give back what was unused)."""
        unused = estimated_tokens - actual_tokens
        if unused == 0:
            return
        for level, name in principal_names(principal):
            key = (level, name, "tokens")
            bucket = self._buckets.get(key)
            if bucket is not None:
                bucket = bucket.refilled(now)
                self._buckets[key] = bucket.give(unused) if unused > 0 else bucket.take(-unused)

    def refund(self, principal: Principal, estimated_tokens: int, now: float) -> None:
        """A request refused after admission (the engine or the budget said no) gives back its
        request and its whole estimate: a refusal leaves every bucket as it found it."""
        for level, name in principal_names(principal):
            for what, amount in (("requests", 1), ("tokens", estimated_tokens)):
                key = (level, name, what)
                bucket = self._buckets.get(key)
                if bucket is not None:
                    self._buckets[key] = bucket.refilled(now).give(amount)

    def states(self, principal: Principal, now: float) -> tuple[LimitState, ...]:
        """Every bucket that applies to this principal, as of `now`; a bucket never charged is full."""
        out = []
        for level, name in principal_names(principal):
            rule = rule_for(self.rules, level, name)
            if rule is None:
                continue
            for what, per_minute in (("requests", rule.requests_per_minute), ("tokens", rule.tokens_per_minute)):
                if per_minute is None:
                    continue
                bucket = (self._buckets.get((level, name, what)) or Bucket.full(per_minute, per_minute, now)).refilled(now)
                out.append(LimitState(level, name, what, per_minute, bucket.level, bucket.until_full()))
        return tuple(out)

    def level_of(self, level: str, name: str, what: str, now: float) -> float | None:
        bucket = self._buckets.get((level, name, what))
        return None if bucket is None else bucket.refilled(now).level
