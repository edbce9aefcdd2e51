"""An eval run as a JSON Lines file: `appliance eval export` writes one, `appliance eval import` reads
it into another data directory.

Stored runs are what a learned router is calibrated and chosen from (`eval calibrate`, `eval
simulate`); measuring one takes hours on a small machine, and a data directory does not outlive the
machine it is on. A file under `bench/runs/` does. The first line is the run, each further line one
question with every target's answer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from appliance.store import eval_runs
from appliance.store.connection import Connection

VERSION = 1


class EvalFileError(Exception):
    """One line: the file, where, and what is wrong."""


class RunLine(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["eval-run"]
    version: int
    at: float
    run_kind: str
    dataset: str
    questions: int
    summary: dict[str, Any]


class AnswerLine(msgspec.Struct, forbid_unknown_fields=True):
    target: str
    tier: int | None
    bucket: str
    correct: bool
    cost_nanos: int
    latency_s: float
    answered_by: str | None


class QuestionLine(msgspec.Struct, forbid_unknown_fields=True):
    question: int
    ref: str
    family: str
    messages: list[dict[str, Any]]
    response_format: dict[str, Any] | None
    adversarial_of: str | None
    answers: list[AnswerLine]


def export(db: Connection, run_id: int, out: Path) -> int:
    """The run's lines to `out`, written whole or not at all; how many questions it holds."""
    run = eval_runs.run(db, run_id)
    if run is None:
        raise EvalFileError(f"eval run {run_id} does not exist (`appliance eval router --history` lists them)")
    answers: dict[int, list[AnswerLine]] = {}
    for a in eval_runs.answers(db, run_id):
        answers.setdefault(a.question, []).append(AnswerLine(a.target, a.tier, a.bucket, a.correct, a.cost_nanos, a.latency_s, a.answered_by))
    lines = [RunLine("eval-run", VERSION, run.at, run.kind, run.dataset, run.questions, run.summary)]
    for q in eval_runs.questions(db, run_id):
        lines.append(QuestionLine(q.question, q.ref, q.family, q.messages, q.response_format, q.adversarial_of, answers.get(q.question, [])))
    encoder = msgspec.json.Encoder()
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as handle:
        for line in lines:
            handle.write(encoder.encode(line) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(out)
    return len(lines) - 1


def read(path: Path) -> tuple[RunLine, list[QuestionLine]]:
    try:
        raw = path.read_bytes().splitlines()
    except OSError as exc:
        raise EvalFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not raw:
        raise EvalFileError(f"{path}: empty (expected an `appliance eval export` file)")
    try:
        head = msgspec.json.decode(raw[0], type=RunLine)
    except msgspec.DecodeError as exc:
        raise EvalFileError(f"{path}: line 1: not an eval run ({exc})") from None
    if head.version != VERSION:
        raise EvalFileError(f"{path}: line 1: version {head.version}, this appliance reads version {VERSION}")
    questions, seen = [], set()
    for number, line in enumerate(raw[1:], 2):
        if not line.strip():
            continue
        try:
            question = msgspec.json.decode(line, type=QuestionLine)
        except msgspec.DecodeError as exc:
            raise EvalFileError(f"{path}: line {number}: {exc}") from None
        if question.question in seen:
            raise EvalFileError(f"{path}: line {number}: question {question.question} appears twice")
        seen.add(question.question)
        questions.append(question)
    return head, questions


def load(db: Connection, path: Path) -> int:
    """A file's run as a new run of this data directory, in one transaction; its new id."""
    head, questions = read(path)
    return eval_runs.import_run(
        db, eval_runs.Run(head.at, head.run_kind, head.dataset, head.questions, head.summary),
        [eval_runs.StoredQuestion(q.question, q.ref, q.family, q.messages, q.response_format, q.adversarial_of) for q in questions],
        [eval_runs.Answer(q.question, a.target, a.tier, a.bucket, a.correct, a.cost_nanos, a.latency_s, a.answered_by)
         for q in questions for a in q.answers])
