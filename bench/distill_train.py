"""How fast `appliance distill train` trains on this machine, and so how long 500 examples take.

Examples come from the economics workload's checkable families (bench/workload/splits: by default
classification and extraction, each prompt with its gold answer as the verified reply), repeated in
turn to --examples. The real CLI trains for --steps on them, in a temporary data directory, and the
rate it measured (training.json: steps, seconds, excluding the student's load) is scaled to
--target examples x --epochs.

    .venv/bin/python -m bench.distill_train --steps 40 [--threads 2] [--student-file PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.kit.paths import ROOT, SPLITS
from bench.kit.peers import PACKAGE_FILE


def gold_reply(row: dict) -> str | None:
    check = row["check"]
    if check["type"] == "label":
        return str(check["gold"])
    if check["type"] == "json_fields":
        return json.dumps(check["gold"])
    return None


def examples(families: set[str], count: int) -> list[dict]:
    rows = [json.loads(line) for split in ("calibration", "development", "evaluation") for line in (SPLITS / f"{split}.jsonl").open()]
    usable = [(r, gold_reply(r)) for r in rows if r["family"] in families]
    usable = [(r, reply) for r, reply in usable if reply]
    if not usable:
        raise SystemExit(f"no rows with gold answers in families {sorted(families)}")
    return [{"messages": [*usable[i % len(usable)][0]["messages"], {"role": "assistant", "content": usable[i % len(usable)][1]}]}
            for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to time")
    parser.add_argument("--examples", type=int, default=500, help="examples in the data file")
    parser.add_argument("--target", type=int, default=500, help="the run size to extrapolate to")
    parser.add_argument("--epochs", type=float, default=2.0, help="epochs of the extrapolated run (the CLI's default)")
    parser.add_argument("--families", default="classification,extraction")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--student-file", type=Path, help="a GGUF to train (default: the bundled SmolLM2-135M)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        work = Path(tmp)
        data = work / "examples.jsonl"
        data.write_text("".join(json.dumps(e) + "\n" for e in examples(set(args.families.split(",")), args.examples)))
        source = f'path = "{args.student_file.resolve()}"' if args.student_file else f'package_file = "{PACKAGE_FILE}"'
        (work / "models.toml").write_text(f'[[models]]\nalias = "student"\n{source}\ncontext_length = 2048\nthreads = {args.threads}\n')
        command = [sys.executable, "-m", "appliance.cli.main", "distill", "train", "--config", str(work / "models.toml"), "--student", "student",
                   "--data", str(data), "--out", "bench", "--steps", str(args.steps), "--threads", str(args.threads),
                   "--batch-size", str(args.batch_size), "--rank", str(args.rank), "--save-every", str(args.steps), "--url", "http://127.0.0.1:9"]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "APPLIANCE_HOME": str(work / "home")}, capture_output=True, text=True)
        wall = time.monotonic() - started
        if done.returncode != 0:
            print(done.stdout, done.stderr, file=sys.stderr)
            return 1
        record = json.loads((work / "home" / "adapters" / "student" / "bench" / "training.json").read_text())
        seconds = record["seconds_this_session"]
        per_step = seconds / record["steps"]
        rate = args.batch_size / per_step
        steps_target = math.ceil(args.epochs * math.ceil(args.target / args.batch_size))
        load = wall - seconds
        minutes = (steps_target * per_step + load) / 60
        result = {"student": args.student_file.name if args.student_file else PACKAGE_FILE, "families": args.families, "threads": args.threads,
                  "batch_size": args.batch_size, "rank": args.rank, "steps": record["steps"], "train_seconds": seconds,
                  "seconds_per_step": round(per_step, 2), "examples_per_second": round(rate, 2), "load_and_write_seconds": round(load, 1),
                  "final_loss": record["final_loss"], "target_examples": args.target, "target_epochs": args.epochs,
                  "target_minutes": round(minutes, 1)}
    print(f"{result['steps']} steps in {seconds:.0f}s: {per_step:.2f} s/step, {rate:.2f} examples/s "
          f"(batch {args.batch_size}, rank {args.rank}, {args.threads} threads); load and write {load:.0f}s")
    print(f"{args.target} examples x {args.epochs:g} epochs = {steps_target} steps: about {minutes:.1f} minutes")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
