"""Dollar budgets, the pure part: prices, periods, and what a reservation may take.

Money is integer nano-dollars end to end so that sums are exact; prices are integer pico-dollars
per token (a price per million tokens with up to six decimals converts without rounding).
The SQLite ledger (appliance/store/ledger.py) reads levels in one transaction and asks `plan_reservation`.
"""

from __future__ import annotations

import math
from decimal import Decimal
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

LEVELS = ("user", "tenant", "app", "global")
PERIODS = ("day", "month", "total")
GLOBAL_NAME = "*"
NANOS_PER_USD = 1_000_000_000


@dataclass(frozen=True)
class Price:
    input_pico_per_token: int
    output_pico_per_token: int

    @staticmethod
    def per_million(input_usd: float, output_usd: float) -> Price:
        # $ per 1e6 tokens = 1e12 pico-dollars per 1e6 tokens = 1e6 pico-dollars per token.
        return Price(round(input_usd * 1_000_000), round(output_usd * 1_000_000))

    @staticmethod
    def of(model: Any) -> Price:
        """A model's price as its settings give it (`price_input_per_mtok`, `price_output_per_mtok`)."""
        return Price.per_million(model.price_input_per_mtok, model.price_output_per_mtok)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Nano-dollars, rounded up once for the whole request."""
        pico = prompt_tokens * self.input_pico_per_token + completion_tokens * self.output_pico_per_token
        return -(-pico // 1000)

    def affordable_completion(self, prompt_tokens: int, nanos: int) -> int | None:
        """The most completion tokens whose cost with the prompt stays within `nanos`;
        None when output is free (any number fits), -1 when not even the prompt fits."""
        room_pico = nanos * 1000 - prompt_tokens * self.input_pico_per_token
        if room_pico < 0:
            return -1
        if self.output_pico_per_token == 0:
            return None
        return room_pico // self.output_pico_per_token


def usd(nanos: int) -> float:
    return nanos / NANOS_PER_USD


def dollars(nanos: int) -> str:
    """Money as every surface writes it (CLI, console, errors): `$` and plain decimals, cents from a
    dollar up, else four significant digits; never `5e-05`, never micro-dollars."""
    if nanos == 0:
        return "$0"
    sign = "-" if nanos < 0 else ""
    amount = Decimal(abs(nanos)).scaleb(-9)
    if amount < 1:
        amount = amount.quantize(Decimal(1).scaleb(amount.adjusted() - 3))
    if amount >= 1:  # rounding may have reached a dollar
        return f"{sign}${amount:,.2f}"
    return f"{sign}${amount:f}".rstrip("0")


def nanos_from_usd(amount: float) -> int:
    return round(amount * NANOS_PER_USD)


@dataclass(frozen=True)
class Windows:
    """The accounting windows a moment falls in; every level's spend is kept in all three."""

    day: str
    month: str

    @staticmethod
    def at(epoch_s: float) -> Windows:
        moment = datetime.fromtimestamp(epoch_s, tz=timezone.utc)
        return Windows(moment.strftime("%Y-%m-%d"), moment.strftime("%Y-%m"))

    def key(self, period: str) -> str:
        return {"day": f"d:{self.day}", "month": f"m:{self.month}", "total": "t"}[period]

    def keys(self) -> tuple[str, str, str]:
        return (self.key("day"), self.key("month"), self.key("total"))


def seconds_until_reset(period: str, epoch_s: float) -> int | None:
    """How long until a period's window rolls over (UTC); None for `total`, which never does."""
    moment = datetime.fromtimestamp(epoch_s, tz=timezone.utc)
    if period == "total":
        return None
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        following = start.timestamp() + 86400
    else:
        year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
        following = start.replace(year=year, month=month, day=1).timestamp()
    return max(1, math.ceil(following - epoch_s))


@dataclass(frozen=True)
class Account:
    """One level's position in the window its limit counts over."""

    level: str
    name: str
    limit_nanos: int | None  # None: tracked, not limited
    period: str
    spent_nanos: int
    held_nanos: int

    @property
    def remaining_nanos(self) -> int | None:
        if self.limit_nanos is None:
            return None
        return max(0, self.limit_nanos - self.spent_nanos - self.held_nanos)


@dataclass(frozen=True)
class ReservationPolicy:
    # When a level cannot cover max_tokens, lower max_tokens to what it can cover, if that
    # leaves at least `min_tokens`; otherwise refuse.
    clamp: bool = True
    min_tokens: int = 16


@dataclass(frozen=True)
class Reserve:
    amount_nanos: int
    max_tokens: int
    clamped: bool


@dataclass(frozen=True)
class Refuse:
    level: str
    name: str
    remaining_nanos: int
    needed_nanos: int
    period: str


def plan_reservation(
    accounts: tuple[Account, ...], price: Price, prompt_tokens: int, max_tokens: int, policy: ReservationPolicy
) -> Reserve | Refuse:
    """Reserve the prompt plus `max_tokens` at every level, all or none."""
    needed = price.cost(prompt_tokens, max_tokens)
    limited = [a for a in accounts if a.remaining_nanos is not None]
    tightest = min(limited, key=lambda a: a.remaining_nanos or 0, default=None)
    if tightest is None or (tightest.remaining_nanos or 0) >= needed:
        return Reserve(needed, max_tokens, clamped=False)
    remaining = tightest.remaining_nanos or 0
    refusal = Refuse(tightest.level, tightest.name, remaining, needed, tightest.period)
    if not policy.clamp:
        return refusal
    affordable = price.affordable_completion(prompt_tokens, remaining)
    if affordable is None:  # output is free and the prompt alone fits: the cost is the prompt
        return Reserve(price.cost(prompt_tokens, max_tokens), max_tokens, clamped=False)
    if affordable < min(policy.min_tokens, max_tokens):
        return refusal
    tokens = min(affordable, max_tokens)
    return Reserve(price.cost(prompt_tokens, tokens), tokens, clamped=tokens < max_tokens)
