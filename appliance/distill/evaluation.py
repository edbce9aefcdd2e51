"""`appliance distill evaluate`: a distilled adapter checked before it serves anyone.

The held-out part of an export (never trained on) and, when given, the economics workload's
questions of the same family are asked of the student alone, the student with the adapter and the
teacher, over HTTP through a running server, greedy. A held-out answer is right when it says what
the verified answer said (policy/distill.py: `agrees`); a workload answer is judged by the
workload's checker. The decision (policy/distill.py: `promotion`) and the scores are written beside
the adapter file (`<adapter>.evaluation.json`); promotion puts the adapter into a route as a tier
of its own.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance.evaluation import runner as evaluate
from appliance.distill.export import HELD_OUT, MANIFEST
from appliance.config.settings import Settings
from appliance.train.data import DataError, parse_examples
from policy.budgets import Price
from policy.distill import Promotion, Score, agrees, promotion

PARTS = ("held_out", "workload")


class EvaluateError(Exception):
    """One line: what is wrong and what to do."""


@dataclass(frozen=True)
class Asked:
    student: str
    adapter: str
    teacher: str
    data: Path  # the export folder, or its held-out file
    workload: Path | None = None
    family: str | None = None  # the workload's family to ask (default: the export's)
    max_tokens: int = 512


@dataclass(frozen=True)
class Result:
    targets: dict[str, str]  # student, adapter, teacher -> the model name asked
    scores: dict[str, dict[str, Score]]  # target role -> part -> score
    verdict: Promotion

    def total(self, role: str) -> Score:
        return sum(self.scores[role].values(), Score())

    def record(self, asked: Asked, margin: float, at: float) -> dict[str, Any]:
        return {"evaluated_at": at, "margin": margin, "data": str(asked.data), "workload": str(asked.workload) if asked.workload else None,
                "family": asked.family, "targets": self.targets, "promote": self.verdict.promote, "reason": self.verdict.reason,
                "scores": {role: {part: asdict(s) | {"accuracy": s.accuracy} for part, s in parts.items()} | {"total": asdict(self.total(role))}
                           for role, parts in self.scores.items()}}


def held_out_file(data: Path) -> Path:
    return data / HELD_OUT if data.is_dir() else data


def export_family(data: Path) -> str | None:
    """The family the export asked for (its export.json), if any."""
    manifest = data / MANIFEST
    try:
        return json.loads(manifest.read_text()).get("family") if data.is_dir() else None
    except (OSError, ValueError):
        return None


def held_out_questions(data: Path) -> list[evaluate.Question]:
    """The held-out examples as questions whose reference is the verified answer."""
    path = held_out_file(data)
    try:
        with path.open(encoding="utf-8") as handle:
            examples = parse_examples(handle, str(path))
    except FileNotFoundError:
        raise EvaluateError(f"{path}: no such file (give the folder `appliance distill export` wrote, or its {HELD_OUT})") from None
    except (DataError, UnicodeDecodeError) as exc:
        raise EvaluateError(str(exc)) from None
    return [evaluate.Question(f"held-out:{e.line}", "held_out", tuple({"role": m.role, "content": m.content} for m in e.messages[:-1]),
                              record={"reference": e.messages[-1].content}) for e in examples]


def workload_questions(path: Path, family: str | None) -> tuple[list[evaluate.Question], evaluate.Checker]:
    checker = evaluate.find_checker(path)
    if checker is None:
        raise EvaluateError(f"{path}: no check.py beside it or one folder up, to judge its answers")
    try:
        questions = evaluate.load_questions(path, sys.maxsize)
    except SystemExit as exc:
        raise EvaluateError(str(exc).removeprefix("error: ")) from None
    chosen = [q for q in questions if q.record is not None and (family is None or q.family == family)]
    if not chosen:
        raise EvaluateError(f"{path}: no workload record of family {family!r}")
    return chosen, evaluate.load_checker(checker)


def judge(check: evaluate.Checker | None) -> evaluate.Checker:
    """One checker for both parts: a held-out question against its verified answer, a workload record by its own checker."""
    def both(record: dict[str, Any], text: str) -> bool:
        if "reference" in record:
            return agrees(record["reference"], text)
        assert check is not None
        return bool(check(record, text))
    return both


def run(url: str, key: str, asked: Asked, prices: dict[str, Price], margin: float,
        progress: Callable[[int, int], None] | None = None) -> Result:
    """Every question to the student, the student with the adapter and the teacher; the scores and the decision."""
    parts: dict[str, list[evaluate.Question]] = {"held_out": held_out_questions(asked.data)}
    check = None
    if asked.workload is not None:
        parts["workload"], check = workload_questions(asked.workload, asked.family or export_family(asked.data))
    targets = {"student": asked.student, "adapter": f"{asked.student}:{asked.adapter}", "teacher": asked.teacher}
    scores = {role: {part: Score() for part in parts} for role in targets}
    checker = judge(check)
    total, done = sum(len(q) for q in parts.values()), 0
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}  # the models, not the cache
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        for part, questions in parts.items():
            for i, q in enumerate(questions):
                for role, name in targets.items():
                    answer = evaluate.ask(client, q, name, None, "distill", i, q.max_tokens or asked.max_tokens, prices, checker)
                    scores[role][part] += Score(1, int(answer.correct))
                done += 1
                if progress is not None:
                    progress(done, total)
    result = Result(targets, scores, Promotion(False, ""))
    verdict = promotion(result.total("student"), result.total("adapter"), result.total("teacher"), margin)
    return Result(targets, scores, verdict)


def adapter_path(settings: Settings, student: str, adapter: str) -> Path:
    model = settings.model(student)
    if model is None:
        raise EvaluateError(f"{settings.file}: no model {student!r} (the student to evaluate)")
    found = next((a for a in getattr(model, "adapters", ()) if a.name == adapter), None)
    if found is None:
        raise EvaluateError(f"{settings.file}: the model {student!r} has no adapter {adapter!r} (train one with `appliance distill train`)")
    return Path(found.path)


def store(path: Path, record: dict[str, Any]) -> Path:
    """The result beside the adapter (`<adapter>.evaluation.json`), replaced whole."""
    target = path.with_name(path.name + ".evaluation.json")
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".evaluation-")
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    os.replace(temporary, target)
    return target


def summary_rows(result: Result) -> list[tuple[str, ...]]:
    parts = [p for p in PARTS if p in next(iter(result.scores.values()))]
    return [(role, result.targets[role], *(f"{result.scores[role][p].right}/{result.scores[role][p].asked} "
                                             f"({result.scores[role][p].accuracy:.1%})" for p in parts), f"{result.total(role).accuracy:.1%}")
            for role in result.targets]


def headers_of(result: Result) -> Sequence[str]:
    return ("role", "model", *[p for p in PARTS if p in next(iter(result.scores.values()))], "total")
