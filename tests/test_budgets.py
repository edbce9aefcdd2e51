"""Budget arithmetic and the SQLite ledger, without a server: properties over random operations."""

from __future__ import annotations

import threading

import apsw
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from appliance.store.db import connect, migrate
from policy.budgets import Account, Price, Refuse, Reserve, ReservationPolicy, Windows, plan_reservation, seconds_until_reset
from appliance.store.ledger import Ledger, LedgerError, Payer

prices = st.builds(Price, st.integers(0, 10**7), st.integers(0, 10**7))


@given(prices, st.integers(0, 10**5), st.integers(0, 10**5), st.integers(0, 10**5))
def test_cost_is_exact_rounded_up_and_monotonic(price: Price, prompt: int, completion: int, more: int) -> None:
    pico = prompt * price.input_pico_per_token + completion * price.output_pico_per_token
    cost = price.cost(prompt, completion)
    assert cost * 1000 >= pico > (cost - 1) * 1000 or pico == cost == 0
    assert price.cost(prompt, completion + more) >= cost
    assert price.cost(prompt + more, completion) >= cost


def test_price_per_million_converts_without_rounding() -> None:
    assert Price.per_million(0.15, 0.6) == Price(150_000, 600_000)
    # 1,000 input tokens at $0.15/M is $0.00015, 150,000 nano-dollars.
    assert Price.per_million(0.15, 0.6).cost(1000, 0) == 150_000


accounts = st.lists(
    st.builds(
        Account, st.sampled_from(["user", "tenant", "app", "global"]), st.text(min_size=1, max_size=3),
        st.one_of(st.none(), st.integers(0, 10**9)), st.sampled_from(["day", "month", "total"]),
        st.integers(0, 10**9), st.integers(0, 10**9),
    ),
    max_size=4,
)


@given(accounts, prices, st.integers(0, 5000), st.integers(1, 5000), st.booleans(), st.integers(1, 64))
def test_a_reservation_never_exceeds_what_any_level_has_left(
    accts: list[Account], price: Price, prompt: int, max_tokens: int, clamp: bool, min_tokens: int
) -> None:
    decision = plan_reservation(tuple(accts), price, prompt, max_tokens, ReservationPolicy(clamp, min_tokens))
    remaining = [a.remaining_nanos for a in accts if a.remaining_nanos is not None]
    if isinstance(decision, Reserve):
        assert all(decision.amount_nanos <= r for r in remaining)
        assert decision.amount_nanos == price.cost(prompt, decision.max_tokens)
        assert 1 <= decision.max_tokens <= max_tokens
        if decision.clamped:
            assert clamp and decision.max_tokens >= min(min_tokens, max_tokens)
            # clamped to the most the tightest level can pay for
            assert any(price.cost(prompt, decision.max_tokens + 1) > r for r in remaining)
        else:
            assert decision.max_tokens == max_tokens
    else:
        assert isinstance(decision, Refuse)
        assert any(price.cost(prompt, max_tokens) > r for r in remaining)
        assert decision.remaining_nanos == min(remaining)


def test_windows_and_resets() -> None:
    moment = 1_796_000_000.0  # 2026-11-30T00:53Z: the day and the month end together
    w = Windows.at(moment)
    assert w.keys() == (f"d:{w.day}", f"m:{w.month}", "t")
    assert seconds_until_reset("total", moment) is None
    assert 0 < (seconds_until_reset("day", moment) or 0) <= 86400
    assert (seconds_until_reset("day", moment) or 0) <= (seconds_until_reset("month", moment) or 0) <= 31 * 86400
    mid_month = 1_794_000_000.0  # 2026-11-06
    assert (seconds_until_reset("day", mid_month) or 0) < (seconds_until_reset("month", mid_month) or 0)
    assert Windows.at(mid_month) == Windows("2026-11-06", "2026-11")


def _ledger() -> Ledger:
    db = connect(":memory:")
    migrate(db)
    return Ledger(db)


PAYERS = [Payer("ann", "acme", "web"), Payer("bob", "acme", "cli"), Payer("cy", "zeta", "web")]
POLICY = ReservationPolicy(clamp=True, min_tokens=4)
NOW = 1_796_000_000.0


