"""`appliance distill ...`: the appliance teaches its cheapest tier from its own verified answers.
`export` is the collect step (appliance/distill_export.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from appliance.cli_support import ledger_of, moment, settings_of


def cmd_distill_export(args: argparse.Namespace) -> int:
    from appliance.distill_export import HELD_OUT, TRAIN, Asked, ExportError, export

    settings = settings_of(args.config)
    now = time.time()
    try:
        start = moment(args.since, now, -1, "--since")
        if start >= now:
            raise ValueError(f"--since: {args.since!r} is not in the past; give a window such as 7d or a date before now")
        held_out = float(args.held_out)
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("--") else f"--held-out: {args.held_out!r} is not a number; give a share such as 0.1"
        print(f"error: {message}", file=sys.stderr)
        return 2
    asked = Asked(args.route, now - start, args.out, args.family, held_out, args.seed)
    db = ledger_of(settings)
    try:
        chosen = export(db, settings, asked, now)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        db.close()
    c = chosen.counts
    print(f"found: {c.found} kept answers of route {args.route!r}" + (f", family {args.family!r}" if args.family else "") + f" since {args.since}")
    print(f"verified: {c.verified}")
    print(f"opted in: {c.opted_in}")
    print(f"dropped for personal data: {c.personal_data}")
    print(f"duplicates: {c.duplicates}")
    print(f"train: {c.train} -> {args.out / TRAIN}")
    print(f"held out: {c.held_out} -> {args.out / HELD_OUT}")
    return 0


def add_export_command(distill: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    export = distill.add_parser("export", help="verified answers of opted-in tenants as chat-format JSONL: train and held-out files")
    export.add_argument("--route", default="auto", help="the route whose answers to export; its last tier is the frontier (default: auto)")
    export.add_argument("--family", help="only answers whose request named this task family (metadata {\"family\": ...})")
    export.add_argument("--since", default="7d", help="answers kept since: a duration back from now (7d, 12h) or an ISO 8601 date")
    export.add_argument("--out", type=Path, required=True, help="the folder to write train.jsonl, held-out.jsonl and export.json into")
    export.add_argument("--held-out", default="0.1", help="the share of prompts held out of training (default 0.1)")
    export.add_argument("--seed", type=int, default=0, help="another seed, another (still deterministic) split")
    export.add_argument("--config", type=Path)
    export.set_defaults(func=cmd_distill_export)
