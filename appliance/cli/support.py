"""What the `appliance` command's groups share: the config in use, its data directory and
database, and how rows and times are printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


# Columns a user copies into another command or a shell: printed whole, never cut or wrapped.
WHOLE_COLUMNS = frozenset({"id", "alias", "model", "name", "file", "path", "sha256", "url", "target", "route", "request_id"})
_NARROWEST = 8  # a column that may wrap is not made narrower than this (or its longest cell)


def rows_renderable(header: tuple[str, ...], rows: list[tuple[str, ...]], width: int) -> Any:
    """A table (cells may hold rich markup) whose WHOLE_COLUMNS are never cut; where the width cannot
    hold them whole beside the others, each row as `column: value` lines instead."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def cells(i: int) -> list[int]:
        return [Text.from_markup(header[i]).cell_len, *(Text.from_markup(r[i]).cell_len for r in rows)]

    longest = [max(cells(i)) for i in range(len(header))]
    whole = [name in WHOLE_COLUMNS for name in header]
    # A rich table's width: its columns, a space of padding either side of each, and a rule between and around them.
    least = sum(n if w else min(n, _NARROWEST) for n, w in zip(longest, whole)) + 3 * len(header) + 1
    if least > width:
        label = max(len(name) for name in header)
        blocks: list[Any] = []
        for row in rows:
            blocks += [Text.from_markup(f"[bold]{name:>{label}}[/bold]: {cell}") for name, cell in zip(header, row)] + [Text("")]
        return Group(*blocks)
    table = Table()
    for name, w, n in zip(header, whole, longest):
        if w:
            table.add_column(name, no_wrap=True, min_width=n)
        else:
            table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    if not sys.stdout.isatty():  # scripts get tab-separated lines, never a wrapped table
        for row in (header, *rows):
            print("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    shown = rows_renderable(header, rows, console.width)
    # soft_wrap: a record's line longer than the terminal (a long path) is left for the terminal to wrap, never cut
    console.print(shown, soft_wrap=not isinstance(shown, Table))
