"""What the `appliance` command's groups share: the config in use, its data directory and
database, and how rows and times are printed."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.config.settings import ConfigError, RouteSettings, Settings, find_config, load_settings


def settings_of(config: Path | None) -> Settings:
    return load_settings(find_config(config))


def route_named(settings: Settings, alias: str) -> RouteSettings | None:
    """The route a command names, or None after saying on stderr that the config has none."""
    route = settings.route(alias)
    if route is None:
        print(f"error: {settings.file}: routes: no route with alias {alias!r}", file=sys.stderr)
    return route


def config_in_use(config: Path | None) -> Settings | None:
    """The config's settings; None when none was named and there is no config file to find."""
    try:
        return settings_of(config)
    except ConfigError as exc:
        if config is not None or exc.key != "(file)":
            raise
        return None


def data_dir(settings: Settings | None) -> Path:
    from appliance.config.paths import default_data_dir

    return settings.server.data_dir if settings is not None else default_data_dir()


def ledger_db(config: Path | None):  # type: ignore[no-untyped-def]
    """The data directory's database, migrated; the config names the directory when there is one."""
    return ledger_of(config_in_use(config))


def ledger_of(settings: Settings | None):  # type: ignore[no-untyped-def]
    from appliance.store.db import connect, database_path, migrate

    db = connect(database_path(data_dir(settings)))
    migrate(db)
    return db


def moment(text: str, now: float, direction: int, flag: str) -> float:
    """A duration from now, forward (direction 1) or back (-1): '30d', '12h', '45m', '90s'; or an
    ISO 8601 date or time (UTC unless it says otherwise). A ValueError names `flag`."""
    from datetime import datetime, timezone

    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[:-1].isdigit() and text[-1:] in units:
        return now + direction * int(text[:-1]) * units[text[-1]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is neither a duration (30d, 12h, 45m, 90s) nor an ISO 8601 date") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def when(epoch: float | None) -> str:
    from datetime import datetime, timezone

    return "-" if epoch is None else datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    if not sys.stdout.isatty():  # scripts get tab-separated lines, never a wrapped table
        for row in (header, *rows):
            print("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
