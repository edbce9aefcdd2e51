"""Program of thought on the workload's word problems (GSM8K), against the tiers' own worked answers:
each tier asked to write the computation as a short straight-line Python program, which is then run
by the route's own evaluator (policy/programs.py: numbers, variables, arithmetic and a few pure
functions; never `exec`). Each reply is kept and judged again at every report, so the table is the
evaluator's as it is now. A cheaper way to a right number, if a tier's programs are right as
often as its worked answers: fewer tokens, and arithmetic that cannot slip. Calibration and
development items only; the tiers' worked answers come from an `appliance eval export` of the same
split, or from a learned route's table (`--table`: the calibration split's labelled rows, by text).

    .venv/bin/python -m bench.word_problem_programs --split development \\
        --run bench/runs/eval/development-tiers.jsonl --workdir bench/runs/word-problem-programs
    .venv/bin/python -m bench.word_problem_programs --split calibration \\
        --table bench/fleets/fleet-learned.toml --workdir bench/runs/word-problem-programs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import tomlkit

from appliance.evaluation import calibration_file, eval_file  # noqa: E402
from appliance.evaluation.runner import load_checker  # noqa: E402
from policy.programs import FORM_ROLES, PROMPT, NotStraightLine, number_text, program_of, straight_line  # noqa: E402
from policy.router_text import embedded_text  # noqa: E402
from bench.family_threshold import items as workload_items, stored
from bench.kit.fleet import fleet_document, fleet_prices
from bench.kit.paths import CHECKER, FLEETS
from bench.kit.server import start, write_config

def model_of(tier: str) -> str:
    """A tier's fleet model: `qwen-0.5b:programs` is qwen-0.5b with its adapter."""
    return tier.partition(":")[0]


def stated_number(reply: str) -> str:
    """The number the route states for a reply's program; NotStraightLine where it does not evaluate."""
    return number_text(straight_line(program_of(reply)))


def judged(record: dict[str, Any], reply: str, check: Any) -> bool | str:
    """Whether the reply's program gives the item's number, or why it was not evaluated."""
    try:
        return bool(check(record, f"Answer: {stated_number(reply)}"))
    except NotStraightLine as exc:
        return str(exc)


def worked_answers(run: Path | None, table: Path | None, items: list[dict[str, Any]]) -> dict[str, dict[str, tuple[bool, int]]]:
    """Each item's worked answer per tier, (right, nano-dollars): from an export by id, or from a
    learned table by the text it embedded (the caller's turn; copies with other words are not there)."""
    if run is not None:
        return stored(eval_file.read(run)[1])
    assert table is not None
    calibration = calibration_file.read(table)
    knn = calibration.knn
    if knn is None or knn.settings.task:
        raise SystemExit(f"{table}: no learned table of callers' turns")
    row_of = {text: i for i, text in enumerate(knn.texts)}
    return {r["id"]: {tier: (bool(knn.correct[row_of[text], t]), int(knn.cost_nanos[row_of[text], t])) for t, tier in enumerate(calibration.tiers)}
            for r in items if (text := embedded_text(r["messages"], False)) in row_of}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", type=Path, default=FLEETS / "fleet.toml")
    parser.add_argument("--tier", action="append",
                        help="default: qwen-0.5b and qwen-1.5b; ALIAS:ADAPTER for a fleet model's adapter (its worked answers "
                             "are taken to be the model's own, as the export has no others)")
    parser.add_argument("--split", choices=("calibration", "development"), default="development")
    parser.add_argument("--family", default="gsm8k", help="a workload family checked by number (gsm8k, arithmetic)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="an `appliance eval export` of the same split, with each tier's worked answers")
    source.add_argument("--table", type=Path, help="a calibration file whose learned table labelled this split")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    tiers = args.tier or ["qwen-0.5b", "qwen-1.5b"]
    check = load_checker(CHECKER)
    items = workload_items([args.family], [args.split])
    worked = worked_answers(args.run, args.table, items)
    items = [r for r in items if r["id"] in worked]
    answers = args.workdir / "answers.jsonl"
    done = {(r["id"], r["tier"]): r for r in map(json.loads, answers.read_text().splitlines())} if answers.exists() else {}
    fleet = fleet_document(args.fleet)
    prices = fleet_prices(fleet)
    todo = [(r, t) for t in tiers for r in items if (r["id"], t) not in done]
    if todo:
        write_config(args.workdir, tomlkit.dumps(fleet))
        server = start(args.workdir)
        try:
            with httpx.Client(base_url=server.base, timeout=900, headers={"Cache-Control": "no-store"}) as client, answers.open("a") as out:
                for n, (record, tier) in enumerate(todo):
                    messages = [{"role": "system", "content": PROMPT}, *(m for m in record["messages"] if m["role"] not in FORM_ROLES)]
                    reply = client.post("/v1/chat/completions", json={"model": tier, "messages": messages, "max_tokens": record["max_tokens"],
                                                                       "temperature": 0})
                    reply.raise_for_status()
                    body = reply.json()
                    usage = body["usage"]
                    row = {"id": record["id"], "tier": tier, "reply": body["choices"][0]["message"]["content"] or "",
                           "completion_tokens": usage["completion_tokens"],
                           "cost": prices[model_of(tier)].cost(usage["prompt_tokens"], usage["completion_tokens"])}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    done[(record["id"], tier)] = row
                    print(f"{n + 1}/{len(todo)} {tier} {record['id']} {judged(record, row['reply'], check)}", file=sys.stderr)
        finally:
            server.stop()
    frontier = list(prices)[-1]  # the fleet's dearest model comes last
    bill = sum(worked[r["id"]][frontier][1] for r in items)
    print(f"{len(items)} {args.family} items of the {args.split} split; costs as shares of {frontier}'s worked answers' bill")
    print("tier\tworked answers right\tworked cost\tprograms right\tprograms that did not run\tprograms' cost\tmean completion tokens"
          "\tthe route's way (the program, else the worked answer): right\tcost")
    for tier in tiers:
        mine = [(r, done[(r["id"], tier)]) for r in items]
        verdicts = [judged(r, m["reply"], check) for r, m in mine]
        unrun = [r for r, v in zip(items, verdicts) if isinstance(v, str)]
        model = model_of(tier)
        either = sum(v is True for v in verdicts) + sum(worked[r["id"]][model][0] for r in unrun)
        either_cost = sum(m["cost"] for _, m in mine) + sum(worked[r["id"]][model][1] for r in unrun)
        print(f"{tier}\t{sum(worked[r['id']][model][0] for r in items)}\t{sum(worked[r['id']][model][1] for r in items) / bill:.1%}\t"
              f"{sum(v is True for v in verdicts)}\t{len(unrun)}\t{sum(m['cost'] for _, m in mine) / bill:.1%}\t"
              f"{sum(m['completion_tokens'] for _, m in mine) / len(mine):.0f}\t{either}\t{either_cost / bill:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
