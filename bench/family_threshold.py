"""How sure a family tier must be before its answer stands: the distilled adapter that a route tries
first for a family (`[routes.family_tiers]`) asked the workload's calibration and development items
of that family (never the evaluation split), greedy, with log-probabilities; each answer's confidence
(the geometric-mean token probability, as the route's validator computes it) against whether the
workload's checker calls it right. Prints, per threshold, how many answers would stand and how many
of those are right, beside the teacher's accuracy on the same items, and what the cascade (the tier
first, the teacher when it is unsure) costs against the teacher alone, so that a family's threshold
is chosen on data the evaluation never sees.

    .venv/bin/python -m bench.family_threshold --workdir ~/.cache/appliance/family-threshold
    # the middle tier as a cascade's first step, the teacher's answers read from a stored run's export
    .venv/bin/python -m bench.family_threshold --tier qwen-0.5b --split development --family factual \
        --teacher-run bench/runs/eval/development-tiers.jsonl --workdir bench/runs/cascade-threshold
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tomlkit

from appliance.evaluation import calibration_file, eval_file  # noqa: E402
from appliance.evaluation.eval_file import QuestionLine  # noqa: E402
from appliance.evaluation.runner import Labelled, load_checker, routing_inputs  # noqa: E402
from appliance.evaluation.offline_routing import Row, calibrated_choices  # noqa: E402
from policy.budgets import Price  # noqa: E402
from policy.router import Calibration, confidence_of, split_tier  # noqa: E402
from bench.kit import paths
from bench.kit.fleet import fleet_document, fleet_prices
from bench.kit.server import start, write_config

SPLITS = ("calibration", "development")
THRESHOLDS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


def items(families: list[str], splits: list[str]) -> list[dict[str, Any]]:
    found = []
    for split in splits:
        with open(paths.SPLITS / f"{split}.jsonl") as handle:
            found += [r for r in map(json.loads, handle) if r["family"] in families]
    return found


def stored(questions: list[QuestionLine]) -> dict[str, dict[str, tuple[bool, int]]]:
    """Each target's verdict and charge per workload id, from `appliance eval export`'s file."""
    return {q.ref: {a.target: (a.correct, a.cost_nanos) for a in q.answers} for q in questions}


def routing_rows(questions: list[QuestionLine], table: Calibration) -> tuple[list[str], list[Row], np.ndarray]:
    """An export's questions as the route sees them, embedded once: their ids, their rows (each tier's
    stored verdict and charge, in the calibration's chain order) and their routing texts' vectors."""
    rows = [Labelled(0, q.ref, q.family, tuple(q.messages), q.response_format is not None,
                     tuple(next(a.correct for a in q.answers if a.target == t) for t in table.tiers),
                     tuple(next(a.cost_nanos for a in q.answers if a.target == t) for t in table.tiers))
            for q in questions]
    found, _, vectors, _ = routing_inputs(rows, table.knn.settings.task if table.knn else False)
    return [r.ref for r in rows], [Row(f, tuple(map(float, r.correct)), tuple(map(float, r.cost_nanos))) for f, r in zip(found, rows)], vectors


def route_choices(questions: list[QuestionLine], table: Calibration) -> dict[str, int]:
    """The learned route's first choice for each question of an export, offline (as `appliance eval
    simulate` decides it): the tier index in the calibration's chain."""
    refs, scored, vectors = routing_rows(questions, table)
    return dict(zip(refs, calibrated_choices(scored, table, vectors)))


def replay(rows: list[dict[str, Any]], taught: dict[str, dict[str, tuple[bool, int]]], chosen: dict[str, int],
           tiers: tuple[str, ...], step: int, thresholds: dict[str, float]) -> tuple[int, int]:
    """Right answers and cost when the items of a family in `thresholds`, where the route chose a tier
    above `step`, try that tier first and keep its answer when it is at least that sure."""
    right = cost = 0
    for r in rows:
        if r["family"] in thresholds and chosen[r["id"]] > step:
            cost += r["cost"]
            if (r["confidence"] or 0.0) >= thresholds[r["family"]]:
                right += r["correct"]
                continue
        ok, paid = taught[r["id"]][tiers[chosen[r["id"]]]]
        right, cost = right + ok, cost + paid
    return right, cost


def on_route(rows: list[dict[str, Any]], taught: dict[str, dict[str, tuple[bool, int]]], chosen: dict[str, int],
             tiers: tuple[str, ...], tier: str) -> None:
    """The cascade on top of the learned route: only where the route would have paid for a dearer
    tier does the cascade's tier answer first; everything else keeps the route's own answer."""
    step, top = tiers.index(tier), tiers[-1]
    dear = sum(taught[r["id"]][top][1] for r in rows)
    right, cost = replay(rows, taught, chosen, tiers, step, {})
    print(f"\nthe cascade on the learned route ({len(rows)} items): the route alone {right} right at {cost / dear:.1%} of always-{top}'s "
          f"cost; always-{top} {sum(taught[r['id']][top][0] for r in rows)} right")
    print("family\tthreshold\tright\tcost vs always-frontier\tchange in right answers\tchange in cost")
    for family in sorted({r["family"] for r in rows}):
        for t in THRESHOLDS[1:]:
            r2, c2 = replay(rows, taught, chosen, tiers, step, {family: t})
            print(f"{family}\t{t:.2f}\t{r2}\t{c2 / dear:.1%}\t{r2 - right:+d}\t{(c2 - cost) / dear:+.1%}")


def ask(client: httpx.Client, model: str, record: dict[str, Any], price: Price) -> tuple[str, float | None, int]:
    body = {"model": model, "messages": record["messages"], "max_tokens": record["max_tokens"], "temperature": 0, "logprobs": True}
    if record.get("response_format"):
        body["response_format"] = record["response_format"]
    reply = client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    logprobs = [t["logprob"] for t in ((choice.get("logprobs") or {}).get("content") or [])]
    return choice["message"]["content"] or "", confidence_of(logprobs), price.cost(usage["prompt_tokens"], usage["completion_tokens"])


def table(rows: list[dict[str, Any]], teacher: str) -> None:
    groups = {family: [r for r in rows if r["family"] == family] for family in sorted({r["family"] for r in rows})}
    if len(groups) > 1:
        groups["all of them"] = rows
    for family, mine in groups.items():
        taught = sum(r["teacher"] for r in mine)
        dear = sum(r.get("teacher_cost") or 0 for r in mine)
        print(f"\n{family}: {len(mine)} items; the teacher right on {taught} ({taught / len(mine):.1%}), {teacher}")
        print("threshold\tstand\tright of those\tescalated\tteacher right on the escalated\tcascade right\tcascade cost vs the teacher's")
        for t in THRESHOLDS:
            stand = [r for r in mine if (r["confidence"] or 0.0) >= t]
            up = [r for r in mine if (r["confidence"] or 0.0) < t]
            right = sum(r["correct"] for r in stand)
            rescued = sum(r["teacher"] for r in up)
            cost = sum(r.get("cost") or 0 for r in mine) + sum(r.get("teacher_cost") or 0 for r in up)
            share = f"{cost / dear:.1%}" if dear else "-"
            print(f"{t:.2f}\t{len(stand)}\t{right} ({right / len(stand):.1%})\t{len(up)}\t{rescued}\t{right + rescued}\t{share}"
                  if stand else f"{t:.2f}\t0\t-\t{len(up)}\t{rescued}\t{rescued}\t{share}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", type=Path, default=paths.FLEETS / "fleet-family.toml")
    parser.add_argument("--tier", default="smollm2-135m:distilled")
    parser.add_argument("--teacher", default="qwen-1.5b")
    parser.add_argument("--family", action="append", help="default: classification and extraction")
    parser.add_argument("--split", action="append", choices=SPLITS, help="default: both")
    parser.add_argument("--teacher-run", type=Path, help="an `appliance eval export` file with the teacher's answers to these items: it is not asked again")
    parser.add_argument("--calibration", type=Path, help="with --teacher-run (every tier's answers): the cascade on top of this learned route's choices")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    families = args.family or ["classification", "extraction"]
    check = load_checker(paths.CHECKER)
    answers = args.workdir / "answers.jsonl"
    done = {r["id"]: r for r in map(json.loads, answers.read_text().splitlines())} if answers.exists() else {}
    questions = eval_file.read(args.teacher_run)[1] if args.teacher_run else None
    runs = stored(questions) if questions is not None else None
    taught = {ref: answers[args.teacher] for ref, answers in runs.items() if args.teacher in answers} if runs is not None else None
    fleet = fleet_document(args.fleet)
    price = fleet_prices(fleet)
    todo = [r for r in items(families, args.split or list(SPLITS)) if r["id"] not in done and (taught is None or r["id"] in taught)]
    if todo:
        write_config(args.workdir, tomlkit.dumps(fleet))
        server = start(args.workdir)
        try:
            with httpx.Client(base_url=server.base, timeout=900, headers={"Cache-Control": "no-store"}) as client, answers.open("a") as out:
                for i, record in enumerate(todo):
                    text_tier, confidence, cost = ask(client, args.tier, record, price[split_tier(args.tier)[0]])
                    if taught is None:
                        text_teacher, _, teacher_cost = ask(client, args.teacher, record, price[args.teacher])
                        teacher_right = bool(check(record, text_teacher))
                    else:
                        teacher_right, teacher_cost = taught[record["id"]]
                    row = {"id": record["id"], "family": record["family"], "confidence": confidence, "correct": bool(check(record, text_tier)),
                           "teacher": teacher_right, "answer": text_tier, "cost": cost, "teacher_cost": teacher_cost}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    done[record["id"]] = row
                    print(f"{i + 1}/{len(todo)} {record['id']} {confidence and round(confidence, 3)} {row['correct']}", file=sys.stderr)
        finally:
            server.stop()
    table(list(done.values()), args.teacher)
    if args.calibration is not None and questions is not None and runs is not None:
        table_read = calibration_file.read(args.calibration)
        chosen = route_choices(questions, table_read)
        on_route([r for r in done.values() if r["id"] in chosen], runs, chosen, table_read.tiers, args.tier)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
