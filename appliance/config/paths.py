"""Where the appliance keeps its state: `$APPLIANCE_HOME`, else the platform's data directory."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def default_data_dir() -> Path:
    home = os.environ.get("APPLIANCE_HOME")
    if home:
        return Path(home).expanduser().resolve()
    return Path(platformdirs.user_data_dir("appliance", appauthor=False))
