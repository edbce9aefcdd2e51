"""Two cheap programs that agree, else the frontier's: replayed on the word-problem programs that
`bench/word_problem_programs.py` kept (no model asked). A word problem's number is accepted when two
cheaper tiers' programs give the same one; otherwise the frontier's program answers. Both cheap
programs are paid for on every problem, so this saves only if they agree often and rightly.

    .venv/bin/python -m bench.program_agreement \\
        --answers bench/runs/word-problem-programs/answers.jsonl \\
        --answers bench/runs/word-problem-programs/first-student.jsonl=first-student \\
        --pair qwen-0.5b,qwen-0.5b:distilled --pair first-student,qwen-0.5b:distilled
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.evaluation.runner import load_checker  # noqa: E402
from policy.programs import NotStraightLine  # noqa: E402
from bench.family_threshold import items as workload_items
from bench.kit.paths import CHECKER
from bench.word_problem_programs import judged, stated_number


def number(reply: str) -> str | None:
    """The program's number as the route would state it, or None where it does not evaluate."""
    try:
        return stated_number(reply)
    except NotStraightLine:
        return None


@dataclass(frozen=True)
class Program:
    number: str | None  # None: it did not evaluate
    right: bool
    cost: int  # nano-dollars


@dataclass(frozen=True)
class Cascade:
    agree: int
    right_where_agreed: int
    right: int
    cost: int


def cascade(problems: list[tuple[Program, Program, Program]]) -> Cascade:
    """Each problem's (cheap, cheap, frontier) programs: the cheap pair is always paid for; their number
    stands where both evaluate to the same one, else the frontier's program is paid for and answers."""
    agreed = [b for a, b, _ in problems if a.number is not None and a.number == b.number]
    asked = [f for a, b, f in problems if a.number is None or a.number != b.number]
    return Cascade(agree=len(agreed), right_where_agreed=sum(p.right for p in agreed),
                   right=sum(p.right for p in agreed) + sum(f.right for f in asked),
                   cost=sum(a.cost + b.cost for a, b, _ in problems) + sum(f.cost for f in asked))


def read(spec: str) -> list[dict[str, Any]]:
    """A kept answers file; `PATH=LABEL` names every row's tier LABEL (a file of one earlier adapter)."""
    path, _, label = spec.partition("=")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{**r, "tier": label} for r in rows] if label else rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", action="append", required=True, metavar="PATH[=LABEL]")
    parser.add_argument("--pair", action="append", required=True, metavar="TIER,TIER")
    parser.add_argument("--frontier", default="qwen-1.5b")
    parser.add_argument("--family", default="gsm8k")
    args = parser.parse_args()
    check = load_checker(CHECKER)
    records = {r["id"]: r for r in workload_items([args.family], ["development", "calibration"])}
    kept: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for spec in args.answers:
        for row in read(spec):
            if row["id"] in records:
                kept[row["id"]][row["tier"]] = row
    pairs = [tuple(p.split(",", 1)) for p in args.pair]
    tiers = {t for pair in pairs for t in pair} | {args.frontier}
    ids = sorted(i for i, by in kept.items() if tiers <= by.keys())
    if not ids:
        raise SystemExit(f"no {args.family} item has programs by all of {sorted(tiers)}")

    def judged_program(item: str, row: dict[str, Any]) -> Program:
        return Program(number(row["reply"]), judged(records[item], row["reply"], check) is True, row["cost"])

    program = {(i, t): judged_program(i, kept[i][t]) for i in ids for t in tiers}  # each judged once
    bill = sum(program[i, args.frontier].cost for i in ids)
    print(f"{len(ids)} {args.family} items (development and calibration); costs as shares of {args.frontier}'s programs")
    print("tier\tprograms right\tcost")
    for tier in sorted(tiers):
        print(f"{tier}\t{sum(program[i, tier].right for i in ids)}\t{sum(program[i, tier].cost for i in ids) / bill:.1%}")
    print("pair\tagree\tright where they agree\tright in all\tcost")
    for a, b in pairs:
        got = cascade([(program[i, a], program[i, b], program[i, args.frontier]) for i in ids])
        print(f"{a} + {b}\t{got.agree}\t{got.right_where_agreed}\t{got.right}\t{got.cost / bill:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
