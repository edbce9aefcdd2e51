"""A mixed labelled set for `appliance eval router`: easy questions with a numeric answer, taking
turns with GSM8K word problems. On GSM8K alone every question needs the frontier tier; a real
workload mixes in questions the smallest tier answers, and that is where routing saves.

    .venv/bin/python -m bench.mixed_set --gsm8k 12 > /tmp/mixed.jsonl
    appliance eval router --config bench/fleets/fleet.toml --file /tmp/mixed.jsonl --limit 24

A calibration (`appliance eval calibrate`) is measured on a held-out part, never on the questions
it is then evaluated on:

    .venv/bin/python -m bench.mixed_set --part calibration --gsm8k 16 > /tmp/calibration.jsonl
    appliance eval router --config bench/fleets/fleet.toml --file /tmp/calibration.jsonl --limit 32 --tiers-only
    appliance eval calibrate --config bench/fleets/fleet.toml --out bench/fleets/fleet-calibration.toml
"""

from __future__ import annotations

import argparse
import json

from appliance.evaluation.runner import gsm8k  # noqa: E402

EASY = [
    ("What is 7 + 5?", 12), ("How many days are in a week?", 7), ("How many legs does a spider have?", 8),
    ("What is 10 minus 3?", 7), ("How many hours are in a day?", 24), ("What is 6 times 2?", 12),
    ("How many months are in a year?", 12), ("What is half of 20?", 10), ("How many sides does a triangle have?", 3),
    ("What is 9 + 1?", 10), ("How many minutes are in an hour?", 60), ("How many wheels does a bicycle have?", 2),
    ("What is 4 + 4?", 8), ("How many sides does a square have?", 4), ("What is 3 times 3?", 9),
    ("How many seconds are in a minute?", 60),
]
# Held out from the evaluation: what `appliance eval calibrate` learns from (`--part calibration`).
EASY_CALIBRATION = [
    ("What is 8 + 6?", 14), ("How many legs does a dog have?", 4), ("What is 15 minus 5?", 10),
    ("How many days are in a leap year?", 366), ("What is 5 times 4?", 20), ("How many eyes does a person have?", 2),
    ("What is double 9?", 18), ("How many corners does a rectangle have?", 4), ("What is 100 divided by 10?", 10),
    ("How many letters are in the word cat?", 3), ("What is 11 + 11?", 22), ("How many weeks are in a year?", 52),
    ("What is 30 minus 12?", 18), ("How many planets are in the solar system?", 8), ("What is 7 times 3?", 21),
    ("How many strings does a standard guitar have?", 6),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gsm8k", type=int, default=12, help="word problems (the first N of GSM8K's test split)")
    parser.add_argument("--part", choices=("evaluation", "calibration"), default="evaluation",
                        help="calibration: other easy questions and the GSM8K problems after the evaluation's first 24")
    args = parser.parse_args()
    if args.part == "evaluation":
        hard, pool = gsm8k(args.gsm8k), EASY
    else:  # never overlaps an evaluation of up to 24 problems
        hard, pool = gsm8k(24 + args.gsm8k)[24:], EASY_CALIBRATION
    easy = pool[: len(hard)] if len(hard) <= len(pool) else pool
    for i in range(max(len(hard), len(easy))):
        for pool in (easy, hard):
            if i < len(pool):
                question, answer = pool[i]
                print(json.dumps({"question": question, "answer": f"#### {answer}"}))


if __name__ == "__main__":
    main()
