"""`appliance distill export`: the kept answers (appliance/store/kept_answers.py) through the
collect step's decisions (policy/distill.py) into chat-format JSONL, in one folder:

- `train.jsonl`: the training examples, one `{"messages": [...]}` a line;
- `held-out.jsonl`: the held-out part, never trained on (distillation's evaluation reads it);
- `export.json`: what was asked (route, tiers, family, window, share, seed) and the counts.

The files are written into a new folder that then takes `--out`'s place, so a failure leaves
`--out` as it was, and an export never sits beside another's files."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.config.settings import Settings
from appliance.store import kept_answers
from appliance.store.connection import Connection
from policy.distill import Counts, Example, Selection, Wanted, select

TRAIN, HELD_OUT, MANIFEST = "train.jsonl", "held-out.jsonl", "export.json"


class ExportError(Exception):
    """A one-line problem that says what to do."""


@dataclass(frozen=True)
class Asked:
    route: str
    since_s: float
    out: Path
    family: str | None = None
    held_out: float = 0.1
    seed: int = 0


def wanted(settings: Settings, asked: Asked) -> Wanted:
    route = settings.route(asked.route)
    if route is None:
        known = ", ".join(r.alias for r in settings.routes) or "none"
        raise ExportError(f"--route: {settings.file} has no route {asked.route!r} (its routes: {known}); name one of its [[routes]] aliases")
    if not 0.0 <= asked.held_out < 1.0:
        raise ExportError(f"--held-out: {asked.held_out} is not a share from 0 up to (not including) 1, such as 0.1")
    if not settings.distill.tenants:
        raise ExportError(f"no tenant has opted in: add [distill] tenants = [\"...\"] to {settings.file}; their answers are kept from then on")
    return Wanted(route.alias, route.tiers, frozenset(settings.distill.tenants), asked.family, asked.held_out, asked.seed)


def export(db: Connection, settings: Settings, asked: Asked, now: float | None = None) -> Selection:
    """Selects and writes the examples; raises ExportError (and writes nothing) when there are none."""
    now = time.time() if now is None else now
    want = wanted(settings, asked)
    rows = kept_answers.since(db, now - asked.since_s)
    chosen = select(rows, want)
    if not chosen.train:
        raise ExportError(_why_none(rows, want, chosen.counts))
    _write(asked.out, {
        TRAIN: _jsonl(chosen.train),
        HELD_OUT: _jsonl(chosen.held_out),
        MANIFEST: json.dumps(_manifest(want, asked, now, chosen.counts), indent=2) + "\n",
    })
    return chosen


def _why_none(rows: list[Any], want: Wanted, counts: Counts) -> str:
    if want.family is not None and rows and all(k.family is None for k in rows):
        return (f"--family: no kept answer names a family; requests name theirs in metadata {{\"family\": \"{want.family}\"}}, "
                "or leave --family out to export every family")
    if counts.found == 0:
        return (f"no kept answers of route {want.route!r}" + (f" and family {want.family!r}" if want.family else "")
                + " in that window: widen --since, or check that [distill] tenants names the tenants who send them")
    return (f"no training examples: {counts.found} found, {counts.verified} verified, {counts.opted_in} opted in, {counts.personal_data} "
            f"with personal data, {counts.duplicates} duplicates, {counts.held_out} held out; mark good answers with POST /v1/cache/feedback, "
            "or widen --since")


def _jsonl(examples: tuple[Example, ...]) -> str:
    return "".join(json.dumps(e.record(), ensure_ascii=False) + "\n" for e in examples)


def _manifest(want: Wanted, asked: Asked, now: float, counts: Counts) -> dict[str, Any]:
    return {"route": want.route, "tiers": list(want.tiers), "family": want.family, "since_s": asked.since_s, "exported_at": now,
            "held_out_share": want.held_out, "seed": want.seed, "tenants": sorted(want.tenants), "counts": asdict(counts),
            "files": {"train": TRAIN, "held_out": HELD_OUT}}


def _write(folder: Path, files: dict[str, str]) -> None:
    """The files into a new folder beside `folder`, then swapped into its place: a reader sees the
    earlier export or this one, never a train file of one beside the held-out file of another."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.exists() and not folder.is_dir():
            raise ExportError(f"--out: {folder} is a file; name a folder")
        stray = sorted(p.name for p in folder.iterdir() if p.name not in files) if folder.exists() else []
        if stray:  # never swap away a folder that holds anything but an earlier export
            raise ExportError(f"--out: {folder} holds other files ({', '.join(stray[:3])}); name a new folder or an earlier export's")
        temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".part", dir=folder.parent))
    except OSError as exc:
        raise ExportError(f"--out: cannot write into {folder.parent}: {exc.strerror}; name a folder you can write to") from None
    try:
        for name, text in files.items():
            (temp / name).write_text(text, encoding="utf-8")
        temp.chmod(0o755)  # mkdtemp's folder is private; an export is an ordinary folder
        if folder.exists():
            old = temp.with_suffix(".old")
            os.rename(folder, old)
            os.rename(temp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, folder)
    except OSError as exc:
        shutil.rmtree(temp, ignore_errors=True)
        if temp.with_suffix(".old").exists() and not folder.exists():
            os.rename(temp.with_suffix(".old"), folder)  # the earlier export back in its place
        raise ExportError(f"--out: cannot write into {folder}: {exc.strerror}; name a folder you can write to") from None
