"""A function to run on an engine's model thread between steps, its result handed back to the
event loop as a future's (adapter loads and unloads: only the model's thread touches the model)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class ModelThreadCall:
    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        self.fn, self.loop, self.future = fn, loop, future

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:
            self.fail(exc)
        else:
            self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_result(result))

    def fail(self, exc: Exception) -> None:
        self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_exception(exc))
