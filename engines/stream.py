"""An async iterator of engine events fed from the model's thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from engines.interface import EngineEvent, FinishEvent, TokenEvent


class EventStream:
    """Events pushed from any thread arrive in order on the loop. Closing the stream before its
    finish event (a client gone, a task cancelled) calls `on_close`, which cancels the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # The loop's thread, when the stream is made on it (engines make them in `generate`).
        self._loop_thread = threading.get_ident() if asyncio._get_running_loop() is loop else None
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._finished = False
        self._closed = False
        self.on_close: Callable[[], None] | None = None
        # Tokens the engine has generated for this request so far, read or not: what a request
        # that ends without its finish event (a client gone) is charged for.
        self.tokens_pushed = 0
        self._held: EngineEvent | None = None  # the event `peek` waited for, not yet iterated

    def count(self, event: EngineEvent) -> None:
        """Counts an event as pushed, on the producer's thread (an Outbox delivers it later)."""
        if isinstance(event, TokenEvent):
            self.tokens_pushed += 1

    def push(self, event: EngineEvent) -> None:
        """Thread-safe (one producer thread)."""
        self.count(event)
        if threading.get_ident() == self._loop_thread:
            # A producer on the loop itself (an upstream's relay): no wake-up through the loop's pipe.
            self._queue.put_nowait(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is gone; nobody is listening
            pass

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> EngineEvent:
        if self._finished or self._closed:
            raise StopAsyncIteration
        if self._held is not None:
            event, self._held = self._held, None
        else:
            try:
                event = await self._queue.get()
            except BaseException:
                self.close()
                raise
        if isinstance(event, FinishEvent):
            self._finished = True
        return event

    async def peek(self) -> EngineEvent:
        """Waits for the next event without consuming it: iteration starts with it."""
        if self._held is None:
            self._held = await self._queue.get()
        return self._held

    def close(self) -> None:
        if not self._finished and not self._closed and self.on_close is not None:
            self.on_close()
        self._closed = True

    async def aclose(self) -> None:
        self.close()


class Outbox:
    """A model thread's events, handed to the event loop once a step instead of once each: every
    hand-over writes the loop's wake-up pipe and wakes its thread, which then competes with the
    model's compute threads for the cores (docs/performance/throughput.md). Events emitted on any
    other thread (a grammar worker's refusal, a shutdown after the thread ended) go out at once."""

    def __init__(self) -> None:
        self._owner: int | None = None
        self._held: list[tuple[EventStream, EngineEvent]] = []

    def bind(self) -> None:
        """Called first thing on the model thread: from here on its events wait for `flush`."""
        self._owner = threading.get_ident()

    def emitter(self, stream: EventStream) -> Callable[[EngineEvent], None]:
        def emit(event: EngineEvent) -> None:
            if threading.get_ident() != self._owner:
                stream.push(event)
                return
            stream.count(event)
            self._held.append((stream, event))
        return emit

    def flush(self) -> None:
        """On the model thread, after each step: one wake-up per event loop for all that was held."""
        if not self._held:
            return
        held, self._held = self._held, []
        by_loop: dict[Any, list[tuple[EventStream, EngineEvent]]] = {}
        for stream, event in held:
            by_loop.setdefault(stream._loop, []).append((stream, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is gone; nobody is listening
                pass


def _deliver(batch: list[tuple[EventStream, EngineEvent]]) -> None:
    for stream, event in batch:
        stream._queue.put_nowait(event)
