"""A consistent copy of the appliance's database, made while it serves, and putting one back.

SQLite's online backup copies every page under one read transaction, so writers (the ledger, the
cache, traces) go on in WAL mode and the copy is the database as of one moment. A restore checks
the copy first (integrity, and that it holds no migration this code does not know), keeps the
database it replaces beside it, and writes the copy in through the same backup API, so the WAL
files of the old database cannot outlive it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import apsw

from appliance.store.connection import connect
from appliance.store.db import MIGRATIONS


class BackupError(Exception):
    pass


@dataclass(frozen=True)
class Copied:
    path: Path
    bytes: int
    migrations: int  # how many migrations the copy has applied
    kept: Path | None = None  # on a restore: the database it replaced, kept beside it


def _copy(source: apsw.Connection, target: Path) -> None:
    dest = connect(target)
    try:
        with dest.backup("main", source, "main") as backup:
            backup.step(-1)  # every page in one step: one read transaction, one moment
        # One self-contained file (no -wal or -shm beside it); the server turns WAL on again when it opens one.
        dest.execute("PRAGMA journal_mode=DELETE")
    finally:
        dest.close()


def _checked(path: Path) -> int:
    """The copy's migration count, once SQLite finds it sound and this code knows every migration in it."""
    try:
        db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)  # looked at, never changed
        try:
            verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
            if verdict != "ok":
                raise BackupError(f"{path}: the database is damaged: {verdict}")
            applied = {row[0] for row in db.execute("SELECT name FROM migrations")}
        finally:
            db.close()
    except apsw.SQLError:
        raise BackupError(f"{path}: not an appliance database (no migrations table)") from None
    except apsw.Error as exc:
        raise BackupError(f"{path}: not a database SQLite can read ({exc})") from None
    unknown = applied - {name for name, _ in MIGRATIONS}
    if unknown:
        raise BackupError(f"{path}: made by a newer appliance (migrations {', '.join(sorted(unknown))}); upgrade before restoring it")
    return len(applied)


def backup(database: Path, target: Path) -> Copied:
    if not database.is_file():
        raise BackupError(f"{database}: there is no database to back up")
    if target.exists():
        raise BackupError(f"{target}: already exists; name a new file")
    source = connect(database)
    try:
        _copy(source, target)
    finally:
        source.close()
    return Copied(target, target.stat().st_size, _checked(target))


def restore(copy: Path, database: Path) -> Copied:
    """Puts `copy` in place of `database` (the server stopped), keeping the replaced one as
    `<database>.before-restore-<time>`."""
    if not copy.is_file():
        raise BackupError(f"{copy}: there is no such backup")
    migrations = _checked(copy)
    kept = None
    if database.is_file():
        kept = database.with_name(f"{database.name}.before-restore-{time.strftime('%Y%m%dT%H%M%S')}")
        backup(database, kept)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
    source = connect(copy)
    try:
        _copy(source, database)
    finally:
        source.close()
    return Copied(database, database.stat().st_size, migrations, kept)
