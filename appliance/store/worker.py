"""One thread that owns a connection to the appliance's database and runs policy-store calls
for the event loop, in order, so that the loop never waits on SQLite."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import apsw

from appliance.store.connection import connect

T = TypeVar("T")


class StoreWorker:
    def __init__(self, db_path: Path, name: str = "policy-store", synchronous: str = "normal") -> None:
        self._synchronous = synchronous
        self._local = threading.local()
        self._path = db_path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._open)
        self._connections: list[apsw.Connection] = []

    def _open(self) -> None:
        self._local.db = connect(self._path, self._synchronous)
        self._connections.append(self._local.db)

    def submit(self, call: Callable[[apsw.Connection], T]) -> Future[T]:
        return self._executor.submit(lambda: call(self._local.db))

    async def run(self, call: Callable[[apsw.Connection], T]) -> T:
        return await asyncio.wrap_future(self.submit(call))

    def close(self) -> None:
        """Runs everything already submitted (settlements among it), then closes the connection."""
        self._executor.shutdown(wait=True)
        for db in self._connections:
            db.close()
