"""Every change the CLI and the admin API make to models.toml goes through here.

Values go through tomlkit, never into text by hand, so a value cannot add a key; tomlkit keeps the
operator's comments and layout. The new text must parse as the server would read it before it
replaces the file, and it replaces it by a rename, so a failure leaves the old file whole.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from appliance.settings import ConfigError, Settings, parse_settings


def append_table(config: Path, array: str, values: dict[str, Any]) -> Settings:
    """Adds a `[[array]]` table holding `values` at the end of that array; returns the new file's
    settings, or raises ConfigError (naming the file and key) and leaves the file as it was."""
    text = config.read_text()
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ConfigError(str(config), "(syntax)", str(exc)) from None
    table = tomlkit.table()
    for key, value in values.items():
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
