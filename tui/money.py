"""Money as the TUI writes it: the admin API answers in float dollars (`…_usd`), and every amount
is written as `policy.budgets.dollars` writes it everywhere else, from the nano-dollars it stands for."""

from __future__ import annotations

from decimal import Decimal

from policy.budgets import dollars, nanos_from_usd


def money(usd: float) -> str:
    """`$5.00`, `$0.00000915`: never µ$, never 9.15e-06."""
    return dollars(nanos_from_usd(usd))


def typed_usd(usd: float) -> str:
    """An amount as an operator would type it back into the budget prompt: `5`, `0.25`, `0.00001`."""
    return format(Decimal(nanos_from_usd(usd)).scaleb(-9).normalize(), "f")
