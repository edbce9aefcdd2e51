"""Every change the CLI and the admin API make to models.toml goes through here.

Values go through tomlkit, never into text by hand, so a value cannot add a key; tomlkit keeps the
operator's comments and layout. Each value is written as its key's declaration says (a path as text,
a keep_alive as the duration it was given) and checked against that declaration first, so a bad one
is refused naming its key before the file is touched. The new text must then parse as the server
would read it, and it replaces the file by a rename, so a failure leaves the old file whole.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from appliance.config_schema import Where, decode, keys_of, to_toml
from appliance.settings import ConfigError, Settings, parse_settings, table_type


def table_values(config: Path, array: str, index: int, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (typed, as the settings hold them, or plain TOML values) as the TOML values of
    `[[array]]` table number `index`, checked against the declarations of that table's keys."""
    cls = table_type(array, values)
    declared = {k.name: k for k in keys_of(cls)}
    encoded = {name: to_toml(value, declared[name].type if name in declared else None) for name, value in values.items()}
    decode(cls, encoded, f"{array}[{index}]", Where(str(config), config.resolve().parent))  # refuses what the reader would
    return encoded


def append_table(config: Path, array: str, values: dict[str, Any]) -> Settings:
    """Adds a `[[array]]` table holding `values` at the end of that array; returns the new file's
    settings, or raises ConfigError (naming the file and key) and leaves the file as it was."""
    text = config.read_text()
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ConfigError(str(config), "(syntax)", str(exc)) from None
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
    new_text = tomlkit.dumps(doc)
    settings = parse_settings(new_text, str(config), config.resolve().parent)
    replace_file(config, new_text)
    return settings


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
