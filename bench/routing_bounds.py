"""What any router can reach with a fleet, from a stored run's answers by every tier (an `appliance
eval export` of the calibration or development split; never the evaluation split): no model is asked.

- each family's accuracy and share of always-frontier's bill, tier by tier;
- the oracle (each question to the cheapest tier that gets it right, the cheapest tier when none
  does), and the oracle with one family pinned to one tier: the bound for a router that cannot tell
  that family's questions apart;
- the best one-tier-per-family route;
- the learned route's own choices, with the same family pinned, and its learning curve: the table cut
  to a share of its labelled questions at random, the split routed again;
- with `--programs`, the learned route answering a family with programs, as `program_families` does:
  the chosen tier's program (bench/word_problem_programs.py's kept replies), else its worked answer.

    .venv/bin/python -m bench.routing_bounds --export bench/runs/eval/development-tiers.jsonl \\
        --calibration bench/fleets/fleet-learned.toml --pin gsm8k=qwen-0.5b --pin gsm8k=qwen-1.5b \\
        --programs bench/runs/word-problem-programs/answers.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from appliance.evaluation import calibration_file, eval_file  # noqa: E402
from appliance.evaluation.runner import load_checker  # noqa: E402
from appliance.evaluation.offline_routing import Row, calibrated_choices, point  # noqa: E402
from policy.router_knn import Knn  # noqa: E402
from bench.family_threshold import SPLITS, items, routing_rows
from bench.kit.paths import CHECKER
from bench.word_problem_programs import judged, model_of


def oracle(row: Row) -> int:
    """The cheapest tier that answers right; the cheapest tier when none does (the answer is lost either way)."""
    return next((t for t, right in enumerate(row.correct) if right), 0)


def pinned(families: Sequence[str], choose: Callable[[int], int], pins: dict[str, int]) -> list[int]:
    """Question i's tier: its family's pinned tier, else `choose(i)`."""
    return [pins[family] if family in pins else choose(i) for i, family in enumerate(families)]


def per_family(rows: Sequence[Row], families: Sequence[str], slack: int) -> dict[str, int]:
    """The cheapest tier per family that loses at most `slack` of the frontier's right answers there."""
    top = len(rows[0].correct) - 1
    choice = {}
    for family in sorted(set(families)):
        mine = [r for r, f in zip(rows, families) if f == family]
        right = [sum(r.correct[t] for r in mine) for t in range(top + 1)]
        choice[family] = next(t for t in range(top + 1) if right[t] >= right[top] - slack)
    return choice


def with_programs(rows: Sequence[Row], chosen: Sequence[int], programs: Sequence[tuple[bool | str, int] | None]) -> tuple[float, float]:
    """Right answers and cost when question i, answered by tier chosen[i], was first asked for a program:
    programs[i] is that program's verdict (right or not, or why it did not evaluate) and its cost, or
    None where no program is asked. A program that does not evaluate pays for the worked answer too."""
    right = cost = 0.0
    for row, tier, program in zip(rows, chosen, programs):
        if program is None or isinstance(program[0], str):
            right, cost = right + row.correct[tier], cost + row.cost_nanos[tier]
        if program is not None:
            cost += program[1]
            right += program[0] is True
    return right, cost


