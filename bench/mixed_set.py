"""A mixed labelled set for `appliance eval router`: easy questions with a numeric answer, taking
turns with GSM8K word problems. On GSM8K alone every question needs the frontier tier; a real
workload mixes in questions the smallest tier answers, and that is where routing saves.

    .venv/bin/python bench/mixed_set.py --gsm8k 12 > /tmp/mixed.jsonl
    appliance eval router --config bench/fleet.toml --file /tmp/mixed.jsonl --limit 24
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.evaluate import gsm8k  # noqa: E402

EASY = [
    ("What is 7 + 5?", 12), ("How many days are in a week?", 7), ("How many legs does a spider have?", 8),
    ("What is 10 minus 3?", 7), ("How many hours are in a day?", 24), ("What is 6 times 2?", 12),
    ("How many months are in a year?", 12), ("What is half of 20?", 10), ("How many sides does a triangle have?", 3),
    ("What is 9 + 1?", 10), ("How many minutes are in an hour?", 60), ("How many wheels does a bicycle have?", 2),
    ("What is 4 + 4?", 8), ("How many sides does a square have?", 4), ("What is 3 times 3?", 9),
    ("How many seconds are in a minute?", 60),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gsm8k", type=int, default=12, help="word problems (the first N of GSM8K's test split)")
    args = parser.parse_args()
    hard = gsm8k(args.gsm8k)
    easy = EASY[: len(hard)] if len(hard) <= len(EASY) else EASY
    for i in range(max(len(hard), len(easy))):
        for pool in (easy, hard):
            if i < len(pool):
                question, answer = pool[i]
                print(json.dumps({"question": question, "answer": f"#### {answer}"}))


if __name__ == "__main__":
    main()
