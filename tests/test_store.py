"""Named migrations on SQLite, and the request log."""

from __future__ import annotations

import time
from pathlib import Path

from appliance.store.db import MIGRATIONS, connect, migrate
from appliance.store.request_log import RequestLogWriter, RequestRecord, recent


def test_migrations_apply_once_and_give_the_exact_schema():
    db = connect(":memory:")
    assert migrate(db) == [name for name, _ in MIGRATIONS]
    assert migrate(db) == []
    tables = {row[0]: row[1] for row in db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
    assert set(tables) == {"migrations", "request_log", "api_keys", "auth_failures", "budget_limits", "budget_usage",
                           "reservations", "settlements", "budget_adjustments", "cache_entries", "cache_hits",
                           "cache_feedback", "cache_sweeps", "spans", "eval_runs", "eval_answers"}
    columns = [row[1] for row in db.execute("PRAGMA table_info(request_log)")]
    assert columns == ["id", "created_at", "endpoint", "model", "status", "finish_reason", "prompt_tokens",
                       "completion_tokens", "ttft_ms", "total_ms", "error", "tenant", "app", "user", "key_id", "cost_nanos"]
    assert [row[0] for row in db.execute("SELECT name FROM migrations")] == [
        "0001_request_log", "0002_api_keys", "0003_budget_ledger", "0004_request_log_principal", "0005_semantic_cache", "0006_spans", "0007_eval_runs", "0008_eval_answers"]


def test_a_database_from_before_the_ledger_migrates_forward(tmp_path: Path):
    db = connect(tmp_path / "old.db")
    assert migrate(db, MIGRATIONS[:1]) == ["0001_request_log"]
    db.execute("INSERT INTO request_log(id, created_at, endpoint, model, status, total_ms) VALUES ('r1', 1, 'chat', 'm', 'ok', 5)")
    assert migrate(db) == ["0002_api_keys", "0003_budget_ledger", "0004_request_log_principal", "0005_semantic_cache", "0006_spans", "0007_eval_runs", "0008_eval_answers"]
    assert db.execute("SELECT id, tenant, cost_nanos FROM request_log").fetchall() == [("r1", None, None)]


def test_connection_uses_wal_and_foreign_keys(tmp_path: Path):
    db = connect(tmp_path / "a.db")
    assert db.execute("PRAGMA journal_mode").fetchall()[0][0] == "wal"
    assert db.execute("PRAGMA foreign_keys").fetchall()[0][0] == 1


def test_request_log_writer_persists_everything_on_close(tmp_path: Path):
    path = tmp_path / "appliance.db"
    db = connect(path)
    migrate(db)
    db.close()
    writer = RequestLogWriter(path)
    for i in range(50):
        writer.record(RequestRecord(f"r{i}", time.time() + i, "chat", "m", "ok", "stop", 10, i, 5.0, 20.0))
    writer.close()
    rows = recent(path, limit=100)
    assert len(rows) == 50
    assert rows[0].id == "r49" and rows[0].completion_tokens == 49


def test_a_failed_eval_request_is_not_a_wrong_answer():
    from appliance.evaluate import Answer, observations, store

    db = connect(":memory:")
    migrate(db)
    answers = [Answer(0, "small", 0, "math+short", True, 10, 0.1, "small"),
               Answer(0, "big", 1, "math+short", False, 0, 0.1, None),  # the request failed: no answer
               Answer(1, "big", 1, "math+short", False, 30, 0.2, "big"),
               Answer(1, "auto", None, "math+short", True, 30, 0.2, "big")]  # the route is not a tier
    run_id = store(db, "set.jsonl", 2, {"_tiers": ["small", "big"]}, answers)
    found = observations(db, [run_id], ("small", "big"))
    assert sorted((o.tier, o.correct, o.cost_nanos) for o in found) == [(0, True, 10), (1, False, 30)]
