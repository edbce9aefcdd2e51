"""Named migrations on SQLite, and the request log."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from appliance.store.db import MIGRATIONS, connect, migrate
from appliance.store.request_log import RequestLogWriter, RequestRecord, recent


def test_migrations_apply_once_and_give_the_exact_schema():
    db = connect(":memory:")
    assert migrate(db) == [name for name, _ in MIGRATIONS]
    assert migrate(db) == []
    tables = {row[0]: row[1] for row in db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
    assert set(tables) == {"migrations", "request_log", "api_keys", "auth_failures", "budget_limits", "budget_usage",
                           "reservations", "settlements", "budget_adjustments", "cache_entries", "cache_hits",
                           "cache_feedback", "cache_sweeps", "spans", "eval_runs", "eval_answers", "eval_questions", "responses",
                           "kept_answers", "cache_traps", "cache_trap_cosines", "cache_judgements"}
    columns = [row[1] for row in db.execute("PRAGMA table_info(request_log)")]
    assert columns == ["id", "created_at", "endpoint", "model", "status", "finish_reason", "prompt_tokens",
                       "completion_tokens", "ttft_ms", "total_ms", "error", "tenant", "app", "user", "key_id", "cost_nanos"]
    assert [row[1] for row in db.execute("PRAGMA table_info(eval_questions)")] == [
        "run_id", "question", "ref", "family", "messages", "response_format", "adversarial_of"]
    assert [row[0] for row in db.execute("SELECT name FROM migrations")] == [
        "0001_request_log", "0002_api_keys", "0003_budget_ledger", "0004_request_log_principal", "0005_semantic_cache", "0006_spans", "0007_eval_runs", "0008_eval_answers", "0009_eval_questions", "0010_spans_remote_parent",
        "0011_responses", "0012_kept_answers", "0013_auth_failure_counts", "0014_cache_consistent_state",
        "0015_cache_hit_scores", "0016_cache_vector_chunks", "0017_cache_labelled_traps",
        "0018_cache_trap_cosines", "0019_cache_judgements"]
    assert [row[1] for row in db.execute("PRAGMA table_info(auth_failures)")] == [
        "id", "at", "reason", "key_id", "fingerprint", "client", "path", "count", "last_at"]
    assert [row[1] for row in db.execute("PRAGMA table_info(responses)")] == ["tenant", "id", "created_at", "response", "conversation"]
    assert [row[1] for row in db.execute("PRAGMA table_info(cache_hits)")] == [
        "response_id", "entry_id", "tenant", "at", "similarity", "judged", "entry_state", "saved_nanos", "score", "language", "judge"]
    assert [row[1] for row in db.execute("PRAGMA table_info(kept_answers)")] == [
        "tenant", "response_id", "created_at", "route", "model", "family", "messages", "answer", "finish_reason", "validator", "rating"]


def test_a_database_from_before_the_ledger_migrates_forward(tmp_path: Path):
    db = connect(tmp_path / "old.db")
    assert migrate(db, MIGRATIONS[:1]) == ["0001_request_log"]
    db.execute("INSERT INTO request_log(id, created_at, endpoint, model, status, total_ms) VALUES ('r1', 1, 'chat', 'm', 'ok', 5)")
    assert migrate(db) == ["0002_api_keys", "0003_budget_ledger", "0004_request_log_principal", "0005_semantic_cache", "0006_spans", "0007_eval_runs", "0008_eval_answers", "0009_eval_questions", "0010_spans_remote_parent",
                           "0011_responses", "0012_kept_answers", "0013_auth_failure_counts", "0014_cache_consistent_state",
        "0015_cache_hit_scores", "0016_cache_vector_chunks", "0017_cache_labelled_traps",
        "0018_cache_trap_cosines", "0019_cache_judgements"]
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
    writer = RequestLogWriter(path, 86400)
    for i in range(50):
        writer.record(RequestRecord(f"r{i}", time.time() + i, "chat", "m", "ok", "stop", 10, i, 5.0, 20.0))
    writer.close()
    rows = recent(path, limit=100)
    assert len(rows) == 50
    assert rows[0].id == "r49" and rows[0].completion_tokens == 49


def test_the_request_log_and_stored_responses_keep_rows_for_their_retention_only(tmp_path: Path):
    from appliance.store import responses

    path = tmp_path / "appliance.db"
    db = connect(path)
    migrate(db)
    writer = RequestLogWriter(path, 3600)
    writer.record(RequestRecord("old", time.time() - 7200, "chat", "m", "ok", "stop", 1, 1, 1.0, 1.0))
    writer.record(RequestRecord("new", time.time(), "chat", "m", "ok", "stop", 1, 1, 1.0, 1.0))
    writer.close()
    assert [r.id for r in recent(path)] == ["new"]
    responses.save(db, "t", {"id": "resp_old"}, [], 3600)
    db.execute("UPDATE responses SET created_at = created_at - 7200 WHERE id = 'resp_old'")
    assert responses.load(db, "t", "resp_old", 3600) is None  # past retention: gone before any save deletes it
    assert responses.load(db, "t", "resp_old", 3 * 3600) is not None
    responses.save(db, "t", {"id": "resp_new"}, [], 3600)
    assert db.execute("SELECT id FROM responses").fetchall() == [("resp_new",)]


def test_a_failed_eval_request_is_not_a_wrong_answer():
    from appliance.evaluation.runner import Answer, observations, store

    db = connect(":memory:")
    migrate(db)
    answers = [Answer(0, "small", 0, "math+short", True, 10, 0.1, "small"),
               Answer(0, "big", 1, "math+short", False, 0, 0.1, None),  # the request failed: no answer
               Answer(1, "big", 1, "math+short", False, 30, 0.2, "big"),
               Answer(1, "auto", None, "math+short", True, 30, 0.2, "big")]  # the route is not a tier
    run_id = store(db, "set.jsonl", 2, {"_tiers": ["small", "big"]}, answers)
    found = observations(db, [run_id], ("small", "big"))
    assert sorted((o.tier, o.correct, o.cost_nanos) for o in found) == [(0, True, 10), (1, False, 30)]


def test_the_route_is_placed_against_the_random_routing_line():
    from appliance.evaluation.runner import compare

    def summary(route_accuracy: float, route_cost: float) -> dict:
        return {"small": {"accuracy": 0.25, "cost_usd": 0.0002}, "big": {"accuracy": 0.75, "cost_usd": 0.0022},
                "auto": {"accuracy": route_accuracy, "cost_usd": route_cost}}

    # half way in cost between the two tiers, random routing would score half way in accuracy
    halfway = compare(summary(0.70, 0.0012), ("small", "big"), "auto")
    assert halfway["random_routing_accuracy_at_same_cost"] == pytest.approx(0.50)
    assert halfway["above_random_line"] == pytest.approx(0.20)
    assert halfway["cost_vs_frontier"] == pytest.approx(0.0012 / 0.0022) and not halfway["target_met"]  # 55% of the cost
    below = compare(summary(0.30, 0.0012), ("small", "big"), "auto")
    assert below["above_random_line"] == pytest.approx(-0.20) and not below["target_met"]
    cheap_and_good = compare(summary(0.70, 0.0010), ("small", "big"), "auto")
    assert cheap_and_good["target_met"] and cheap_and_good["accuracy_vs_frontier"] == pytest.approx(0.70 / 0.75)
    too_inaccurate = compare(summary(0.65, 0.0010), ("small", "big"), "auto")
    assert not too_inaccurate["target_met"]  # 87% of the frontier's accuracy


def test_span_retention_drops_old_spans_then_the_oldest_beyond_the_cap(tmp_path: Path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from appliance.store.traces import SqliteSpanExporter

    path = tmp_path / "appliance.db"
    db = connect(path)
    migrate(db)
    exporter = SqliteSpanExporter(path, retention_s=3600, max_spans=3)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    now = time.time_ns()
    for i, age_s in enumerate([7200, 50, 40, 30, 20, 10]):  # the first is past the hour kept
        start = now - age_s * 10**9
        tracer.start_span(f"span-{i}", start_time=start).end(end_time=start + 1000)
    names = [r[0] for r in db.execute("SELECT name FROM spans ORDER BY start_ns")]
    assert names == ["span-1", "span-2", "span-3", "span-4", "span-5"]  # the first export pruned: the old one is gone
    exporter._prune()  # as every 50th export does
    assert [r[0] for r in db.execute("SELECT name FROM spans ORDER BY start_ns")] == ["span-3", "span-4", "span-5"]
    provider.shutdown()


def test_cache_entries_keep_their_rows_when_the_consistent_state_arrives(tmp_path: Path):
    import numpy as np

    from appliance.store.answer_entries import CacheStore
    from policy.answer_cache import Bucket

    db = connect(tmp_path / "old.db")
    migrate(db, MIGRATIONS[:13])  # a database from before 0014
    store = CacheStore(db, "minilm", 4)
    bucket = Bucket("acme", "dev", "m", "v1", "p1")
    vector = np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)
    entry_id = store.store(bucket, "What is the capital of Peru?", "h1", vector, "Lima.", "stop", 5, 2, 700, "r1", 100.0, 10)
    assert entry_id is not None
    assert migrate(db) == ["0014_cache_consistent_state", "0015_cache_hit_scores", "0016_cache_vector_chunks", "0017_cache_labelled_traps",
        "0018_cache_trap_cosines", "0019_cache_judgements"]
    assert store.set_state(entry_id, "consistent", "sweep:agreed")
    found = store.nearest(bucket.key, vector, 1)
    assert [(c.entry_id, c.state, c.question) for c in found] == [(entry_id, "consistent", "What is the capital of Peru?")]


def test_reported_false_hits_are_each_one_trap_and_outlive_a_restart(tmp_path: Path):
    import numpy as np

    from appliance.store.answer_entries import CacheStore, Reported
    from policy.answer_cache import Bucket

    db = connect(tmp_path / "cache.db")
    migrate(db)
    store = CacheStore(db, "minilm", 4)
    bucket = Bucket("acme", "dev", "m", "v1", "p1")
    entry_id = store.store(bucket, "What is the capital of Peru?", "h1", np.array([1.0, 0, 0, 0], dtype=np.float32), "Lima.", "stop",
                           5, 2, 700, "r1", 100.0, 10)
    entry = store.get(entry_id)
    assert entry is not None
    store.record_hit(entry, "r2", 0.97, False, 101.0, score=0.97, language="en")
    store.record_hit(entry, "r3", 1.0, False, 102.0)  # an exact repeat: no bound admitted it, no trap
    assert store.feedback("r2", "bad", "acme", 103.0) == (entry_id, True)
    assert store.newly_reported("r2", "acme") == Reported("acme", "en", 0.97)
    store.feedback("r2", "bad", "acme", 104.0)
    assert store.newly_reported("r2", "acme") is None  # the same hit reported twice is one trap
    assert store.newly_reported("r2", "globex") is None
    store.feedback("r3", "bad", "acme", 105.0)
    db.close()
    again = CacheStore(connect(tmp_path / "cache.db"), "minilm", 4)
    assert again.reported() == [Reported("acme", "en", 0.97)]


def test_vector_tables_move_to_small_chunks_with_their_vectors(tmp_path: Path):
    """Before 0016 a bucket's first vector took a whole 1,024-vector chunk (1.6 MB at 384 dimensions):
    the vectors move to tables of small chunks, searchable as before, and a bucket costs little."""
    import os

    import numpy as np

    from appliance.store.answer_entries import CacheStore

    path = tmp_path / "old.db"
    db = connect(path)
    migrate(db, MIGRATIONS[:15])
    old = 1024
    db.execute("CREATE VIRTUAL TABLE cache_vec_minilm_384 USING vec0(entry_id INTEGER PRIMARY KEY, bucket TEXT PARTITION KEY, "
               "embedding float[384] distance_metric=cosine)")
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((3, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for i, v in enumerate(vectors):
        db.execute("INSERT INTO cache_vec_minilm_384(entry_id, bucket, embedding) VALUES (?, ?, ?)", (i + 1, f"b{i % 2}", v.tobytes()))
    assert migrate(db) == ["0016_cache_vector_chunks", "0017_cache_labelled_traps",
        "0018_cache_trap_cosines", "0019_cache_judgements"]
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE name LIKE 'cache_vec%'")}
    assert "cache_vec_minilm_384" not in names and "cache_vectors_minilm_384" in names
    store = CacheStore(db, "minilm", 384)
    assert store.vectors == "cache_vectors_minilm_384"
    found = db.execute(f"SELECT entry_id, distance FROM {store.vectors} WHERE embedding MATCH ? AND k = 1 AND bucket = 'b0'",
                       (vectors[2].tobytes(),)).fetchall()
    assert found[0][0] == 3 and found[0][1] < 1e-5
    before = os.path.getsize(path)
    db.execute("BEGIN")
    for b in range(50):  # fifty more buckets of one entry each
        store.db.execute(f"INSERT INTO {store.vectors}(entry_id, bucket, embedding) VALUES (?, ?, ?)", (100 + b, f"n{b}", vectors[0].tobytes()))
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert (os.path.getsize(path) - before) / 50 < 384 * 4 * old / 8  # far under a whole default chunk per bucket


def test_labelled_traps_stop_at_their_cap_and_a_call_past_it_stores_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from appliance.store import answer_entries
    from appliance.store.answer_entries import CacheStore, LabelledTrap, TrapsFull

    monkeypatch.setattr(answer_entries, "MAX_LABELLED_TRAPS", 3)
    db = connect(tmp_path / "cache.db")
    migrate(db)
    store = CacheStore(db, "minilm", 4)
    pair = [LabelledTrap("", f"Is {n} even?", f"Is {n} odd?") for n in range(5)]

    def stored(traps: list[LabelledTrap], first_id: int) -> list[LabelledTrap]:
        return [LabelledTrap(t.tenant, t.cached, t.asked, first_id + i) for i, t in enumerate(traps)]

    assert store.add_traps(pair[:2], 1.0) == stored(pair[:2], 1)
    assert store.add_traps(pair[:2], 2.0) == []  # known pairs are not counted twice
    with pytest.raises(TrapsFull) as full:
        store.add_traps(pair[2:], 3.0)  # 2 + 3 > 3: all or nothing
    assert full.value.stored == 2
    assert store.labelled_traps() == stored(pair[:2], 1)
    assert [t.cached for t in store.add_traps(pair[2:3], 4.0)] == ["Is 2 even?"]
    # A trap's cosine is kept per embedder, and only for a trap that is stored.
    store.keep_trap_cosines("minilm", {1: 0.91, 2: 0.88, 99: 0.5})
    assert store.trap_cosines("minilm") == {1: 0.91, 2: 0.88} and store.trap_cosines("e5") == {}
