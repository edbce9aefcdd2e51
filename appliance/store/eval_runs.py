"""Stored eval runs (`appliance eval router`, `appliance eval import`): each run (eval_runs), the
questions it asked (eval_questions) and every target's answer to each (eval_answers), kept so a
calibration or a learned router can be derived from a run later. JSON columns are encoded and
decoded here; what a run measures and how is appliance/evaluation/runner.py's."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import apsw


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


def create_question_table(db: apsw.Connection) -> None:
    """What each question of a run asked, so a learned router can embed it later."""
    db.execute("""
        CREATE TABLE eval_questions (
            run_id INTEGER NOT NULL REFERENCES eval_runs(id) ON DELETE CASCADE,
            question INTEGER NOT NULL,
            ref TEXT NOT NULL,
            family TEXT NOT NULL,
            messages TEXT NOT NULL,
            response_format TEXT,
            adversarial_of TEXT,
            PRIMARY KEY (run_id, question)
        ) STRICT
    """)


@dataclass(frozen=True)
class Answer:
    question: int
    target: str
    tier: int | None  # the target's index among the route's tiers; None for the route itself
    bucket: str
    correct: bool
    cost_nanos: int
    latency_s: float
    answered_by: str | None  # None: the request failed


class Run(NamedTuple):
    at: float
    kind: str
    dataset: str
    questions: int
    summary: dict[str, Any]


class StoredQuestion(NamedTuple):
    question: int  # its place in the run
    ref: str
    family: str
    messages: list[dict[str, Any]]
    response_format: dict[str, Any] | None
    adversarial_of: str | None


def _insert_run(db: apsw.Connection, run: Run) -> int:
    db.execute("INSERT INTO eval_runs(at, kind, dataset, questions, summary) VALUES (?, ?, ?, ?, ?)",
               (run.at, run.kind, run.dataset, run.questions, json.dumps(run.summary)))
    return db.last_insert_rowid()


def _question_values(run_id: int, questions: Iterable[StoredQuestion]) -> list[tuple[Any, ...]]:
    return [(run_id, q.question, q.ref, q.family, json.dumps(q.messages), json.dumps(q.response_format) if q.response_format else None,
             q.adversarial_of) for q in questions]


def _answer_values(run_id: int, answers: Iterable[Answer]) -> list[tuple[Any, ...]]:
    return [(run_id, a.question, a.target, a.tier, a.bucket, int(a.correct), a.cost_nanos, a.latency_s, a.answered_by) for a in answers]


def add_run(db: apsw.Connection, run: Run) -> int:
    """A run's row, in its own transaction; its id."""
    with db:
        return _insert_run(db, run)


def extend(db: apsw.Connection, run_id: int, questions: Sequence[StoredQuestion]) -> None:
    """The questions past those the run already holds, and its count raised to match."""
    with db:
        held = db.execute("SELECT count(*) FROM eval_questions WHERE run_id = ?", (run_id,)).fetchone()[0]
        db.executemany("INSERT INTO eval_questions VALUES (?, ?, ?, ?, ?, ?, ?)",
                       _question_values(run_id, (q for q in questions if q.question >= held)))
        db.execute("UPDATE eval_runs SET questions = ? WHERE id = ?", (max(held, len(questions)), run_id))


def set_questions(db: apsw.Connection, run_id: int, questions: int) -> None:
    with db:
        db.execute("UPDATE eval_runs SET questions = ? WHERE id = ?", (questions, run_id))


def record(db: apsw.Connection, run_id: int, answers: Sequence[Answer]) -> None:
    """One question's answers, in one transaction: a question is stored whole or not at all."""
    with db:
        db.executemany("INSERT OR REPLACE INTO eval_answers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", _answer_values(run_id, answers))


def finish(db: apsw.Connection, run_id: int, summary: dict[str, Any]) -> None:
    with db:
        db.execute("UPDATE eval_runs SET summary = ? WHERE id = ?", (json.dumps(summary), run_id))


def import_run(db: apsw.Connection, run: Run, questions: Sequence[StoredQuestion], answers: Iterable[Answer]) -> int:
    """A whole run from elsewhere as a new run, in one transaction; its new id."""
    with db:
        run_id = _insert_run(db, run)
        db.executemany("INSERT INTO eval_questions VALUES (?, ?, ?, ?, ?, ?, ?)", _question_values(run_id, questions))
        db.executemany("INSERT INTO eval_answers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", _answer_values(run_id, answers))
    return run_id


def run(db: apsw.Connection, run_id: int) -> Run | None:
    row = db.execute("SELECT at, kind, dataset, questions, summary FROM eval_runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else Run(*row[:4], json.loads(row[4]))


def questions(db: apsw.Connection, run_id: int) -> list[StoredQuestion]:
    """A run's questions in order (none for runs from before questions were stored)."""
    return [StoredQuestion(question, ref, family, json.loads(messages), json.loads(response_format) if response_format else None, adversarial_of)
            for question, ref, family, messages, response_format, adversarial_of in db.execute(
                "SELECT question, ref, family, messages, response_format, adversarial_of FROM eval_questions WHERE run_id = ? ORDER BY question",
                (run_id,))]


def answers(db: apsw.Connection, run_id: int) -> list[Answer]:
    """Every answer of a run, by question, then target."""
    return [Answer(question, target, tier, bucket, bool(correct), cost, latency, by)
            for question, target, tier, bucket, correct, cost, latency, by in db.execute(
                "SELECT question, target, tier, bucket, correct, cost_nanos, latency_s, answered_by FROM eval_answers "
                "WHERE run_id = ? ORDER BY question, target", (run_id,))]


def tier_answers(db: apsw.Connection, run_id: int) -> list[Answer]:
    """The answers a run's tiers gave (not its route's), leaving out failed requests: they measured the server."""
    return [Answer(question, target, tier, bucket, bool(correct), cost, latency, by)
            for question, target, tier, bucket, correct, cost, latency, by in db.execute(
                "SELECT question, target, tier, bucket, correct, cost_nanos, latency_s, answered_by FROM eval_answers "
                "WHERE run_id = ? AND tier IS NOT NULL AND answered_by IS NOT NULL", (run_id,))]


def latest_run(db: apsw.Connection) -> int | None:
    row = db.execute("SELECT max(run_id) FROM eval_answers").fetchone()
    return row[0] if row else None


def history(db: apsw.Connection, limit: int = 20) -> list[dict[str, Any]]:
    rows = db.execute("SELECT id, at, dataset, questions, summary FROM eval_runs ORDER BY id DESC LIMIT ?", (limit,))
    return [{"id": i, "at": at, "dataset": d, "questions": q, "summary": json.loads(s)} for i, at, d, q, s in rows]
