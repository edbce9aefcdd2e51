"""Every change the CLI and the admin API make to models.toml goes through here.

Values go through tomlkit, never into text by hand, so a value cannot add a key; tomlkit keeps the
operator's comments and layout. Each value is written as its key's declaration says (a path as text,
a keep_alive as the duration it was given) and checked against that declaration first, so a bad one
is refused naming its key before the file is touched. The new text must then parse as the server
would read it, and it replaces the file by a rename, so a failure leaves the old file whole.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from appliance.config.schema import Where, decode, keys_of, to_toml
from appliance.config.settings import ConfigError, Settings, parse_settings, table_type


def table_values(config: Path, array: str, index: int, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (typed, as the settings hold them, or plain TOML values) as the TOML values of
    `[[array]]` table number `index`, checked against the declarations of that table's keys."""
    cls = table_type(array, values)
    declared = {k.name: k for k in keys_of(cls)}
    encoded = {name: to_toml(value, declared[name].type if name in declared else None) for name, value in values.items()}
    decode(cls, encoded, f"{array}[{index}]", Where(str(config), config.resolve().parent))  # refuses what the reader would
    return encoded


@contextmanager
def _locked(config: Path) -> Iterator[None]:
    """One writer at a time across processes (the server and the CLI), so no change is lost
    between reading the file and replacing it."""
    folder = os.open(config.resolve().parent, os.O_RDONLY)  # its folder: the file itself is replaced by a rename
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def _edit(config: Path, change: Callable[[tomlkit.TOMLDocument], None]) -> Settings:
    """Reads the file, applies `change` to its document, and replaces the file once the new text
    parses as the server reads it; returns the new settings, or raises ConfigError (naming the
    file and key) and leaves the file as it was."""
    with _locked(config):
        try:
            doc = tomlkit.parse(config.read_text())
        except OSError as exc:
            raise ConfigError(str(config), "(file)", f"cannot read: {exc.strerror}") from None
        except TOMLKitError as exc:
            raise ConfigError(str(config), "(syntax)", str(exc)) from None
        change(doc)
        new_text = tomlkit.dumps(doc)
        settings = parse_settings(new_text, str(config), config.resolve().parent)
        replace_file(config, new_text)
        return settings


def append_table(config: Path, array: str, values: dict[str, Any]) -> Settings:
    """Adds a `[[array]]` table holding `values` at the end of that array; returns the new file's
    settings, or raises ConfigError (naming the file and key) and leaves the file as it was."""

    def change(doc: tomlkit.TOMLDocument) -> None:
        table = tomlkit.table()
        for key, value in table_values(config, array, len(doc.get(array, [])), values).items():
            table.add(key, value)
        # A blank line between tables as the operator spaced them: the new table takes over the spacing
        # of the one it follows.
        previous = doc[array][-1].as_string() if array in doc else tomlkit.dumps(doc)
        if previous.endswith("\n\n"):
            table.add(tomlkit.nl())
        elif previous:
            table.trivia.indent = "\n"
        if array in doc:
            doc[array].append(table)
        else:
            doc.append(array, tomlkit.aot())
            doc[array].append(table)

    return _edit(config, change)


def _find(config: Path, doc: tomlkit.TOMLDocument, array: str, alias: str) -> int:
    for index, table in enumerate(doc.get(array, [])):
        if table.get("alias") == alias:
            return index
    raise ConfigError(str(config), array, f"there is no table with alias {alias!r}")


def remove_table(config: Path, array: str, alias: str) -> Settings:
    """Removes the `[[array]]` table whose alias is `alias`; refused (ConfigError naming what
    still refers to it) when the rest of the file would no longer parse."""

    def change(doc: tomlkit.TOMLDocument) -> None:
        tables = doc[array] if array in doc else []
        del tables[_find(config, doc, array, alias)]
        if not tables:
            del doc[array]

    return _edit(config, change)


def update_table(config: Path, array: str, alias: str, values: dict[str, Any]) -> Settings:
    """Sets `values` in the `[[array]]` table whose alias is `alias`, each checked against its
    key's declaration; a None value removes the key (its default applies again). The table's
    other keys and comments stay."""

    def change(doc: tomlkit.TOMLDocument) -> None:
        index = _find(config, doc, array, alias)
        table = doc[array][index]
        if "alias" in values and values["alias"] != alias:
            raise ConfigError(str(config), f"{array}[{index}].alias", "an alias cannot be changed; add the model under the new alias and remove the old one")
        merged = {k: v for k, v in table.unwrap().items() if k not in values} | {k: v for k, v in values.items() if v is not None}
        encoded = table_values(config, array, index, merged)
        for key, value in values.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = encoded[key]

    return _edit(config, change)


def append_nested(config: Path, array: str, alias: str, key: str, values: dict[str, Any]) -> Settings:
    """Adds `values` as one more `[[array.key]]` table (a model's adapter) of the `[[array]]` table
    whose alias is `alias`, checked with the whole table against its declarations; the table's
    other keys and comments stay."""

    def change(doc: tomlkit.TOMLDocument) -> None:
        index = _find(config, doc, array, alias)
        table = doc[array][index]
        existing = table.get(key)
        new = {k: to_toml(v) for k, v in values.items()}
        merged = table.unwrap() | {key: [*(existing.unwrap() if existing is not None else []), new]}
        entry = table_values(config, array, index, merged)[key][-1]
        if existing is None:
            spaced = table.as_string().endswith("\n\n")  # a blank line before the next table, as the operator spaced them
            table.append(key, tomlkit.aot())
            existing = table[key]
        else:
            spaced = isinstance(existing, tomlkit.items.AoT) and len(existing) > 0 and existing[-1].as_string().endswith("\n\n")
        if isinstance(existing, tomlkit.items.AoT):
            item = tomlkit.table()
            for k, v in entry.items():
                item.add(k, v)
            if spaced:
                item.add(tomlkit.nl())
            existing.append(item)
        else:  # written inline by the operator: stays inline
            inline = tomlkit.inline_table()
            inline.update(entry)
            existing.append(inline)

    return _edit(config, change)


def restore(config: Path, before: str, written: str) -> bool:
    """Puts back the text a change replaced, when the running server could not apply it; only
    while the file still holds that change (another writer's later change stays)."""
    with _locked(config):
        if config.read_text() != written:
            return False
        replace_file(config, before)
        return True


def replace_file(config: Path, text: str) -> None:
    """Written beside the file (a symlinked config: beside its target), flushed to disk, then
    renamed over it; the file keeps its permissions."""
    target = config.resolve()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
