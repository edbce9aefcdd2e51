"""Which manipulations buy a dearer tier: every attack template wrapped around every cheap question
of the workload's calibration and development splits, decided as the server decides (the text the
router reads, its features, the learned calibration's table and buckets, else the heuristics), against
the plain question's decision. No model is called.

    .venv/bin/python -m bench.router_manipulation                       # the workload's templates (tune on these)
    .venv/bin/python -m bench.router_manipulation --templates heldout   # phrasings never tuned on (report)
    .venv/bin/python -m bench.router_manipulation --templates blind_tune     # written by an outsider who never saw the defences
    .venv/bin/python -m bench.router_manipulation --templates blind_eval     # the outsider's second set: measured once, then tuned on
    .venv/bin/python -m bench.router_manipulation --templates blind_eval3    # a second outsider's set: measured once, then tuned on
    .venv/bin/python -m bench.router_manipulation --templates blind_eval4    # a third outsider's set: measured once, then tuned on

The evaluation split's questions are not read: it is kept for bench/economics.py. Prints, per
template, how many copies read differently from their question (another routing text or bucket) and
how many were sent to a dearer tier, by the learned router and by the heuristics alone.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from appliance.evaluation import calibration_file  # noqa: E402
from appliance.fleet.embedders import bundled_minilm  # noqa: E402
from policy.router import buckets, decide_calibrated, features  # noqa: E402
from policy.router_text import embedded_text  # noqa: E402
from bench.kit.paths import FLEETS, ROOT, WORKLOAD

HANDWRITTEN = WORKLOAD / "handwritten"
TEMPLATES = {"workload": HANDWRITTEN / "adversarial.jsonl", "heldout": HANDWRITTEN / "adversarial_heldout.jsonl",
             "blind_tune": HANDWRITTEN / "adversarial_blind_tune.jsonl", "blind_eval": HANDWRITTEN / "adversarial_blind_eval.jsonl",
             "blind_eval3": HANDWRITTEN / "adversarial_blind_eval3.jsonl", "blind_eval4": HANDWRITTEN / "adversarial_blind_eval4.jsonl"}
CHEAP = ("factual", "arithmetic", "classification")  # the families build.py wraps (ADVERSARIAL_FAMILIES)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wrapped(record: dict[str, Any], template: str) -> list[dict[str, str]]:
    messages = record["messages"]
    return [*messages[:-1], {"role": "user", "content": template.replace("{question}", messages[-1]["content"])}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--templates", choices=sorted(TEMPLATES), default="workload")
    parser.add_argument("--splits", default="calibration,development", help="whose plain questions are wrapped (never evaluation)")
    parser.add_argument("--calibration", type=Path, default=FLEETS / "fleet-learned.toml")
    parser.add_argument("--show", type=int, default=0, help="print this many copies that bought a dearer tier, per template")
    args = parser.parse_args(argv)
    splits = args.splits.split(",")
    if "evaluation" in splits:
        raise SystemExit("error: --splits: the evaluation split is kept for bench/economics.py")
    calibration = calibration_file.read(args.calibration)
    tiers = len(calibration.tiers)
    plain = [r for s in splits for r in read_jsonl(WORKLOAD / "splits" / f"{s}.jsonl")
             if r["family"] in CHEAP and not r.get("adversarial") and r["messages"][-1]["role"] == "user"]
    if not TEMPLATES[args.templates].exists():
        raise SystemExit(f"error: --templates: {TEMPLATES[args.templates].relative_to(ROOT)} is not in this checkout")
    templates = read_jsonl(TEMPLATES[args.templates])
    cases = [(None, r, r["messages"]) for r in plain] + [(t, r, wrapped(r, t["template"])) for t in templates for r in plain]
    task = calibration.knn.settings.task if calibration.knn is not None else False
    texts = [embedded_text(m, task) for _, _, m in cases]
    distinct = list(dict.fromkeys(texts))  # most copies read as their question: each text is embedded once
    embedder = bundled_minilm()
    try:
        embedded = {t: v for i in range(0, len(distinct), 64) for t, v in zip(distinct[i:i + 64], embedder.embed_now(distinct[i:i + 64]))}
    finally:
        embedder.close()
    vectors = [embedded[t] for t in texts]
    decided: dict[tuple[str | None, str], tuple[str, tuple[str, str], int, int]] = {}
    for (template, record, messages), text, vector in zip(cases, texts, vectors):
        found = features(messages, bool(record.get("response_format")))
        decided[(template["id"] if template else None, record["id"])] = (
            text, buckets(found), decide_calibrated(found, tiers, calibration, vector).tier, decide_calibrated(found, tiers, None).tier)
    print(f"{len(plain)} cheap questions of {'+'.join(splits)} x {len(templates)} templates ({args.templates}); "
          f"calibration {args.calibration.name}")
    print(f"{'template':10} {'kind':14} {'lang':5} {'reads differently':>18} {'dearer (learned)':>17} {'dearer (heuristics)':>20}")
    totals: Counter[str] = Counter()
    for t in templates:
        counts: Counter[str] = Counter()
        shown = 0
        for r in plain:
            base, copy = decided[(None, r["id"])], decided[(t["id"], r["id"])]
            counts["differs"] += copy[:2] != base[:2]
            counts["learned"] += copy[2] > base[2]
            counts["heuristics"] += copy[3] > base[3]
            if copy[2] > base[2] and shown < args.show:
                shown += 1
                print(f"    {r['id']}: tier {base[2]} -> {copy[2]}; reads {copy[0][:160]!r}")
        totals.update(counts)
        print(f"{t['id']:10} {t['kind'][:14]:14} {t.get('lang', 'en'):5} {counts['differs']:>18} {counts['learned']:>17} {counts['heuristics']:>20}")
    n = len(plain) * len(templates)
    print(f"manipulation ({args.templates}): {totals['differs']}/{n} copies read differently, {totals['learned']}/{n} "
          f"({totals['learned'] / n:.1%}) bought a dearer tier from the learned router, {totals['heuristics']}/{n} from the heuristics")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
