"""Spans kept in SQLite, so every call's trace can be read back (`/admin/traces`) without an
external collector. An OpenTelemetry exporter: the BatchSpanProcessor calls it from its own
thread, which owns this module's connection.

A request that joined its caller's trace (`traceparent`) has a parent this server never sees: it
is stored as `remote_parent_id`, and the span counts as a root here (`parent_id` NULL), so
listing and tree-building stay within what this server recorded."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import apsw
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from appliance.store.connection import connect
from appliance.store.transactions import immediate

log = logging.getLogger("appliance.traces")


def create_tables(db: apsw.Connection) -> None:
    db.execute(
        """
        CREATE TABLE spans (
            span_id TEXT PRIMARY KEY,
            trace_id TEXT NOT NULL,
            parent_id TEXT,
            name TEXT NOT NULL,
            start_ns INTEGER NOT NULL,
            end_ns INTEGER NOT NULL,
            error INTEGER NOT NULL,
            attributes TEXT NOT NULL
        ) STRICT;
        CREATE INDEX spans_trace ON spans(trace_id);
        CREATE INDEX spans_roots ON spans(start_ns) WHERE parent_id IS NULL;
        """
    )


def add_remote_parent(db: apsw.Connection) -> None:
    db.execute("ALTER TABLE spans ADD COLUMN remote_parent_id TEXT")


def _value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class SqliteSpanExporter(SpanExporter):
    def __init__(self, db_path: Path, retention_s: float, max_spans: int, synchronous: str = "normal") -> None:
        self._path, self._retention_s, self._max_spans, self._synchronous = db_path, retention_s, max_spans, synchronous
        self._db: apsw.Connection | None = None
        self._exports = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            if self._db is None:
                self._db = connect(self._path, self._synchronous)
            rows = []
            for span in spans:
                context = span.get_span_context()
                parent = span.parent
                parent_id = format(parent.span_id, "016x") if parent is not None else None
                remote = parent is not None and parent.is_remote
                attributes = {k: _value(v) for k, v in (span.attributes or {}).items()}
                if not span.status.is_ok and span.status.description:
                    attributes["error.message"] = span.status.description  # what the caller was told, for the console
                rows.append((
                    format(context.span_id, "016x"), format(context.trace_id, "032x"),
                    None if remote else parent_id, parent_id if remote else None, span.name,
                    span.start_time or 0, span.end_time or 0, int(not span.status.is_ok), json.dumps(attributes),
                ))
            with immediate(self._db):
                self._db.executemany("INSERT OR REPLACE INTO spans (span_id, trace_id, parent_id, remote_parent_id, name, start_ns, end_ns, "
                                     "error, attributes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            self._exports += 1
            if self._exports % 50 == 1:
                self._prune()
            return SpanExportResult.SUCCESS
        except Exception:
            log.exception("could not store %d spans", len(spans))
            return SpanExportResult.FAILURE

    def _prune(self) -> None:
        """Retention: spans older than the window, then the oldest beyond the cap."""
        assert self._db is not None
        cutoff = time.time_ns() - int(self._retention_s * 1e9)
        with immediate(self._db):
            self._db.execute("DELETE FROM spans WHERE start_ns < ?", (cutoff,))
            self._db.execute("DELETE FROM spans WHERE span_id IN (SELECT span_id FROM spans ORDER BY start_ns DESC LIMIT -1 OFFSET ?)",
                             (self._max_spans,))

    def shutdown(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def recent_traces(db: apsw.Connection, limit: int, name: str | None = None) -> list[dict[str, Any]]:
    sql = "SELECT trace_id, span_id, remote_parent_id, name, start_ns, end_ns, error, attributes FROM spans WHERE parent_id IS NULL"
    params: list[Any] = []
    if name:
        sql += " AND name = ?"
        params.append(name)
    rows = db.execute(sql + " ORDER BY start_ns DESC LIMIT ?", (*params, limit))
    return [{"trace_id": t, "span_id": s, "remote_parent_id": r, "name": n, "start_ns": a, "duration_ms": (b - a) / 1e6, "error": bool(e),
             "attributes": json.loads(attrs)} for t, s, r, n, a, b, e, attrs in rows]


def trace_tree(db: apsw.Connection, trace_id: str) -> dict[str, Any] | None:
    rows = db.execute("SELECT span_id, parent_id, remote_parent_id, name, start_ns, end_ns, error, attributes FROM spans "
                      "WHERE trace_id = ? ORDER BY start_ns", (trace_id,)).fetchall()
    if not rows:
        return None
    nodes = {sid: {"span_id": sid, "remote_parent_id": r, "name": n, "start_ns": a, "duration_ms": (b - a) / 1e6, "error": bool(e),
                   "attributes": json.loads(attrs), "children": []} for sid, _, r, n, a, b, e, attrs in rows}
    roots = []
    for sid, parent, *_ in rows:
        (nodes[parent]["children"] if parent in nodes else roots).append(nodes[sid])
    return {"trace_id": trace_id, "spans": roots}