class LedgerMachine(RuleBasedStateMachine):
    """Random reserves, settlements, limit changes and lease expiries against the real ledger.
    Throughout: the ledger balances, and no limited level ever has spent + held above its limit."""

    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = _ledger()
        self.now = NOW
        self.counter = 0
        self.open: dict[str, tuple[int, int]] = {}  # request id -> (prompt, max_tokens)
        self.settled: dict[str, int] = {}  # request id -> charged
        self.price = Price(2_000, 5_000)

    @rule(level=st.sampled_from(["user", "tenant", "app", "global"]), who=st.sampled_from(PAYERS),
          usd_nanos=st.integers(0, 3_000_000), period=st.sampled_from(["day", "month", "total"]))
    def set_limit(self, level: str, who: Payer, usd_nanos: int, period: str) -> None:
        name = dict(who.levels())[level]
        # Only raise limits: lowering one below what is already spent is allowed but is not
        # an overshoot, so the invariant below would not hold by construction.
        spent, held = self.ledger.spent(level, name, period, self.now)
        self.ledger.set_limit(level, name, max(usd_nanos, spent + held), period, self.now)

    @rule(target=reservations, who=st.sampled_from(PAYERS), prompt=st.integers(0, 400), max_tokens=st.integers(1, 400))
    def reserve(self, who: Payer, prompt: int, max_tokens: int) -> str:
        self.counter += 1
        rid = f"r{self.counter}"
        decision = self.ledger.reserve(rid, who, "m", self.price, prompt, max_tokens, POLICY, self.now, lease_s=60)
        if isinstance(decision, Reserve):
            self.open[rid] = (prompt, decision.max_tokens)
        return rid

    @rule(rid=consumes(reservations), fraction=st.floats(0, 1), outcome=st.sampled_from(["stop", "length", "cancelled", "error"]))
    def settle(self, rid: str, fraction: float, outcome: str) -> None:
        if rid in self.settled:  # released by the reaper: settling now changes nothing
            assert self.ledger.settle(rid, 1, 1, outcome, self.now).already
            return
        if rid not in self.open:  # refused at reservation
            with pytest.raises(LedgerError):
                self.ledger.settle(rid, 0, 0, outcome, self.now)
            return
        prompt, max_tokens = self.open.pop(rid)
        completion = int(max_tokens * fraction)
        result = self.ledger.settle(rid, prompt, completion, outcome, self.now)
        assert result.charged_nanos == self.price.cost(prompt, completion) <= result.reserved_nanos
        self.settled[rid] = result.charged_nanos
        again = self.ledger.settle(rid, prompt, max_tokens, outcome, self.now)  # a duplicate changes nothing
        assert again.already and again.charged_nanos == result.charged_nanos

    @rule(seconds=st.floats(0, 120))
    def time_passes_and_reaper_runs(self, seconds: float) -> None:
        self.now += seconds
        for s in self.ledger.reap(self.now):
            assert s.outcome == "expired" and s.charged_nanos == 0
            self.open.pop(s.request_id)
            self.settled[s.request_id] = 0

    @invariant()
    def balances(self) -> None:
        assert self.ledger.imbalances() == []

    @invariant()
    def never_overspent(self) -> None:
        for b in self.ledger.budgets(self.now):
            assert b.spent_nanos + b.held_nanos <= b.limit_nanos, b

    @invariant()
    def held_is_the_open_reservations(self) -> None:
        assert len(self.ledger.reservations()) == len(self.open)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_concurrent_reservations_from_many_threads_never_overshoot(tmp_path) -> None:
    """Eight threads, each with its own connection, race for one tenant budget."""
    path = tmp_path / "ledger.db"
    db = connect(path)
    migrate(db)
    price = Price(1_000_000, 1_000_000)  # $1 per 1M tokens: 1,000 nano-dollars a token
    per_request = price.cost(10, 90)
    Ledger(db).set_limit("tenant", "acme", per_request * 25 + per_request // 2, "day", NOW)
    granted: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        ledger = Ledger(connect(path))
        for i in range(20):
            decision = ledger.reserve(f"t{n}-{i}", Payer(f"u{n}", "acme", "app"), "m", price, 10, 90,
                                      ReservationPolicy(clamp=False), NOW, 60)
            if isinstance(decision, Reserve):
                with lock:
                    granted.append(f"t{n}-{i}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger = Ledger(db)
    assert len(granted) == 25
    spent, held = ledger.spent("tenant", "acme", "day", NOW)
    assert held == 25 * per_request and spent == 0
    for rid in granted:
        ledger.settle(rid, 10, 45, "stop", NOW)
    spent, held = ledger.spent("tenant", "acme", "day", NOW)
    assert held == 0 and spent == 25 * price.cost(10, 45)
    assert ledger.imbalances() == []
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_reserve_is_all_or_nothing_across_levels() -> None:
    ledger = _ledger()
    price = Price(1_000_000, 1_000_000)
    payer = Payer("ann", "acme", "web")
    ledger.set_limit("app", "web", price.cost(10, 10) - 1, "total", NOW)
    decision = ledger.reserve("a", payer, "m", price, 10, 10, ReservationPolicy(clamp=False), NOW, 60)
    assert isinstance(decision, Refuse) and decision.level == "app"
    for level, name in payer.levels():
        assert ledger.spent(level, name, "total", NOW) == (0, 0)
    assert ledger.reservations() == []
    with pytest.raises(LedgerError):
        ledger.settle("a", 10, 10, "stop", NOW)


def test_duplicate_request_id_is_refused() -> None:
    ledger = _ledger()
    payer = Payer("ann", "acme", "web")
    ledger.reserve("x", payer, "m", Price(1, 1), 1, 1, POLICY, NOW, 60)
    with pytest.raises(LedgerError):
        ledger.reserve("x", payer, "m", Price(1, 1), 1, 1, POLICY, NOW, 60)


def test_reset_writes_off_spend_and_keeps_the_ledger_balanced() -> None:
    ledger = _ledger()
    price = Price(1_000_000, 1_000_000)
    payer = Payer("ann", "acme", "web")
    ledger.set_limit("tenant", "acme", 10**9, "day", NOW)
    ledger.reserve("a", payer, "m", price, 100, 100, POLICY, NOW, 60)
    ledger.settle("a", 100, 50, "stop", NOW)
    assert ledger.reset_spend("tenant", "acme", "day", NOW) == price.cost(100, 50)
    assert ledger.spent("tenant", "acme", "day", NOW) == (0, 0)
    assert ledger.spent("tenant", "acme", "month", NOW)[0] == price.cost(100, 50)  # only the day's window
    assert ledger.imbalances() == []


@given(st.integers(1, 10**6), st.integers(0, 10**6))
def test_ledger_rejects_bad_limits(limit: int, other: int) -> None:
    assume(limit != other)
    ledger = _ledger()
    with pytest.raises(LedgerError):
        ledger.set_limit("galaxy", "x", limit, "day", NOW)
    with pytest.raises(LedgerError):
        ledger.set_limit("tenant", "x", limit, "week", NOW)
    with pytest.raises(LedgerError):
        ledger.set_limit("tenant", "x", -limit, "day", NOW)


def test_ledger_tables_refuse_negative_holds() -> None:
    ledger = _ledger()
    with pytest.raises(apsw.ConstraintError):
        ledger.db.execute("INSERT INTO budget_usage(level, name, window, held_nanos) VALUES ('user', 'x', 't', -1)")


@given(st.integers(min_value=-(10**18), max_value=10**18))
def test_money_is_written_one_way_plain_and_close(nanos: int) -> None:
    """`$` and plain decimals (never 5e-05 or µ$), within half a cent from a dollar up, else within
    four significant digits."""
    from decimal import Decimal

    from policy.budgets import dollars

    text = dollars(nanos)
    assert "e" not in text and "µ" not in text and text.lstrip("-").startswith("$")
    value = Decimal(text.replace("$", "").replace(",", "")) * 10**9
    assert abs(value - nanos) <= max(Decimal(5 * 10**6) if abs(nanos) >= 10**9 - 10**5 else 0, Decimal(abs(nanos)) / 1000 + 1)
