"""How busy a local model is: the requests it has taken and not finished, how many of them still
wait for a slot, since when it has been idle, and a wait for it to empty (a drain). The event loop
counts requests in, the model thread counts them out, so every change is under one lock."""

from __future__ import annotations

import asyncio
import threading
import time

from engines.interface import EngineClosed, EngineOverloaded


class Occupancy:
    def __init__(self, slots: int, max_queue: int) -> None:
        self.slots, self.max_queue = slots, max_queue
        self._lock = threading.Lock()
        self.queued = 0  # requests taken and not yet admitted into the batch
        self.running = 0  # requests admitted and not yet finished
        self.unfinished = 0  # requests taken and not yet finished
        self.idle_since: float | None = time.monotonic()  # None while anything is unfinished
        self.accepting = True  # False while draining
        self.closing = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def refuse_if_closed(self) -> None:
        if self.closing:
            raise EngineClosed("the model is shutting down")
        if not self.accepting:
            raise EngineClosed("the model is being unloaded; retry shortly")

    def take(self) -> None:
        """Counts a request in; requests beyond the slots and the queue are refused. Under the
        lock, so a drain sees every request taken before it."""
        with self._lock:
            self.refuse_if_closed()
            if self.queued + self.running >= self.max_queue + self.slots:
                raise EngineOverloaded(f"the queue for this model is full ({self.max_queue} waiting)")
            self.queued += 1
            self.unfinished += 1
            self.idle_since = None

    def admit(self) -> None:
        with self._lock:
            self.queued -= 1
            self.running += 1

    def settle(self, *, queued: bool = False, running: bool = False) -> None:
        """Counts a finished request out; the last one out marks the model idle and ends drains."""
        with self._lock:
            self.queued -= queued
            self.running -= running
            self.unfinished -= 1
            if self.unfinished:
                return
            self.idle_since = time.monotonic()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))  # type: ignore[misc]
            except RuntimeError:  # that loop is gone
                pass

    async def drain(self, timeout: float | None = None) -> bool:
        """Stops taking requests and waits until none is unfinished: True then, False at `timeout`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self.accepting = False
            if self.unfinished == 0:
                return True
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return False
        return True
