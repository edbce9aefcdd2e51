"""Token buckets and key checks, as plain functions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policy.identity import AuthFailure, KeyRecord, Principal, bearer_token, check_key, fingerprint, new_secret, secret_hash
from policy.limits import Bucket, LimitRule, RateLimiter, rule_for

ANN = Principal("ann", "acme", "web", "dev", "key_1")


@given(st.integers(1, 1000), st.lists(st.tuples(st.floats(0, 30), st.integers(0, 2000)), max_size=40))
def test_a_bucket_never_holds_more_than_its_capacity(capacity: int, steps: list[tuple[float, int]]) -> None:
    bucket, now = Bucket.full(capacity, capacity, 0.0), 0.0
    for dt, amount in steps:
        now += dt
        bucket = bucket.refilled(now)
        assert bucket.level <= capacity
        if bucket.wait_for(amount) == 0:
            bucket = bucket.take(amount)
        else:
            # waiting the advertised time is enough
            assert bucket.refilled(now + bucket.wait_for(amount) + 1e-6).wait_for(amount) == 0


def test_requests_per_minute_refuses_then_refills() -> None:
    limiter = RateLimiter((LimitRule("key", "*", 2, None),))
    assert limiter.admit(ANN, 10, 0.0) is None
    assert limiter.admit(ANN, 10, 0.0) is None
    refused = limiter.admit(ANN, 10, 0.0)
    assert refused is not None and (refused.level, refused.what) == ("key", "requests") and refused.retry_after_s == 30
    assert limiter.admit(ANN, 10, 30.0) is None


def test_a_refusal_at_one_level_charges_no_level() -> None:
    limiter = RateLimiter((LimitRule("user", "*", None, 1000), LimitRule("tenant", "acme", None, 100)))
    assert limiter.admit(ANN, 60, 0.0) is None
    refused = limiter.admit(ANN, 60, 0.0)
    assert refused is not None and refused.level == "tenant" and refused.name == "acme"
    assert limiter.level_of("user", "ann", "tokens", 0.0) == 940  # charged for the first request only


def test_settlement_gives_back_the_unused_estimate() -> None:
    limiter = RateLimiter((LimitRule("tenant", "*", None, 1000),))
    assert limiter.admit(ANN, 800, 0.0) is None
    assert limiter.admit(ANN, 800, 0.0) is not None
    limiter.settle(ANN, 800, 100, 0.0)
    assert limiter.level_of("tenant", "acme", "tokens", 0.0) == 900
    assert limiter.admit(ANN, 800, 0.0) is None


def test_a_full_bucket_admits_a_request_larger_than_its_capacity() -> None:
    limiter = RateLimiter((LimitRule("app", "*", None, 100),))
    assert limiter.admit(ANN, 500, 0.0) is None  # into debt ...
    refused = limiter.admit(ANN, 1, 1.0)
    assert refused is not None and refused.retry_after_s >= 240  # ... paid back before the next


def test_an_exact_rule_beats_the_level_default() -> None:
    rules = (LimitRule("tenant", "*", 10, None), LimitRule("tenant", "acme", 1000, None))
    assert rule_for(rules, "tenant", "acme").requests_per_minute == 1000  # type: ignore[union-attr]
    assert rule_for(rules, "tenant", "zeta").requests_per_minute == 10  # type: ignore[union-attr]
    assert rule_for(rules, "user", "ann") is None


def _record(**overrides: object) -> KeyRecord:
    base = dict(id="key_1", user="ann", tenant="acme", app="web", role="dev", admin=False, created_at=0.0, expires_at=None, revoked_at=None)
    return KeyRecord(**{**base, **overrides})  # type: ignore[arg-type]


def test_key_checks() -> None:
    assert check_key(_record(), 10.0) == ANN
    assert isinstance(check_key(None, 10.0), AuthFailure)
    assert check_key(_record(revoked_at=5.0), 10.0).reason == "revoked"  # type: ignore[union-attr]
    assert check_key(_record(expires_at=10.0), 10.0).reason == "expired"  # type: ignore[union-attr]
    assert check_key(_record(expires_at=11.0), 10.0) == ANN
    assert check_key(_record(admin=True), 0.0).admin  # type: ignore[union-attr]


def test_bearer_parsing_and_secrets() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None).reason == "missing"  # type: ignore[union-attr]
    assert bearer_token("Basic abc").reason == "malformed"  # type: ignore[union-attr]
    key_id, secret = new_secret()
    assert key_id.startswith("key_") and secret.startswith("apl-") and len(secret) > 40
    assert secret_hash(secret) != secret and len(secret_hash(secret)) == 64
    assert secret not in fingerprint(secret) and len(fingerprint(secret)) == 12
