"""What the trainer process and its two trainers share: the checkpoints a run leaves on disk, and
the exit code that says a run stopped because it was asked to (the server reads it: train/job.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CANCELLED_EXIT = 3


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint the trainer finished writing (it writes trainer_state.json last);
    half-written ones, from a process killed while saving, are removed."""
    complete = []
    for path in folder.glob("checkpoint-*") if folder.is_dir() else ():
        try:
            json.loads((path / "trainer_state.json").read_text())
            complete.append((int(path.name.rpartition("-")[2]), path))
        except (OSError, ValueError):
            shutil.rmtree(path, ignore_errors=True)
    return max(complete)[1] if complete else None
