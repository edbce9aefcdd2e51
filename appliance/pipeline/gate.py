"""The policy front door of every model call: who is calling (identity), may they now (rate
limits), can they pay (budget reservation), and, when the response ends for any reason, the
settlement that charges the actual tokens exactly once.

The decisions live in `policy/`; this module wires them to the store thread and the lease reaper,
and owns the in-memory state of one process (key cache, buckets, live requests). A refusal (401,
403, 429) is an APIError, which imports nothing of HTTP: the HTTP layer writes it in the envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from appliance.config.settings import Settings
from appliance.pipeline.errors import APIError
from appliance.server.metrics import Metrics
from appliance.store.keys import FailureTally, KeyStore
from appliance.store.ledger import Ledger, Payer, settle_logged, sweep
from appliance.store.worker import StoreWorker
from policy.budgets import Price, Refuse, Reserve, ReservationPolicy, dollars, seconds_until_reset, usd
from policy.identity import AuthFailure, KeyRecord, Principal, bearer_token, check_key, fingerprint, secret_hash
from policy.limits import RateLimiter

log = logging.getLogger("appliance.gate")

FAILURE_RETENTION_S = 30 * 86400  # failed sign-in attempts kept for a month
# Failed sign-ins are counted in memory and written once a second (one write, not one per attempt),
# in at most FAILURE_BUCKETS rows a flush; the table keeps the newest MAX_FAILURE_ROWS rows.
FAILURE_FLUSH_S = 1.0
FAILURE_BUCKETS = 1000
MAX_FAILURE_ROWS = 100_000


@dataclass
class Admission:
    """One admitted model call, from reservation to settlement."""

    request_id: str
    principal: Principal
    model: str
    estimated_tokens: int
    reserved: bool
    max_tokens: int
    settled: bool = False
    # The rate limiter still holds this call's estimate: cleared by the one settlement that gives it back.
    limited: bool = True
    # Completions this call reserved for (a request's `n`): max_tokens is per completion.
    choices: int = 1
    # Tokens known so far, for a settlement the response never reached (shutdown).
    progress: Callable[[], tuple[int, int]] | None = field(default=None, repr=False)


@dataclass
class Pending:
    """An admission whose budget reservation the store thread is still making."""

    admission: Admission
    reservation: Future[Reserve | Refuse] | None
    at: float


class Gate:
    def __init__(self, settings: Settings, worker: StoreWorker, metrics: Metrics) -> None:
        self.settings = settings
        self.worker = worker
        self.metrics = metrics
        self.limiter = RateLimiter(settings.limits)
        self._keys: dict[str, tuple[KeyRecord, float]] = {}  # secret hash → (record, looked up at)
        self._live: dict[str, Admission] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._failures = FailureTally(FAILURE_BUCKETS)
        self._failure_flush: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._policy = ReservationPolicy(settings.budgets.clamp_max_tokens, settings.budgets.min_tokens)
        metrics.reservations_open.set_function(lambda: len(self._live))
        auth = settings.auth
        self._open = None
        if auth.mode == "open":
            p = auth.open_principal
            self._open = Principal(p.user, p.tenant, p.app, p.role, None, p.admin)

    # -- identity ------------------------------------------------------------------------------

    async def authenticate(self, authorization: str | None, client: str | None, path: str) -> Principal:
        if self._open is not None:
            return self._open
        token = bearer_token(authorization)
        if isinstance(token, AuthFailure):
            raise self._refuse(token, None, None, client, path)
        digest = secret_hash(token)
        now = time.time()
        cached = self._keys.get(digest)
        if cached is not None and now - cached[1] < self.settings.auth.key_cache_s:
            record: KeyRecord | None = cached[0]
        else:
            record = await self.worker.run(lambda db: KeyStore(db).by_secret(token))
            if record is not None:
                self._keys[digest] = (record, now)
            else:
                self._keys.pop(digest, None)
        checked = check_key(record, now)
        if isinstance(checked, AuthFailure):
            raise self._refuse(checked, record.id if record else None, fingerprint(token), client, path)
        return checked

    def forget_key(self, key_id: str) -> None:
        """A key changed through the admin API: stop trusting the cached copy at once."""
        for digest, (record, _) in list(self._keys.items()):
            if record.id == key_id:
                del self._keys[digest]

    def _refuse(self, failure: AuthFailure, key_id: str | None, print_: str | None, client: str | None, path: str) -> APIError:
        self.metrics.auth_failures.labels(failure.reason).inc()
        log.warning("refused a request to %s from %s: %s key (id %s, fingerprint %s)", path, client, failure.reason, key_id, print_)
        self._failures.add(time.time(), failure.reason, key_id, print_, client, path)
        if self._failure_flush is None:
            self._failure_flush = asyncio.get_running_loop().call_later(FAILURE_FLUSH_S, self.flush_failures)
        return APIError(401, failure.message, code="invalid_api_key")

    def flush_failures(self) -> None:
        """Writes the failed sign-ins counted so far; a read submitted after this sees them."""
        if self._failure_flush is not None:
            self._failure_flush.cancel()
            self._failure_flush = None
        counts = self._failures.take()
        if counts:
            self.worker.submit(lambda db: KeyStore(db).record_failures(counts, MAX_FAILURE_ROWS))

    @staticmethod
    def require_admin(principal: Principal) -> None:
        if not principal.admin:
            raise APIError(403, "This endpoint needs an admin key.", type="permission_error", code="admin_required")

    # -- admission and settlement --------------------------------------------------------------

    def begin(self, principal: Principal, request_id: str, model: str, price: Price, prompt_tokens: int, max_tokens: int,
              choices: int = 1) -> Pending:
        """Rate limits (raising 429 at once), then the budget reservation, sent to the store thread
        without waiting: the caller may start the engine meanwhile and `await` the result before
        any token leaves. `choices` completions of up to max_tokens each share the one prompt."""
        estimate = prompt_tokens + choices * max_tokens
        now = time.time()
        self._limit(principal, estimate, now)
        admission = Admission(request_id, principal, model, estimate, False, max_tokens, choices=choices)
        if not self.settings.budgets.enabled:
            return Pending(admission, None, now)
        payer = Payer(principal.user, principal.tenant, principal.app)
        lease, policy = self.settings.budgets.lease_s, self._policy
        future = self.worker.submit(
            lambda db: Ledger(db).reserve(request_id, payer, model, price, prompt_tokens, choices * max_tokens, policy, now, lease))
        return Pending(admission, future, now)

    def _limit(self, principal: Principal, estimate: int, now: float) -> None:
        limited = self.limiter.admit(principal, estimate, now)
        if limited is not None:
            self.metrics.rate_limited.labels(limited.level, limited.what).inc()
            raise APIError(
                429,
                f"Rate limit reached for {limited.level} '{limited.name}': {limited.limit_per_minute} {limited.what} per minute. "
                f"Retry in {limited.retry_after_s} s.",
                type="rate_limit_error", code="rate_limit_exceeded", retry_after_s=limited.retry_after_s,
            )

    @contextlib.contextmanager
    def request_only(self, principal: Principal) -> Iterator[None]:
        """A call that renders and tokenizes but generates nothing (count_tokens): one request from
        the caller's request buckets, no tokens and no budget; given back if the work fails."""
        self._limit(principal, 0, time.time())
        try:
            yield
        except BaseException:
            self.limiter.refund(principal, 0, time.time())
            raise

    async def admitted(self, pending: Pending) -> Admission:
        """The reservation's outcome: the admission (max_tokens perhaps lowered), or a 429."""
        admission = pending.admission
        if pending.reservation is None:
            return admission
        try:
            decision = await asyncio.wrap_future(pending.reservation)
        except BaseException:
            # A cancelled wait must not leak a reservation the store thread still makes.
            self._unlimit(admission)
            pending.reservation.add_done_callback(lambda f: self._release_if_reserved(admission, f))
            raise
        if isinstance(decision, Refuse):
            self._unlimit(admission)
            self.metrics.budget_refused.labels(decision.level).inc()
            raise self._over_budget(decision, pending.at)
        admission.reserved = True
        # A lowered reservation is shared evenly by the choices.
        admission.max_tokens = max(1, decision.max_tokens // admission.choices)
        self._live[admission.request_id] = admission
        return admission

    def abandon(self, pending: Pending) -> None:
        """The call failed before it could use its reservation (the engine refused it): the rate
        limiter gets its estimate back now, whatever the store decides; the reservation is released
        once the store has made it, without waiting here."""
        admission = pending.admission
        self._unlimit(admission)
        if pending.reservation is None:
            admission.settled = True
            return
        pending.reservation.add_done_callback(lambda f: self._release_if_reserved(admission, f))

    def _unlimit(self, admission: Admission) -> None:
        """A refused call leaves every bucket as it found it: its whole estimate goes back, once."""
        if admission.limited:
            admission.limited = False
            self.limiter.refund(admission.principal, admission.estimated_tokens, time.time())

    def _release_if_reserved(self, admission: Admission, future: Any) -> None:
        """Runs on the store thread (a done callback): hands the release back to the loop."""
        if future.cancelled() or future.exception() is not None or not isinstance(future.result(), Reserve):
            return
        admission.reserved = True
        if self._loop is None:
            self.settle(admission, 0, 0, "refused")
        else:
            self._loop.call_soon_threadsafe(self.settle, admission, 0, 0, "refused")

    async def admit(self, principal: Principal, request_id: str, model: str, price: Price, prompt_tokens: int, max_tokens: int) -> Admission:
        return await self.admitted(self.begin(principal, request_id, model, price, prompt_tokens, max_tokens))

    @staticmethod
    def _over_budget(refusal: Refuse, now: float) -> APIError:
        name = "" if refusal.level == "global" else f" '{refusal.name}'"
        return APIError(
            429,
            f"The {refusal.period} budget of {refusal.level}{name} cannot cover this request: {dollars(refusal.remaining_nanos)} "
            f"remains, {dollars(refusal.needed_nanos)} is needed. Lower max_tokens or raise the budget.",
            type="insufficient_quota", code="budget_exceeded", retry_after_s=seconds_until_reset(refusal.period, now),
        )

    def settle(self, admission: Admission, prompt_tokens: int, completion_tokens: int, outcome: str) -> None:
        """Exactly once per admission, whatever ended the response; never waits on the store."""
        if admission.settled:
            return
        admission.settled = True
        self._live.pop(admission.request_id, None)
        now = time.time()
        if outcome == "refused":
            self._unlimit(admission)
        elif admission.limited:
            admission.limited = False
            self.limiter.settle(admission.principal, admission.estimated_tokens, prompt_tokens + completion_tokens, now)
        if not admission.reserved:
            return

        future = self.worker.submit(lambda db: settle_logged(db, admission.request_id, prompt_tokens, completion_tokens, outcome, now))
        future.add_done_callback(self._count_spend(admission.model))

    def _count_spend(self, model: str) -> Callable[[Any], None]:
        def done(future: Any) -> None:
            settlement = None if future.cancelled() or future.exception() else future.result()
            if settlement is not None and not settlement.already:
                self.metrics.spend_usd.labels(model).inc(usd(settlement.charged_nanos))
        return done

    # -- leases --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.settings.budgets.enabled:
            return
        await self._sweep()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="lease-reaper")

    async def _reap_forever(self) -> None:
        interval = max(0.5, self.settings.budgets.lease_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._sweep()
            except Exception:
                log.exception("lease sweep failed")

    async def _sweep(self) -> None:
        """Renew the leases of this process's live requests, then release every expired one."""
        now = time.time()
        live = list(self._live)
        until = now + self.settings.budgets.lease_s

        released = await self.worker.run(lambda db: sweep(db, live, until, now, now - FAILURE_RETENTION_S))
        if released:
            log.warning("released %d expired budget reservations: %s", len(released), ", ".join(s.request_id for s in released))
            self.metrics.leases_expired.inc(len(released))

    async def close(self) -> None:
        self.flush_failures()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        # Responses still open at shutdown are settled with what they had generated.
        for admission in list(self._live.values()):
            prompt, completion = admission.progress() if admission.progress else (0, 0)
            self.settle(admission, prompt, completion, "shutdown")

    def live_request_ids(self) -> list[str]:
        return list(self._live)

