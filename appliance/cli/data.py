"""`appliance backup` and `appliance restore`: the data directory's database, copied while the
server runs and put back while it is stopped (appliance/store/backup.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from appliance.cli.fleet import server_url
from appliance.cli.support import config_in_use, data_dir


def cmd_backup(args: argparse.Namespace) -> int:
    from appliance.store.backup import BackupError, backup
    from appliance.store.db import database_path

    database = database_path(data_dir(config_in_use(args.config)))
    try:
        done = backup(database, args.path)
    except BackupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"backed up {database} to {done.path} ({done.bytes:,} bytes, {done.migrations} migrations); "
          "keep models.toml and the adapters' files with it")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from appliance.store.backup import BackupError, restore
    from appliance.store.db import database_path

    url = server_url(args)
    try:
        httpx.get(f"{url}/health", timeout=2)
        print(f"error: a server answers at {url}: stop it before restoring (its database would change under it)", file=sys.stderr)
        return 1
    except httpx.HTTPError:
        pass  # nothing listening: the database is ours to replace
    database = database_path(data_dir(config_in_use(args.config)))
    try:
        done = restore(args.path, database)
    except BackupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kept = f"; the database it replaced is kept as {done.kept}" if done.kept else ""
    print(f"restored {args.path} to {done.path} ({done.bytes:,} bytes, {done.migrations} migrations){kept}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    backup = sub.add_parser("backup", help="copy the data directory's database to PATH, safely while the server runs")
    backup.add_argument("path", type=Path, help="a new file")
    backup.add_argument("--config", type=Path)
    backup.set_defaults(func=cmd_backup)
    restore = sub.add_parser("restore", help="put a backup in place of the database (the server stopped); the old one is kept")
    restore.add_argument("path", type=Path, help="a file `appliance backup` wrote")
    restore.add_argument("--config", type=Path)
    restore.add_argument("--url", help="where the server would answer (default: the config's host and port)")
    restore.set_defaults(func=cmd_restore)
