"""Which models are in memory: loads on demand, unloads after keep_alive, makes room under the
memory budget. policy/residency.py decides; this module does the IO on the event loop.

Loads and unloads take turns (one at a time, so a plan never counts memory another load is about
to take) and run in a worker thread; a load keeps going when the request that asked for it gives up,
so no engine is ever left half-made or orphaned. A model is never unloaded under a request: a
request holds its model from before the load until its engine has counted the request in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from appliance.config.settings import ModelSettings
from engines.interface import Engine, EngineError
from policy.residency import Resident, expired, next_expiry, plan_load

log = logging.getLogger("appliance.models")

_POLL_S = 0.05  # how often a request waiting for room looks again (busy models finish on their own threads)
_REAP_MAX_S = 0.5  # the reaper's longest sleep: a model that just went idle may be due soon


class ModelUnavailable(EngineError):
    """The model cannot serve now: how the API answers it (status, code, Retry-After)."""

    def __init__(self, message: str, status: int, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: a share of RAM cannot be resolved
        return 0


@dataclass
class Entry:
    """One model as the manager keeps it. `real` is the engine while loaded."""

    settings: ModelSettings
    need: int  # estimated bytes when loaded (0: not estimated, an upstream)
    pinned: bool  # loaded at start, never unloaded
    real: Engine | None = None
    pending: int = 0  # requests holding it: waiting for it to load, or being handed to its engine
    last_used: float = 0.0  # monotonic: when it loaded or a request last took it
    loaded_at: float | None = None
    loading: bool = False
    loads: int = 0
    error: str | None = None  # why its last load failed
    key: str = ""  # its name among the manager's entries: the alias, or a retired one's own
    retired: Callable[[], None] | None = None  # set once replaced or removed: called when it is gone
    unload_when_idle: bool = False  # the operator asked to unload it while it was busy
    asked_keep_alive_s: float | None = None  # how long to keep it after its last request, as an admin's request asked

    def __post_init__(self) -> None:
        self.key = self.key or self.settings.alias

    @property
    def busy(self) -> int:
        return self.pending + int(getattr(self.real, "busy", 0) or 0)

    def resident(self, now: float) -> Resident:
        idle_since = getattr(self.real, "idle_since", None)
        last = max(self.last_used, idle_since if idle_since is not None else now)
        going = self.retired is not None or self.unload_when_idle  # unloaded once idle
        configured = getattr(self.settings, "keep_alive_s", None)
        keep_alive = 0.0 if going else self.asked_keep_alive_s if self.asked_keep_alive_s is not None else configured
        return Resident(self.key, self.need, self.busy, last, keep_alive, self.pinned and self.retired is None)


class ModelManager:
    def __init__(self, budget: int | None, load_timeout_s: float, build: Callable[[ModelSettings], Engine]) -> None:
        self.budget = budget
        self.load_timeout_s = load_timeout_s
        self.build = build  # a model's engine from its settings (the registry's, as they are now)
        self._entries: dict[str, Entry] = {}
        self._turn: asyncio.Task[Any] | None = None  # the load or unload running now
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self._started = False  # the reaper starts with the event loop's server
        self._retirements = 0

    def add(self, settings: ModelSettings, need: int, engine: Engine | None, *, pinned: bool | None = None) -> Entry:
        """A model loaded already (`engine`), or one loaded on demand (None); pinned: never
        unloaded for another (by default, one loaded already)."""
        entry = Entry(settings, need, pinned=engine is not None if pinned is None else pinned, real=engine, last_used=time.monotonic())
        if engine is not None:
            entry.loaded_at = entry.last_used
        self._entries[settings.alias] = entry
        return entry

    def retire(self, alias: str, gone: Callable[[], None] = lambda: None) -> None:
        """The model was replaced or removed from the config: its requests (running, or waiting for
        its load) finish on it, then it unloads and `gone` runs (off the loop). Its memory counts
        until then, so a replacement under a budget waits for it."""
        entry = self._entries.pop(alias)
        self._retirements += 1
        entry.key, entry.retired = f"{alias} (retired {self._retirements})", gone
        self._entries[entry.key] = entry
        self._start_reaper()

    def entry(self, alias: str) -> Entry | None:
        return self._entries.get(alias)

    async def load(self, entry: Entry) -> None:
        """The operator's load: as a request would (a 503 or 507 when it cannot)."""
        async with self.hold(entry):
            pass

    async def unload(self, entry: Entry) -> bool:
        """The operator's unload: at once when idle (True), else once its requests finish (False).
        A model loaded at start stays: raises ModelUnavailable."""
        if entry.pinned:
            raise ModelUnavailable(f"The model {entry.settings.alias!r} is preloaded and stays loaded; set preload = false "
                                   "in its config to load it on demand.", 409, "model_preloaded")
        if entry.real is None:
            return True
        if entry.busy or self._turn is not None:
            entry.unload_when_idle = True
            self._start_reaper()
            return False
        turn = self._turn = asyncio.create_task(self._unload([self._detach(entry)]))
        turn.add_done_callback(self._turn_done)
        await asyncio.shield(turn)
        return True

    def keep_alive(self, alias: str, seconds: float) -> None:
        """Keep the model this long after its last request (Ollama's keep_alive), instead of its
        configured keep_alive, until the next such ask; a preloaded model stays regardless."""
        entry = self._entries.get(alias)
        if entry is not None:
            entry.asked_keep_alive_s = seconds
            self._start_reaper()

    async def preload(self, entry: Entry) -> None:
        """Loads a pinned model added while the server runs, waiting for room as a request would."""
        async with self.hold(entry, timeout=None):
            pass

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def residents(self) -> list[Resident]:
        now = time.monotonic()
        return [e.resident(now) for e in self._entries.values() if e.real is not None]

    def loaded_bytes(self) -> int:
        return sum(e.need for e in self._entries.values() if e.real is not None or e.loading)

    # ---- requests ----------------------------------------------------------------------------------

    @asynccontextmanager
    async def hold(self, entry: Entry, timeout: float | None = -1.0) -> AsyncIterator[Engine]:
        """The model's engine, loaded, and not unloaded until the block ends: submit the request
        to it inside. Raises ModelUnavailable (too large, timed out, failed to load). `timeout`:
        the longest wait for a load (default: load_timeout_s; None: no limit)."""
        entry.pending += 1
        try:
            limit = self.load_timeout_s if timeout == -1.0 else timeout
            yield entry.real if entry.real is not None else await self._until_loaded(entry, limit)
        finally:
            entry.pending -= 1
            entry.last_used = time.monotonic()

    async def _until_loaded(self, entry: Entry, timeout: float | None) -> Engine:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else float("inf"))
        if not entry.loading:
            entry.error = None  # an earlier failure is tried again
        while entry.real is None:
            if self._closing:
                raise ModelUnavailable("The server is shutting down.", 503, "unavailable", 5)
            turn = self._turn
            if turn is None:
                turn = self._plan_turn(entry)
            left = deadline - loop.time()
            if left <= 0:
                break
            if turn is not None:
                await asyncio.wait({turn}, timeout=None if left == float("inf") else left)  # a load outlives the request that started it
            else:
                await asyncio.sleep(min(_POLL_S, left))  # room comes when a busy model finishes its requests
            if entry.error is not None and entry.real is None and not entry.loading:
                raise ModelUnavailable(f"The model {entry.settings.alias!r} could not be loaded: {entry.error}", 503, "model_load_failed", 30)
        if entry.real is None:
            retry = max(1, round(self.load_timeout_s / 4))
            raise ModelUnavailable(f"The model {entry.settings.alias!r} did not load within {self.load_timeout_s:g} s (loading, or waiting for "
                                   f"room in the memory budget); retry shortly.", 503, "model_loading", retry)
        return entry.real

    def _plan_turn(self, entry: Entry) -> asyncio.Task[Any] | None:
        """Starts making room for and loading `entry` when it fits now; None when it must wait.
        Synchronous from the plan to detaching its victims, so nothing takes them in between."""
        plan = plan_load(entry.settings.alias, entry.need, self.residents(), self.budget)
        if plan.verdict == "never":
            raise ModelUnavailable(f"The model cannot be loaded: {plan.reason}. Raise [server] memory_budget, or lower "
                                   "the model's slots or context_length.", 507, "model_too_large")
        if plan.verdict == "wait":
            return None
        victims = [self._detach(self._entries[key]) for key in plan.evict]
        entry.loading, entry.error = True, None
        turn = self._turn = asyncio.create_task(self._swap(entry, victims))
        turn.add_done_callback(self._turn_done)
        return turn

    def _turn_done(self, turn: asyncio.Task[Any]) -> None:
        if self._turn is turn:
            self._turn = None
        if not turn.cancelled() and turn.exception() is not None:
            log.error("loading or unloading a model failed: %s", turn.exception())

    def _detach(self, entry: Entry) -> tuple[Entry, Engine]:
        """Takes an idle model out of service at once: a later request for it loads it again."""
        engine = entry.real
        assert engine is not None and entry.busy == 0
        entry.real, entry.loaded_at, entry.unload_when_idle = None, None, False
        return entry, engine

    async def _unload(self, victims: list[tuple[Entry, Engine]]) -> None:
        for entry, engine in victims:
            drain = getattr(engine, "drain", None)
            if drain is not None:
                await drain(timeout=None)  # nothing is running (it was idle when detached): at once
            await asyncio.to_thread(engine.close)
            log.info("unloaded %s", entry.key)
            self._forget_if_retired(entry)

    def _forget_if_retired(self, entry: Entry) -> None:
        if entry.retired is not None and entry.real is None and not entry.loading and entry.pending == 0 \
                and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            gone, entry.retired = entry.retired, lambda: None
            try:
                gone()
            except Exception:
                log.exception("closing %s", entry.key)

    async def _swap(self, entry: Entry, victims: list[tuple[Entry, Engine]]) -> None:
        try:
            await self._unload(victims)
            started = time.monotonic()
            try:
                engine = await asyncio.to_thread(self.build, entry.settings)
            except Exception as exc:
                entry.error = str(exc)
                raise
            if self._closing:
                await asyncio.to_thread(engine.close)
                return
            await engine.start()
            entry.real, entry.loaded_at, entry.last_used = engine, time.monotonic(), time.monotonic()
            entry.loads += 1
            log.info("loaded %s on demand in %.2f s (about %.0f MiB; %.0f MiB of the budget in use)", entry.settings.alias,
                     entry.loaded_at - started, entry.need / 2**20, self.loaded_bytes() / 2**20)
        finally:
            entry.loading = False
            self._forget_if_retired(entry)  # retired while it loaded, and nobody waits for it any more

    # ---- keep_alive --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        if any(not e.pinned for e in self._entries.values()):
            self._start_reaper()

    def _start_reaper(self) -> None:
        if self._reaper is None and self._started and not self._closing:
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """Unloads idle models whose keep_alive ran out, and retired ones once idle, between loads."""
        while not self._closing:
            now = time.monotonic()
            for entry in [e for e in self._entries.values() if e.retired is not None]:
                self._forget_if_retired(entry)  # never loaded, or unloaded already: nothing to wait for
            residents = self.residents()
            due = expired(residents, now) if self._turn is None else ()
            if due:
                victims = [self._detach(self._entries[key]) for key in due]
                self._turn = asyncio.create_task(self._unload(victims))
                self._turn.add_done_callback(self._turn_done)
            at = next_expiry(residents)
            await asyncio.sleep(_REAP_MAX_S if at is None else min(_REAP_MAX_S, max(0.01, at - now)))

    def close(self) -> None:
        """Closes the engines loaded on demand (called off the loop, at shutdown); the registry closes the others."""
        self._closing = True
        if self._reaper is not None:
            try:
                self._reaper.get_loop().call_soon_threadsafe(self._reaper.cancel)
            except RuntimeError:
                pass
        for entry in self._entries.values():
            if entry.pinned and entry.retired is None:
                continue
            engine, entry.real = entry.real, None
            if engine is not None:
                engine.close()
            if entry.retired is not None:
                entry.retired()

    # ---- what the admin API shows ------------------------------------------------------------------

    def view(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        rows = []
        for e in self._entries.values():
            r = e.resident(now)
            loaded = e.real is not None
            stats = e.real.stats() if loaded else None  # type: ignore[union-attr]
            expires = r.expires_at() if loaded and r.busy == 0 else None
            rows.append({
                "alias": e.settings.alias, "engine": e.settings.engine, "kind": e.settings.kind, "retired": e.retired is not None,
                "loaded": loaded, "loading": e.loading, "preload": e.pinned,
                "memory_bytes": e.need or None, "slots_total": e.settings.slots,
                "slots_busy": stats.slots_busy if stats else 0, "queue_depth": stats.queue_depth if stats else 0,
                "waiting_for_load": e.pending if not loaded else 0,
                "idle_s": round(now - r.last_used, 3) if loaded and r.busy == 0 else None,
                "keep_alive_s": getattr(e.settings, "keep_alive_s", None),
                "unloads_in_s": None if expires is None else round(max(0.0, expires - now), 3),
                "loaded_for_s": round(now - e.loaded_at, 3) if e.loaded_at is not None else None,
                "loads": e.loads,
            })
        return rows
