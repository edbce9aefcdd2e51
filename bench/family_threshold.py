"""How sure a family tier must be before its answer stands: the distilled adapter that a route tries
first for a family (`[routes.family_tiers]`) asked the workload's calibration and development items
of that family (never the evaluation split), greedy, with log-probabilities; each answer's confidence
(the geometric-mean token probability, as the route's validator computes it) against whether the
workload's checker calls it right. Prints, per threshold, how many answers would stand and how many
of those are right, beside the teacher's accuracy on the same items, so that `family_min_confidence`
is chosen on data the evaluation never sees.

    .venv/bin/python bench/family_threshold.py --workdir ~/.cache/appliance/family-threshold
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from appliance_server import start, stop, write_config  # noqa: E402

from appliance.evaluate import load_checker  # noqa: E402
from policy.router import confidence_of  # noqa: E402

SPLITS = ("calibration", "development")
THRESHOLDS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


def items(families: list[str]) -> list[dict[str, Any]]:
    found = []
    for split in SPLITS:
        with open(ROOT / "bench" / "workload" / "splits" / f"{split}.jsonl") as handle:
            found += [r for r in map(json.loads, handle) if r["family"] in families]
    return found


def ask(client: httpx.Client, model: str, record: dict[str, Any]) -> tuple[str, float | None]:
    body = {"model": model, "messages": record["messages"], "max_tokens": record["max_tokens"], "temperature": 0, "logprobs": True}
    if record.get("response_format"):
        body["response_format"] = record["response_format"]
    reply = client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    logprobs = [t["logprob"] for t in ((choice.get("logprobs") or {}).get("content") or [])]
    return choice["message"]["content"] or "", confidence_of(logprobs)


def table(rows: list[dict[str, Any]], teacher: str) -> None:
    for family in sorted({r["family"] for r in rows}):
        mine = [r for r in rows if r["family"] == family]
        taught = sum(r["teacher"] for r in mine)
        print(f"\n{family}: {len(mine)} items; the teacher right on {taught} ({taught / len(mine):.1%}), {teacher}")
        print("threshold\tstand\tright of those\tescalated\tteacher right on the escalated")
        for t in THRESHOLDS:
            stand = [r for r in mine if (r["confidence"] or 0.0) >= t]
            up = [r for r in mine if (r["confidence"] or 0.0) < t]
            right = sum(r["correct"] for r in stand)
            print(f"{t:.2f}\t{len(stand)}\t{right} ({right / len(stand):.1%})\t{len(up)}\t{sum(r['teacher'] for r in up)}"
                  if stand else f"{t:.2f}\t0\t-\t{len(up)}\t{sum(r['teacher'] for r in up)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", type=Path, default=ROOT / "bench" / "fleet-family.toml")
    parser.add_argument("--tier", default="smollm2-135m:distilled")
    parser.add_argument("--teacher", default="qwen-1.5b")
    parser.add_argument("--family", action="append", help="default: classification and extraction")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    families = args.family or ["classification", "extraction"]
    check = load_checker(ROOT / "bench" / "workload" / "check.py")
    answers = args.workdir / "answers.jsonl"
    done = {r["id"]: r for r in map(json.loads, answers.read_text().splitlines())} if answers.exists() else {}
    todo = [r for r in items(families) if r["id"] not in done]
    if todo:
        # The fleet's relative paths are the bench folder's; the copy lives in the work folder.
        text = args.fleet.read_text().replace('path = "runs/', f'path = "{ROOT / "bench" / "runs"}/')
        write_config(args.workdir, text)
        proc, base = start(args.workdir)
        try:
            with httpx.Client(base_url=base, timeout=900, headers={"Cache-Control": "no-store"}) as client, answers.open("a") as out:
                for i, record in enumerate(todo):
                    text_tier, confidence = ask(client, args.tier, record)
                    text_teacher, _ = ask(client, args.teacher, record)
                    row = {"id": record["id"], "family": record["family"], "confidence": confidence,
                           "correct": bool(check(record, text_tier)), "teacher": bool(check(record, text_teacher)), "answer": text_tier}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    done[record["id"]] = row
                    print(f"{i + 1}/{len(todo)} {record['id']} {confidence and round(confidence, 3)} {row['correct']}", file=sys.stderr)
        finally:
            stop(proc)
    table(list(done.values()), args.teacher)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
