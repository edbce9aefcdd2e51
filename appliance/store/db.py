"""The appliance's SQLite database: named migrations recorded in the database itself, each one a
table module's function. Opening a connection is `connection.py`'s (`connect` is here too, for
the callers that open and migrate in one import)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import apsw

from appliance.store import answer_entries as cache_store, eval_runs, keys as keystore, kept_answers, ledger, request_log, responses
from appliance.store.connection import connect

__all__ = ["MIGRATIONS", "Migration", "connect", "database_path", "migrate"]

Migration = tuple[str, Callable[[apsw.Connection], None]]


# The spans' module is an OpenTelemetry exporter: imported only when a migration needs it.
def _create_spans(db: apsw.Connection) -> None:
    from appliance.store.traces import create_tables

    create_tables(db)


def _spans_remote_parent(db: apsw.Connection) -> None:
    from appliance.store.traces import add_remote_parent

    add_remote_parent(db)


MIGRATIONS: tuple[Migration, ...] = (
    ("0001_request_log", request_log.create_tables),
    ("0002_api_keys", keystore.create_tables),
    ("0003_budget_ledger", ledger.create_tables),
    ("0004_request_log_principal", request_log.add_principal),
    ("0005_semantic_cache", cache_store.create_tables),
    ("0006_spans", _create_spans),
    ("0007_eval_runs", eval_runs.create_tables),
    ("0008_eval_answers", eval_runs.create_answer_table),
    ("0009_eval_questions", eval_runs.create_question_table),
    ("0010_spans_remote_parent", _spans_remote_parent),
    ("0011_responses", responses.create_tables),
    ("0012_kept_answers", kept_answers.create_tables),
    ("0013_auth_failure_counts", keystore.count_failures),
    ("0014_cache_consistent_state", cache_store.allow_consistent),
    ("0015_cache_hit_scores", cache_store.score_hits),
    ("0016_cache_vector_chunks", cache_store.small_vector_chunks),
    ("0017_cache_labelled_traps", cache_store.labelled_traps_table),
    ("0018_cache_trap_cosines", cache_store.trap_cosines_table),
    ("0019_cache_judgements", cache_store.judgements_table),
)


def migrate(db: apsw.Connection, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[str]:
    """Applies each migration not yet recorded, each in its own transaction; returns their names."""
    db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL) STRICT")
    done = {row[0] for row in db.execute("SELECT name FROM migrations")}
    applied = []
    for name, step in migrations:
        if name in done:
            continue
        with db:
            step(db)
            db.execute("INSERT INTO migrations(name, applied_at) VALUES (?, ?)", (name, time.time()))
        applied.append(name)
    return applied


def database_path(data_dir: Path) -> Path:
    return data_dir / "appliance.db"
