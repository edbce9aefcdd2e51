"""The budget ledger over SQLite: reserve at admission, settle once at the end, reap expired leases.

Each operation is one `BEGIN IMMEDIATE` transaction, so concurrent reservations from any number of
threads or processes serialise on the database and a budget is never overshot. Spend is kept per
level (user, tenant, app, global) in three windows (day, month, total); a limit counts over the
window of its own period. The ledger balances: per level and window, held equals the open
reservations and spent equals the settlements plus adjustments (`imbalances()` checks it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import apsw

from policy.budgets import (
    GLOBAL_NAME,
    LEVELS,
    PERIODS,
    Account,
    Price,
    Refuse,
    ReservationPolicy,
    Reserve,
    Windows,
    plan_reservation,
)
from appliance.store.keys import KeyStore
from appliance.store.transactions import immediate

log = logging.getLogger("appliance.ledger")


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE budget_limits (
            level TEXT NOT NULL CHECK (level IN ('user', 'tenant', 'app', 'global')),
            name TEXT NOT NULL,
            limit_nanos INTEGER NOT NULL CHECK (limit_nanos >= 0),
            period TEXT NOT NULL CHECK (period IN ('day', 'month', 'total')),
            updated_at REAL NOT NULL,
            PRIMARY KEY (level, name)
        ) STRICT;
        CREATE TABLE budget_usage (
            level TEXT NOT NULL,
            name TEXT NOT NULL,
            window TEXT NOT NULL,
            spent_nanos INTEGER NOT NULL DEFAULT 0,
            held_nanos INTEGER NOT NULL DEFAULT 0 CHECK (held_nanos >= 0),
            PRIMARY KEY (level, name, window)
        ) STRICT, WITHOUT ROWID;
        CREATE TABLE reservations (
            request_id TEXT PRIMARY KEY,
            user TEXT NOT NULL,
            tenant TEXT NOT NULL,
            app TEXT NOT NULL,
            model TEXT NOT NULL,
            day TEXT NOT NULL,
            month TEXT NOT NULL,
            amount_nanos INTEGER NOT NULL CHECK (amount_nanos >= 0),
            price_in_pico INTEGER NOT NULL,
            price_out_pico INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            max_tokens INTEGER NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL NOT NULL
        ) STRICT;
        CREATE INDEX reservations_expiry ON reservations(expires_at);
        CREATE TABLE settlements (
            request_id TEXT PRIMARY KEY,
            outcome TEXT NOT NULL,
            user TEXT NOT NULL,
            tenant TEXT NOT NULL,
            app TEXT NOT NULL,
            model TEXT NOT NULL,
            day TEXT NOT NULL,
            month TEXT NOT NULL,
            reserved_nanos INTEGER NOT NULL,
            charged_nanos INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            settled_at REAL NOT NULL
        ) STRICT;
        CREATE INDEX settlements_time ON settlements(settled_at);
        CREATE TABLE budget_adjustments (
            id INTEGER PRIMARY KEY,
            level TEXT NOT NULL,
            name TEXT NOT NULL,
            window TEXT NOT NULL,
            delta_nanos INTEGER NOT NULL,
            reason TEXT NOT NULL,
            at REAL NOT NULL
        ) STRICT;
        """
    )


@dataclass(frozen=True)
class Payer:
    """Who a request is charged to, at each level of the hierarchy."""

    user: str
    tenant: str
    app: str

    def levels(self) -> tuple[tuple[str, str], ...]:
        return (("user", self.user), ("tenant", self.tenant), ("app", self.app), ("global", GLOBAL_NAME))


@dataclass(frozen=True)
class Settlement:
    request_id: str
    outcome: str
    reserved_nanos: int
    charged_nanos: int
    prompt_tokens: int
    completion_tokens: int
    already: bool = False  # settled before: this call changed nothing


@dataclass(frozen=True)
class BudgetRow:
    level: str
    name: str
    limit_nanos: int
    period: str
    window: str
    spent_nanos: int
    held_nanos: int


class LedgerError(Exception):
    pass


