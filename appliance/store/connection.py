"""Opening the appliance's SQLite database: apsw with WAL, a busy timeout, foreign keys and the
sqlite-vec extension, on every connection the server, its threads and its tools open."""

from __future__ import annotations

import logging
from pathlib import Path

import apsw
import apsw.bestpractice
import apsw.ext

import sqlite_vec

# For modules outside the store that pass a connection along without opening or querying it.
Connection = apsw.Connection

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
