"""An async iterator of engine events fed from the model's thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

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

    def push(self, event: EngineEvent) -> None:
        """Thread-safe (one producer thread)."""
        if isinstance(event, TokenEvent):
            self.tokens_pushed += 1
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
