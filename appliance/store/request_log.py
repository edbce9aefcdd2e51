"""The request log: one row per API request, written by its own thread so that the event loop
never waits on SQLite."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import apsw

from appliance.store.connection import connect

log = logging.getLogger("appliance.store")


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE request_log (
            id TEXT PRIMARY KEY,
            created_at REAL NOT NULL,
            endpoint TEXT NOT NULL,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            finish_reason TEXT,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            ttft_ms REAL,
            total_ms REAL NOT NULL,
            error TEXT
        ) STRICT
        """
    )
    db.execute("CREATE INDEX request_log_created ON request_log(created_at)")


def add_principal(db: apsw.Connection) -> None:
    for column in ("tenant TEXT", "app TEXT", "user TEXT", "key_id TEXT", "cost_nanos INTEGER"):
        db.execute(f"ALTER TABLE request_log ADD COLUMN {column}")


@dataclass(frozen=True)
class RequestRecord:
    id: str
    created_at: float
    endpoint: str
    model: str
    status: str  # ok, cancelled, error
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    total_ms: float
    error: str | None = None
    tenant: str | None = None
    app: str | None = None
    user: str | None = None
    key_id: str | None = None
    cost_nanos: int | None = None


_INSERT = (
    "INSERT OR REPLACE INTO request_log(id, created_at, endpoint, model, status, finish_reason, prompt_tokens, "
    "completion_tokens, ttft_ms, total_ms, error, tenant, app, user, key_id, cost_nanos) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class RequestLogWriter:
    """Owns one connection and one thread; `close()` writes what is queued, then stops."""

    def __init__(self, db_path: Path, retention_s: float) -> None:
        self._path, self._retention_s = db_path, retention_s
        self._queue: queue.SimpleQueue[RequestRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def record(self, record: RequestRecord) -> None:
        self._queue.put(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        db = connect(self._path)
        try:
            while True:
                batch = [self._queue.get()]
                while True:  # write what has piled up in one transaction
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                rows = [astuple(r) for r in batch if r is not None]
                if rows:
                    try:
                        with db:
                            db.executemany(_INSERT, rows)
                            # Rows past retention go with each write: an index range, empty but once a day or so.
                            db.execute("DELETE FROM request_log WHERE created_at < ?", (time.time() - self._retention_s,))
                    except Exception:
                        log.exception("could not write %d request log rows", len(rows))
                if None in batch:
                    return
        finally:
            db.close()


def recent(db_path: Path, limit: int = 50) -> list[RequestRecord]:
    db = connect(db_path)
    try:
        rows = db.execute(
            "SELECT id, created_at, endpoint, model, status, finish_reason, prompt_tokens, completion_tokens, "
            "ttft_ms, total_ms, error, tenant, app, user, key_id, cost_nanos FROM request_log ORDER BY created_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [RequestRecord(*row) for row in rows]
    finally:
        db.close()