def cut(knn: Knn, keep: np.ndarray) -> Knn:
    """The table with only the labelled rows `keep` (indices)."""
    return dataclasses.replace(knn, vectors=knn.vectors[keep], features=knn.features[keep], correct=knn.correct[keep],
                               cost_nanos=knn.cost_nanos[keep], texts=tuple(knn.texts[i] for i in keep))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True, help="an `appliance eval export` file that every tier answered")
    parser.add_argument("--calibration", type=Path, required=True, help="the learned route's calibration file (its tiers name the chain)")
    parser.add_argument("--pin", action="append", default=[], metavar="FAMILY=TIER", help="a family every route sends to one tier (repeat)")
    parser.add_argument("--programs", type=Path, help="bench/word_problem_programs.py's answers.jsonl: the learned route with program answers")
    parser.add_argument("--program-family", action="append", help="a family answered with programs (repeat; default gsm8k)")
    parser.add_argument("--program-tier", action="append", default=[], metavar="FAMILY=TIER",
                        help="the tier that writes a family's programs (its `family_tiers` tier), else the route's choice (repeat)")
    parser.add_argument("--keep", type=float, help="route at this threshold instead of the calibration's own")
    parser.add_argument("--repeats", type=int, default=10, help="random cuts of the table per share, for the learning curve")
    args = parser.parse_args()
    table = calibration_file.read(args.calibration)
    if args.keep is not None:  # the table's threshold alone: its buckets stay where they were chosen
        table = dataclasses.replace(table, keep=args.keep, bucket_keep=table.bucket_choice_keep)
    tiers = list(table.tiers)
    pins = []
    for pin in args.pin:
        family, _, tier = pin.partition("=")
        if tier not in tiers:
            parser.error(f"--pin {pin}: {tier!r} is not one of the calibration's tiers {tiers}")
        pins.append((family, tiers.index(tier)))
    questions = eval_file.read(args.export)[1]
    _, rows, vectors = routing_rows(questions, table)
    families = [q.family for q in questions]
    top = len(tiers) - 1
    right_top, cost_top = point(rows, [top] * len(rows))

    def show(name: str, chosen: Sequence[int]) -> None:
        right, cost = point(rows, chosen)
        print(f"{name}\t{right / right_top:.1%}\t{cost / cost_top:.1%}")

    print(f"{len(rows)} questions from {args.export.name}; tiers {', '.join(tiers)}")
    print("family\tquestions\t" + "\t".join(f"{t} right\t{t} share of always-{tiers[-1]}'s bill" for t in tiers))
    bill = sum(r.cost_nanos[top] for r in rows)
    for family in sorted(set(families)):
        mine = [r for r, f in zip(rows, families) if f == family]
        print(f"{family}\t{len(mine)}\t" + "\t".join(f"{sum(r.correct[t] for r in mine):.0f}\t{sum(r.cost_nanos[t] for r in mine) / bill:.1%}"
                                                       for t in range(len(tiers))))
    print(f"\nroute\tof always-{tiers[-1]}'s accuracy\tof its cost")
    best = [oracle(r) for r in rows]
    show("oracle", best)
    for family, tier in pins:
        show(f"oracle, {family} pinned to {tiers[tier]}", pinned(families, best.__getitem__, {family: tier}))
    for slack in (0, 1, 2):
        choice = per_family(rows, families, slack)
        show(f"one tier per family, at most {slack} answers lost in each", [choice[f] for f in families])
    learned = calibrated_choices(rows, table, vectors)
    show(f"learned route (keep {table.keep})", learned)
    for family, tier in pins:
        show(f"learned route, {family} pinned to {tiers[tier]}", pinned(families, learned.__getitem__, {family: tier}))
    if args.programs is not None:
        check = load_checker(CHECKER)
        kept = {(r["id"], r["tier"]): r for r in map(json.loads, args.programs.read_text().splitlines())}
        program_families = args.program_family or ["gsm8k"]
        records = {r["id"]: r for r in items(program_families, list(SPLITS))}

        # A writer ALIAS:ADAPTER stands at its model's place; where its program does not evaluate, the
        # worked answer is taken to be the model's own (the export has no other).
        writers = {family: tier for family, _, tier in (t.partition("=") for t in args.program_tier)}
        if unknown := [t for t in writers.values() if model_of(t) not in tiers]:
            raise SystemExit(f"error: --program-tier {unknown[0]}: not a tier of the route ({', '.join(tiers)})")

        def program(i: int, tier: int) -> tuple[bool | str, int] | None:
            name = writers.get(families[i], tiers[tier])
            found = kept.get((questions[i].ref, name)) if families[i] in program_families else None
            return None if found is None else (judged(records[questions[i].ref], found["reply"], check), found["cost"])

        writing = pinned(families, learned.__getitem__, {f: tiers.index(model_of(t)) for f, t in writers.items()})
        asked = [program(i, t) for i, t in enumerate(writing)]
        missing = sum(1 for i, f in enumerate(families) if f in program_families and asked[i] is None and writing[i] > 0)
        right, cost = with_programs(rows, writing, asked)
        on = "".join(f", {f} on {t}" for f, _, t in (w.partition("=") for w in args.program_tier))
        print(f"learned route, {' and '.join(program_families)} answered with programs{on}\t{right / (right_top * len(rows)):.1%}\t{cost / (cost_top * len(rows)):.1%}"
              + (f"\t({missing} chosen tiers' programs not kept: answered worked)" if missing else ""))
    if table.knn is not None:
        rng = np.random.default_rng(0)
        n = table.knn.samples
        print(f"\nlearning curve: the table cut at random ({args.repeats} cuts a share), the split routed again at keep {table.keep}")
        print("labelled questions\tof always-frontier's accuracy (mean, sd)\tof its cost (mean, sd)")
        for share in (0.25, 0.5, 0.75, 1.0):
            found = []
            for _ in range(args.repeats if share < 1 else 1):
                keep = np.sort(rng.choice(n, int(share * n), replace=False))
                right, cost = point(rows, calibrated_choices(rows, dataclasses.replace(table, knn=cut(table.knn, keep)), vectors))
                found.append((right / right_top, cost / cost_top))
            mean, sd = np.mean(found, axis=0), np.std(found, axis=0)
            print(f"{int(share * n)}\t{mean[0]:.1%} ({sd[0]:.1%})\t{mean[1]:.1%} ({sd[1]:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
