"""The appliance's SQLite database: apsw with WAL, a busy timeout, foreign keys, and named
migrations recorded in the database itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import apsw
import apsw.bestpractice
import apsw.ext

import sqlite_vec

from appliance.store import answer_entries as cache_store, keys as keystore, ledger

Migration = tuple[str, Callable[[apsw.Connection], None]]

_applied_best_practice = False


SYNCHRONOUS = ("normal", "full")


def connect(path: Path | str, synchronous: str = "normal") -> apsw.Connection:
    """WAL with synchronous=NORMAL by default: a commit survives the process dying (kill -9
    included) but the last ones may roll back on power loss; "full" syncs every commit (about
    2.8 times slower ledger writes here, docs/performance.md)."""
    global _applied_best_practice
    if not _applied_best_practice:
        # WAL, busy timeout, foreign keys, no double-quoted strings; applies to each new connection.
        # Not `PRAGMA optimize` at every connect: with several connections opening at once it can
        # fail with SQLITE_BUSY without waiting (it reads, then wants to write).
        skip = (apsw.bestpractice.library_logging, apsw.bestpractice.connection_optimize)
        apsw.bestpractice.apply(tuple(f for f in apsw.bestpractice.recommended if f not in skip))
        # SQLite's own log, minus its notes (a statement re-prepared after a migration is routine).
        sqlite_log = logging.getLogger("appliance.sqlite")
        sqlite_log.setLevel(logging.WARNING)
        apsw.ext.log_sqlite(logger=sqlite_log)
        _applied_best_practice = True
    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path = str(path)
    db = apsw.Connection(path)
    db.enable_load_extension(True)
    db.load_extension(sqlite_vec.loadable_path())  # vec0 tables for the semantic cache
    db.enable_load_extension(False)
    # Writers queue on BEGIN IMMEDIATE; SQLite's busy handler is not fair, so under contention
    # one can wait well past the 100 ms best-practice default.
    db.set_busy_timeout(10_000)
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}")
    db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
    return db


def _create_request_log(db: apsw.Connection) -> None:
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


def _request_log_principal(db: apsw.Connection) -> None:
    for column in ("tenant TEXT", "app TEXT", "user TEXT", "key_id TEXT", "cost_nanos INTEGER"):
        db.execute(f"ALTER TABLE request_log ADD COLUMN {column}")


def _create_spans(db: apsw.Connection) -> None:
    from appliance.store.traces import create_tables

    create_tables(db)


def _spans_remote_parent(db: apsw.Connection) -> None:
    from appliance.store.traces import add_remote_parent

    add_remote_parent(db)


def _create_eval_runs(db: apsw.Connection) -> None:
    from appliance.evaluation.runner import create_tables

    create_tables(db)


def _create_eval_answers(db: apsw.Connection) -> None:
    from appliance.evaluation.runner import create_answer_table

    create_answer_table(db)


def _create_responses(db: apsw.Connection) -> None:
    from appliance.store.responses import create_tables

    create_tables(db)


def _create_eval_questions(db: apsw.Connection) -> None:
    from appliance.evaluation.runner import create_question_table

    create_question_table(db)


def _create_kept_answers(db: apsw.Connection) -> None:
    from appliance.store.kept_answers import create_tables

    create_tables(db)


MIGRATIONS: tuple[Migration, ...] = (
    ("0001_request_log", _create_request_log),
    ("0002_api_keys", keystore.create_tables),
    ("0003_budget_ledger", ledger.create_tables),
    ("0004_request_log_principal", _request_log_principal),
    ("0005_semantic_cache", cache_store.create_tables),
    ("0006_spans", _create_spans),
    ("0007_eval_runs", _create_eval_runs),
    ("0008_eval_answers", _create_eval_answers),
    ("0009_eval_questions", _create_eval_questions),
    ("0010_spans_remote_parent", _spans_remote_parent),
    ("0011_responses", _create_responses),
    ("0012_kept_answers", _create_kept_answers),
    ("0013_auth_failure_counts", keystore.count_failures),
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
