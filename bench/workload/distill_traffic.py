"""Training traffic for distillation: classification and extraction requests of the same kind as
the economics workload's (same tenants, system prompts, label sets, JSON Schemas, user-message
format and checks), but none of its items; and word problems, GSM8K's problems that the workload
did not draw (the same tenant, prompt and check):

    .venv/bin/python -m bench.workload.distill_traffic --family classification --n 600 --seed 0 --out FILE.jsonl

The cheap tier is trained on the frontier tier's verified answers to these, then scored on the
workload's evaluation split, so the split must stay held out. Every text here comes from the
phrase banks in distill_classification.py and distill_extraction.py, written by hand for this
project independently of handwritten/*.jsonl (tests/test_distill_traffic.py checks that no
sentence is shared). The records have build.py's format (bench/workload/README.md), with
split "distill", one group per record and cache "oneoff".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from bench.workload import build, distill_classification, distill_extraction, sources

FAMILIES = ("classification", "extraction", "gsm8k")
SPLIT = "distill"
CLASSIFICATION_PROMPTS = (("acme", "triage"), ("inkwell", "sentiment"), ("inkwell", "topic"))
ATTEMPTS = 200  # draws per record before a bank counts as too small for n distinct messages


def _plan(family: str, n: int, rng: random.Random) -> list[Any]:
    """What each record is about, spread evenly: prompts in turn and each prompt's labels in turn
    (classification), or the schemas in turn (extraction); shuffled so the file has no period."""
    if family == "classification":
        prompts = sources.tenants()
        plan: list[Any] = []
        for i in range(n):
            tenant, prompt = CLASSIFICATION_PROMPTS[i % len(CLASSIFICATION_PROMPTS)]
            labels = prompts[tenant][prompt]["labels"]
            plan.append((tenant, prompt, labels[(i // len(CLASSIFICATION_PROMPTS)) % len(labels)]))
    elif family == "extraction":
        plan = [distill_extraction.SCHEMAS[i % len(distill_extraction.SCHEMAS)] for i in range(n)]
    else:
        drawn = {item.key for item in build.gsm8k()}
        unused = sources.gsm8k_unused(drawn)
        if n > len(unused):
            raise ValueError(f"GSM8K has {len(unused)} problems the workload did not draw, fewer than {n}")
        rng.shuffle(unused)
        return unused[:n]  # fewer records are the first of more: a smaller run's teach log is a larger one's start
    rng.shuffle(plan)
    return plan


def _item(family: str, key: str, about: Any, rng: random.Random, prompts: dict[str, Any]) -> sources.Item:
    if family == "classification":
        tenant, prompt, label = about
        return sources.classification_item(key, tenant, prompt, distill_classification.text(rng, tenant, prompt, label),
                                           label, prompts)
    if family == "gsm8k":
        return sources.gsm8k_item(key, about)
    text, gold = distill_extraction.text(rng, about)
    return sources.extraction_item(key, about.tenant, about.prompt, text, about.schema, gold)


def records(family: str, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` records of `family`, the same for the same seed, no two with the same user message."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    rng, prompts = random.Random(f"{SPLIT}:{family}:{seed}"), sources.tenants()
    items: list[sources.Item] = []
    seen: set[str] = set()
    for i, about in enumerate(_plan(family, n, rng), 1):
        for _ in range(ATTEMPTS):
            item = _item(family, f"{SPLIT}-{family}-{i:04d}", about, rng, prompts)
            if item.user not in seen:
                break
        else:
            raise ValueError(f"the phrase banks ran out of distinct {family} messages before {n}")
        seen.add(item.user)
        items.append(item)
    # build.records writes the workload's format; a lone base request is a one-off in its own group
    requests = [build.Request(item, i / n, item.user, item.check, f"g-{item.key}", "base") for i, item in enumerate(items)]
    rows = build.records(f"{SPLIT}-{family}", requests, prompts)
    for row in rows:
        row["split"] = SPLIT
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--n", type=int, default=600, help="how many records (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    rows = records(args.family, args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{args.out}: {len(rows)} {args.family} records (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