_UPSERT = (
    "INSERT INTO budget_usage(level, name, window, spent_nanos, held_nanos) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT(level, name, window) DO UPDATE SET spent_nanos = spent_nanos + excluded.spent_nanos, "
    "held_nanos = held_nanos + excluded.held_nanos"
)


_SETTLE = "UPDATE budget_usage SET spent_nanos = spent_nanos + ?, held_nanos = held_nanos + ? WHERE level = ? AND name = ? AND window = ?"


class Ledger:
    """One connection; use it from one thread at a time (each thread or process opens its own)."""

    def __init__(self, db: apsw.Connection) -> None:
        self.db = db

    # -- the request path --------------------------------------------------------------------

    def reserve(
        self, request_id: str, payer: Payer, model: str, price: Price, prompt_tokens: int, max_tokens: int,
        policy: ReservationPolicy, now: float, lease_s: float,
    ) -> Reserve | Refuse:
        windows = Windows.at(now)
        with immediate(self.db):
            if self._exists(request_id):
                raise LedgerError(f"request {request_id} already has a reservation or settlement")
            decision = plan_reservation(self._accounts(payer, windows), price, prompt_tokens, max_tokens, policy)
            if isinstance(decision, Refuse):
                return decision
            self.db.execute(
                "INSERT INTO reservations(request_id, user, tenant, app, model, day, month, amount_nanos, price_in_pico, "
                "price_out_pico, prompt_tokens, max_tokens, created_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (request_id, payer.user, payer.tenant, payer.app, model, windows.day, windows.month, decision.amount_nanos,
                 price.input_pico_per_token, price.output_pico_per_token, prompt_tokens, decision.max_tokens, now, now + lease_s),
            )
            self._apply(payer, windows, spent=0, held=decision.amount_nanos)
            return decision

    def settle(self, request_id: str, prompt_tokens: int, completion_tokens: int, outcome: str, now: float) -> Settlement:
        """Charge the actual tokens and release the rest, exactly once per request id."""
        with immediate(self.db):
            return self._settle(request_id, prompt_tokens, completion_tokens, outcome, now)

    def extend(self, request_ids: Iterable[str], until: float) -> int:
        """Renew the leases of requests still running in this process."""
        ids = list(request_ids)
        if not ids:
            return 0
        with immediate(self.db):
            self.db.executemany("UPDATE reservations SET expires_at = max(expires_at, ?) WHERE request_id = ?", [(until, i) for i in ids])
            return self.db.changes()

    def reap(self, now: float) -> list[Settlement]:
        """Release every reservation whose lease has run out (its process crashed or hung)."""
        with immediate(self.db):
            expired = [row[0] for row in self.db.execute("SELECT request_id FROM reservations WHERE expires_at < ?", (now,))]
            return [self._settle(rid, 0, 0, "expired", now) for rid in expired]

    # -- administration ----------------------------------------------------------------------

    def set_limit(self, level: str, name: str, limit_nanos: int, period: str, now: float) -> None:
        if level not in LEVELS:
            raise LedgerError(f"unknown level {level!r}: expected one of {', '.join(LEVELS)}")
        if period not in PERIODS:
            raise LedgerError(f"unknown period {period!r}: expected one of {', '.join(PERIODS)}")
        if limit_nanos < 0:
            raise LedgerError("a budget cannot be negative")
        if level == "global":
            name = GLOBAL_NAME
        with immediate(self.db):
            self.db.execute(
                "INSERT INTO budget_limits(level, name, limit_nanos, period, updated_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(level, name) DO UPDATE SET limit_nanos = excluded.limit_nanos, period = excluded.period, "
                "updated_at = excluded.updated_at",
                (level, name, limit_nanos, period, now),
            )

    def remove_limit(self, level: str, name: str) -> bool:
        with immediate(self.db):
            self.db.execute("DELETE FROM budget_limits WHERE level = ? AND name = ?", (level, GLOBAL_NAME if level == "global" else name))
            return self.db.changes() > 0

    def reset_spend(self, level: str, name: str, period: str, now: float, reason: str = "reset") -> int:
        """Zero a level's spend in the current window of `period`, as a recorded adjustment so the
        ledger still balances. Returns the amount written off."""
        name = GLOBAL_NAME if level == "global" else name
        window = Windows.at(now).key(period)
        with immediate(self.db):
            row = self.db.execute(
                "SELECT spent_nanos FROM budget_usage WHERE level = ? AND name = ? AND window = ?", (level, name, window)
            ).fetchone()
            spent = row[0] if row else 0
            if spent:
                self.db.execute(
                    "INSERT INTO budget_adjustments(level, name, window, delta_nanos, reason, at) VALUES (?, ?, ?, ?, ?, ?)",
                    (level, name, window, -spent, reason, now),
                )
                self.db.execute(
                    "UPDATE budget_usage SET spent_nanos = 0 WHERE level = ? AND name = ? AND window = ?", (level, name, window)
                )
            return spent

    def budgets(self, now: float) -> list[BudgetRow]:
        windows = Windows.at(now)
        rows = []
        for level, name, limit, period in self.db.execute("SELECT level, name, limit_nanos, period FROM budget_limits ORDER BY level, name"):
            window = windows.key(period)
            spent, held = self._usage(level, name, window)
            rows.append(BudgetRow(level, name, limit, period, window, spent, held))
        return rows

    def reservations(self) -> list[dict[str, object]]:
        cursor = self.db.execute(
            "SELECT request_id, user, tenant, app, model, amount_nanos, max_tokens, created_at, expires_at FROM reservations ORDER BY created_at"
        )
        names = ("request_id", "user", "tenant", "app", "model", "amount_nanos", "max_tokens", "created_at", "expires_at")
        return [dict(zip(names, row)) for row in cursor]

    def top_spenders(self, level: str, period: str, now: float, limit: int = 10) -> list[tuple[str, int]]:
        window = Windows.at(now).key(period)
        return list(self.db.execute(
            "SELECT name, spent_nanos FROM budget_usage WHERE level = ? AND window = ? AND spent_nanos > 0 "
            "ORDER BY spent_nanos DESC, name LIMIT ?",
            (level, window, limit),
        ))

    def spent(self, level: str, name: str, period: str, now: float) -> tuple[int, int]:
        """(spent, held) in the current window of `period`."""
        return self._usage(level, GLOBAL_NAME if level == "global" else name, Windows.at(now).key(period))

    def settlement(self, request_id: str) -> Settlement | None:
        row = self.db.execute(
            "SELECT outcome, reserved_nanos, charged_nanos, prompt_tokens, completion_tokens FROM settlements WHERE request_id = ?",
            (request_id,),
        ).fetchone()
        return Settlement(request_id, *row, already=True) if row else None

    def imbalances(self) -> list[str]:
        """Every (level, name, window) whose held or spent disagrees with the reservations,
        settlements and adjustments behind it; empty when the ledger balances."""
        expected: dict[tuple[str, str, str], list[int]] = {}

        def add(payer: Payer, day: str, month: str, spent: int, held: int) -> None:
            windows = Windows(day, month)
            for level, name in payer.levels():
                for window in windows.keys():
                    entry = expected.setdefault((level, name, window), [0, 0])
                    entry[0] += spent
                    entry[1] += held

        for user, tenant, app, day, month, amount in self.db.execute("SELECT user, tenant, app, day, month, amount_nanos FROM reservations"):
            add(Payer(user, tenant, app), day, month, 0, amount)
        for user, tenant, app, day, month, charged in self.db.execute("SELECT user, tenant, app, day, month, charged_nanos FROM settlements"):
            add(Payer(user, tenant, app), day, month, charged, 0)
        for level, name, window, delta in self.db.execute("SELECT level, name, window, delta_nanos FROM budget_adjustments"):
            expected.setdefault((level, name, window), [0, 0])[0] += delta
        actual = {(lv, nm, wd): [sp, hd] for lv, nm, wd, sp, hd in self.db.execute("SELECT level, name, window, spent_nanos, held_nanos FROM budget_usage")}
        problems = []
        for key in sorted(set(expected) | set(actual)):
            want, have = expected.get(key, [0, 0]), actual.get(key, [0, 0])
            if want != have:
                problems.append(f"{key}: recorded spent={have[0]} held={have[1]}, expected spent={want[0]} held={want[1]}")
        return problems

    # -- internals ---------------------------------------------------------------------------

    def _exists(self, request_id: str) -> bool:
        return bool(self.db.execute(
            "SELECT 1 FROM reservations WHERE request_id = ?1 UNION ALL SELECT 1 FROM settlements WHERE request_id = ?1", (request_id,)
        ).fetchone())

    def _usage(self, level: str, name: str, window: str) -> tuple[int, int]:
        row = self.db.execute(
            "SELECT spent_nanos, held_nanos FROM budget_usage WHERE level = ? AND name = ? AND window = ?", (level, name, window)
        ).fetchone()
        return (row[0], row[1]) if row else (0, 0)

    def _accounts(self, payer: Payer, windows: Windows) -> tuple[Account, ...]:
        """Every limited level of `payer` with its spend in the window its period counts over."""
        params: list[str] = [windows.key("day"), windows.key("month")]
        for level, name in payer.levels():
            params += [level, name]
        rows = self.db.execute(
            "SELECT l.level, l.name, l.limit_nanos, l.period, coalesce(u.spent_nanos, 0), coalesce(u.held_nanos, 0) "
            "FROM budget_limits l LEFT JOIN budget_usage u ON u.level = l.level AND u.name = l.name "
            "AND u.window = CASE l.period WHEN 'day' THEN ?1 WHEN 'month' THEN ?2 ELSE 't' END "
            "WHERE (l.level, l.name) IN (VALUES (?3, ?4), (?5, ?6), (?7, ?8), (?9, ?10))",
            params,
        )
        return tuple(Account(*row) for row in rows)

    def _apply(self, payer: Payer, windows: Windows, *, spent: int, held: int) -> None:
        rows = [(level, name, window) for level, name in payer.levels() for window in windows.keys()]
        if held >= 0:
            self.db.executemany(_UPSERT, [(*row, spent, held) for row in rows])
        else:
            # Settling: the rows exist since the reservation (an upsert's candidate row would
            # trip the CHECK on a negative hold before the conflict is resolved).
            self.db.executemany(_SETTLE, [(spent, held, *row) for row in rows])

    def _settle(self, request_id: str, prompt_tokens: int, completion_tokens: int, outcome: str, now: float) -> Settlement:
        row = self.db.execute(
            "SELECT user, tenant, app, model, day, month, amount_nanos, price_in_pico, price_out_pico FROM reservations WHERE request_id = ?",
            (request_id,),
        ).fetchone()
        if row is None:
            done = self.settlement(request_id)
            if done is None:
                raise LedgerError(f"request {request_id} has no reservation")
            return done
        user, tenant, app, model, day, month, amount, price_in, price_out = row
        charged = Price(price_in, price_out).cost(prompt_tokens, completion_tokens)
        payer, windows = Payer(user, tenant, app), Windows(day, month)
        self.db.execute("DELETE FROM reservations WHERE request_id = ?", (request_id,))
        self.db.execute(
            "INSERT INTO settlements(request_id, outcome, user, tenant, app, model, day, month, reserved_nanos, charged_nanos, "
            "prompt_tokens, completion_tokens, settled_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (request_id, outcome, user, tenant, app, model, day, month, amount, charged, prompt_tokens, completion_tokens, now),
        )
        self._apply(payer, windows, spent=charged, held=-amount)
        return Settlement(request_id, outcome, amount, charged, prompt_tokens, completion_tokens)


def settle_logged(db: apsw.Connection, request_id: str, prompt_tokens: int, completion_tokens: int, outcome: str,
                  now: float) -> Settlement | None:
    """`Ledger.settle` for the store thread, where nobody waits on it: a failure is logged and gives None."""
    try:
        return Ledger(db).settle(request_id, prompt_tokens, completion_tokens, outcome, now)
    except Exception:
        log.exception("could not settle %s", request_id)
        return None


def sweep(db: apsw.Connection, live: Iterable[str], until: float, now: float, failures_before: float) -> list[Settlement]:
    """The lease reaper's one store call: renew the leases of this process's live requests, drop
    failed sign-ins older than `failures_before`, then release every expired reservation."""
    ledger = Ledger(db)
    ledger.extend(live, until)
    KeyStore(db).prune_failures(failures_before)
    return ledger.reap(now)
