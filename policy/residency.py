"""Which models stay in memory: the pure decisions behind loading on demand.

A model loads on its first request and unloads once idle for its `keep_alive`; under a memory
budget, loading one unloads the least recently used idle models until it fits. A model with
requests running or queued is never unloaded under them, and one the operator pinned (`preload`,
or `keep_alive = -1`) is never unloaded for another. The model manager does the IO; these
functions only decide, over frozen snapshots, so every rule is tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Resident:
    """A loaded model as the manager sees it at one moment."""

    alias: str
    bytes: int  # its estimate when it was loaded: weights, KV cache at its slots, compute buffers
    busy: int  # requests running or queued on it
    last_used: float  # when its last request finished (or it finished loading), monotonic seconds
    keep_alive_s: float | None  # None: kept until pinned is lifted or the server stops
    pinned: bool = False  # preload = true: loaded at start and never unloaded for another model

    def expires_at(self) -> float | None:
        """When it unloads if nothing uses it; None when it never does by itself."""
        if self.pinned or self.keep_alive_s is None:
            return None
        return self.last_used + self.keep_alive_s

    @property
    def evictable(self) -> bool:
        return self.busy == 0 and not self.pinned and self.keep_alive_s is not None


@dataclass(frozen=True)
class LoadPlan:
    """`load`: unload `evict` (in that order), then load. `wait`: it fits once busy models go idle;
    ask again when one does. `never`: it cannot fit beside what may not be unloaded; `reason` says why."""

    verdict: Literal["load", "wait", "never"]
    evict: tuple[str, ...] = ()
    reason: str = ""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_load(alias: str, need: int, residents: Sequence[Resident], budget: int | None) -> LoadPlan:
    """How to make room for `alias` needing `need` bytes. Unloads the fewest least recently used idle
    models; a busy model waits to be idle rather than being unloaded under its requests."""
    if budget is None:
        return LoadPlan("load")
    others = [r for r in residents if r.alias != alias]
    if need > budget:
        return LoadPlan("never", reason=f"model {alias!r} needs about {_gib(need)}, more than the whole memory budget of {_gib(budget)}")
    kept = [r for r in others if r.pinned or r.keep_alive_s is None]
    if need + sum(r.bytes for r in kept) > budget:
        names = ", ".join(sorted(r.alias for r in kept))
        return LoadPlan("never", reason=f"model {alias!r} needs about {_gib(need)}; the memory budget of {_gib(budget)} "
                                        f"is held by models that are never unloaded ({names})")
    free = budget - sum(r.bytes for r in others)
    evict: list[str] = []
    for r in sorted((r for r in others if r.evictable), key=lambda r: (r.last_used, r.alias)):
        if free >= need:
            break
        evict.append(r.alias)
        free += r.bytes
    if free >= need:
        return LoadPlan("load", tuple(evict))
    # Enough memory is held by busy models that may be unloaded once idle: wait for them, evicting nothing yet.
    return LoadPlan("wait", reason=f"model {alias!r} needs about {_gib(need)}; {_gib(max(free, 0))} of the {_gib(budget)} budget "
                                   "is free while other models finish their requests")


def expired(residents: Sequence[Resident], now: float) -> tuple[str, ...]:
    """Idle models whose keep_alive has run out, oldest first."""
    due = [r for r in residents if r.busy == 0 and (at := r.expires_at()) is not None and at <= now]
    return tuple(r.alias for r in sorted(due, key=lambda r: (r.last_used, r.alias)))


def next_expiry(residents: Sequence[Resident]) -> float | None:
    """When the next idle model is due to unload (for the manager's timer); None when none is."""
    times = [at for r in residents if r.busy == 0 and (at := r.expires_at()) is not None]
    return min(times) if times else None
