"""A data directory made by an older commit (tests/data/upgrade/<commit>/, built by
tests/upgrade/make_fixture.py through that commit's own server) opens with today's code, migrates,
and loses nothing: its keys, budgets and ledger, cache entries, stored response, traces and eval run."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import apsw
import httpx
import pytest
import sqlite_vec

from appliance.store.answer_entries import VECTOR_CHUNK
from appliance.store.db import MIGRATIONS, connect, migrate
from tests.conftest import ROOT, Server, start_server, stop_server
from tests.test_gate_api import cli

FIXTURE = ROOT / "tests" / "data" / "upgrade" / "c02c2ec"
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())
# The fixture's rows keep their dates: the current code's retentions are set past them (its own
# config predates those keys, and the commit that wrote it would refuse them).
CONFIG = (FIXTURE / MANIFEST["config"]).read_text().replace("[server]\n", "[server]\nrequest_log_days = 3650\nresponses_days = 3650\n", 1)
LATEST = [name for name, _ in MIGRATIONS]
NEW = [name for name in LATEST if name not in MANIFEST["migrations"]]
FAILURE_RETENTION_S = 30 * 86400  # appliance/pipeline/gate.py: failed sign-ins older than this are dropped


def unpack(workdir: Path) -> Path:
    """The fixture's database as a data directory's; returns its path."""
    home = workdir / "home"
    home.mkdir(parents=True)
    target = home / "appliance.db"
    with gzip.open(FIXTURE / MANIFEST["database"]) as packed, target.open("wb") as plain:
        shutil.copyfileobj(packed, plain)
    return target


def open_db(path: Path, *, readonly: bool = True) -> apsw.Connection:
    db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY if readonly else apsw.SQLITE_OPEN_READWRITE)
    db.enable_load_extension(True)
    db.load_extension(sqlite_vec.loadable_path())
    db.enable_load_extension(False)
    return db


def vector_tables(db: apsw.Connection) -> dict[str, str]:
    return dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND sql LIKE 'CREATE VIRTUAL TABLE%'"))


def renamed(table: str) -> str:
    """Migration 0016 moves each old vector table (cache_vec_*) to cache_vectors_*."""
    return "cache_vectors_" + table.removeprefix("cache_vec_") if table in MANIFEST["virtual_tables"] else table


def counts(db: apsw.Connection) -> dict[str, int]:
    return {renamed(t): db.execute(f"SELECT count(*) FROM {renamed(t)}").fetchone()[0] for t in MANIFEST["counts"]}


def columns(db: apsw.Connection, table: str) -> list[str]:
    return [row[1] for row in db.execute(f"PRAGMA table_info({table})")]


def schema(db: apsw.Connection) -> dict[str, object]:
    """Each ordinary table's columns (name, type, not null, default, key) and indexes (unique, columns)."""
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                                       "AND name NOT LIKE 'cache_vec%'")]
    found: dict[str, object] = {}
    for t in sorted(tables):
        cols = [tuple(row[1:]) for row in db.execute(f"PRAGMA table_info({t})")]
        indexes = sorted((row[2], tuple(c[2] for c in db.execute(f"PRAGMA index_info({row[1]})")))
                         for row in db.execute(f"PRAGMA index_list({t})"))
        found[t] = (cols, indexes)
    return found


def rows(db: apsw.Connection, table: str, names: list[str]) -> list[tuple]:
    return sorted(db.execute(f"SELECT {', '.join(names)} FROM {table}").fetchall(), key=repr)


def test_the_fixture_is_what_its_manifest_says(tmp_path: Path) -> None:
    db = open_db(unpack(tmp_path))
    assert [r[0] for r in db.execute("SELECT name FROM migrations ORDER BY name")] == MANIFEST["migrations"]
    assert {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in MANIFEST["counts"]} == MANIFEST["counts"]
    assert len(NEW) >= 4 and NEW == LATEST[len(MANIFEST["migrations"]):]  # the fixture is several migrations behind
    states = {e["question"]: e["state"] for e in MANIFEST["cache"]["entries"]}
    assert states[MANIFEST["cache"]["verified_question"]] == "verified"  # a caller's feedback verified one
    db.close()


def test_the_old_database_migrates_in_place_keeping_every_row_and_becomes_todays_schema(tmp_path: Path) -> None:
    path = unpack(tmp_path)
    old = open_db(path)
    before = {t: (columns(old, t), rows(old, t, columns(old, t))) for t in MANIFEST["counts"] if t not in MANIFEST["virtual_tables"]}
    old_vectors = {t: rows(old, t, ["entry_id", "bucket", "embedding"]) for t in MANIFEST["virtual_tables"]}
    old.close()

    db = connect(path)
    assert migrate(db) == NEW
    for table, (names, kept) in before.items():
        if table == "migrations":
            assert rows(db, table, names)[:len(kept)] == kept  # the old ones, with their times, before today's
            continue
        assert rows(db, table, names) == kept, table  # every row, every value of the columns it had
    for table, kept in old_vectors.items():
        assert rows(db, renamed(table), ["entry_id", "bucket", "embedding"]) == kept
    assert set(vector_tables(db)) == {renamed(t) for t in MANIFEST["virtual_tables"]}  # the old ones are gone
    assert all(f"chunk_size={VECTOR_CHUNK}" in sql for sql in vector_tables(db).values())
    # 0013: each old failed sign-in is one attempt, last seen when it was made.
    assert rows(db, "auth_failures", ["count", "last_at"]) == sorted(((1, f["at"]) for f in MANIFEST["auth_failures"]), key=repr)

    fresh = connect(":memory:")
    migrate(fresh)
    assert schema(db) == schema(fresh)  # an upgraded database is one made today

    settled = schema(db), {t: rows(db, t, columns(db, t)) for t in schema(db)}
    assert migrate(db) == []
    assert (schema(db), {t: rows(db, t, columns(db, t)) for t in schema(db)}) == settled
    db.close()


@dataclass
class Box:
    """Today's server on the upgraded data directory, and what it held when it started."""

    work: Path
    server: Server
    started: float  # failed sign-ins older than a month before this were dropped at start
    at_start: dict


def call(box: Box, key: str, method: str, path: str, **kwargs: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, f"{box.server.base_url}{path}", headers=headers, timeout=120, **kwargs)  # type: ignore[arg-type]


ADMIN = MANIFEST["keys"]["admin"]["secret"]


def chat(box: Box, key: str, question: str, max_tokens: int = 16) -> httpx.Response:
    return call(box, key, "POST", "/v1/chat/completions",
                      json={"model": "smollm2-135m", "messages": [{"role": "user", "content": question}],
                            "max_tokens": max_tokens, "temperature": 0})


def facts(path: Path) -> dict:
    db = open_db(path)
    found = {
        "migrations": db.execute("SELECT name, applied_at FROM migrations ORDER BY name").fetchall(),
        "counts": counts(db),
        "vector_tables": vector_tables(db),
        "sqlite_master": sorted(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall(), key=repr),
        "charged": db.execute("SELECT count(*), coalesce(sum(charged_nanos), 0) FROM settlements").fetchone(),
        "budget_usage": [dict(zip(("level", "name", "window", "spent_nanos", "held_nanos"), r)) for r in db.execute(
            "SELECT level, name, window, spent_nanos, held_nanos FROM budget_usage ORDER BY level, name, window")],
    }
    db.close()
    return found


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    work = tmp_path_factory.mktemp("upgraded")
    path = unpack(work)
    started = time.time()
    server = start_server(work, CONFIG)
    state = Box(work, server, started, {})
    try:
        # Read before any call of the tests' charges, caches or logs something.
        state.at_start = {
            **facts(path),
            "budgets": call(state, ADMIN, "GET", "/admin/budgets").json(),
            "ledger_check": call(state, ADMIN, "GET", "/admin/ledger/check").json(),
        }
        yield state
    finally:
        stop_server(state.server)


def test_todays_migrations_ran_after_the_old_ones(box: Box) -> None:
    applied = box.at_start["migrations"]
    assert [name for name, _ in applied] == LATEST
    made_at = MANIFEST["made_at"]
    assert all(at <= made_at for name, at in applied if name in MANIFEST["migrations"])
    assert all(at > made_at for name, at in applied if name in NEW)


def test_every_row_count_is_kept(box: Box) -> None:
    expected = {renamed(t): n for t, n in MANIFEST["counts"].items()}
    expected["migrations"] = len(LATEST)
    expected["auth_failures"] = sum(1 for f in MANIFEST["auth_failures"] if f["at"] >= box.started - FAILURE_RETENTION_S)
    assert box.at_start["counts"] == expected
    # Today's server searches the vectors 0016 moved, not a new empty table beside them.
    assert list(box.at_start["vector_tables"]) == [renamed(t) for t in MANIFEST["virtual_tables"]]


def test_the_ledger_balances_and_holds_the_old_totals(box: Box) -> None:
    assert box.at_start["ledger_check"] == {"balanced": True, "problems": []}
    ledger = MANIFEST["ledger"]
    assert box.at_start["charged"] == (ledger["settled_requests"], ledger["charged_nanos"]) and ledger["charged_nanos"] > 0
    budgets = {(b["level"], b["name"]): b for b in box.at_start["budgets"]["budgets"]}
    for old in MANIFEST["budgets"]:
        now = budgets[(old["level"], old["name"])]
        assert (now["period"], now["limit_usd"], now["spent_usd"], now["held_usd"]) == \
               (old["period"], old["limit_usd"], old["spent_usd"], 0.0)
    assert box.at_start["budgets"]["reservations"] == []
    assert box.at_start["budget_usage"] == ledger["budget_usage"]  # every payer's spend in every window, to the nano


def test_each_key_is_allowed_or_refused_as_before(box: Box) -> None:
    keys = MANIFEST["keys"]
    listed = {k["id"]: k for k in call(box, ADMIN, "GET", "/admin/keys").json()["keys"]}
    assert {(k["id"], k["tenant"], k["admin"], k["revoked_at"]) for k in listed.values()} == \
           {(k["id"], k["tenant"], k["admin"], k["revoked_at"]) for k in MANIFEST["key_records"]}
    assert listed[keys["revoked"]["id"]]["revoked_at"] is not None
    allowed = chat(box, keys["acme"]["secret"], "Name a month.", max_tokens=4)
    assert allowed.status_code == 200, allowed.text
    over = chat(box, keys["globex"]["secret"], "Name a fruit.")
    assert over.status_code == 429 and over.json()["error"]["code"] == "budget_exceeded", over.text
    revoked = chat(box, keys["revoked"]["secret"], "Name a month.")
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"], revoked.text
    not_admin = call(box, keys["acme"]["secret"], "GET", "/admin/budgets")
    assert not_admin.status_code == 403 and not_admin.json()["error"]["code"] == "admin_required"
    assert chat(box, "apl-not-a-key-of-this-box", "Name a month.").status_code == 401


def test_the_cached_question_is_answered_from_the_cache(box: Box) -> None:
    cache = MANIFEST["cache"]
    hit = chat(box, MANIFEST["keys"]["acme"]["secret"], cache["question"])
    assert hit.status_code == 200, hit.text
    assert hit.headers["x-cache"] == "hit", dict(hit.headers)
    assert hit.json()["choices"][0]["message"]["content"] == cache["answer"]
    entries = {e["id"]: e for e in call(box, ADMIN, "GET", "/admin/cache/entries").json()["entries"]}
    for old in cache["entries"]:
        assert (entries[old["id"]]["question"], entries[old["id"]]["answer"], entries[old["id"]]["state"]) == \
               (old["question"], old["answer"], old["state"])
    assert entries[cache["entry_id"]]["hits"] == next(e["hits"] for e in cache["entries"] if e["id"] == cache["entry_id"]) + 1


def test_the_stored_response_is_retrievable_by_its_tenant_only(box: Box) -> None:
    stored = MANIFEST["response"]
    mine = call(box, MANIFEST["keys"]["acme"]["secret"], "GET", f"/v1/responses/{stored['id']}")
    assert mine.status_code == 200, mine.text
    body = mine.json()
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])
    assert (body["id"], text) == (stored["id"], stored["output_text"])
    assert call(box, MANIFEST["keys"]["globex"]["secret"], "GET", f"/v1/responses/{stored['id']}").status_code == 404


def test_old_traces_and_failed_sign_ins_are_readable(box: Box) -> None:
    listed = call(box, ADMIN, "GET", "/admin/traces", params={"limit": 1000})
    assert listed.status_code == 200, listed.text
    assert set(MANIFEST["traces"]) <= {t["trace_id"] for t in listed.json()["traces"]}
    for trace_id in MANIFEST["traces"]:
        tree = call(box, ADMIN, "GET", f"/admin/traces/{trace_id}")
        assert tree.status_code == 200 and trace_id in tree.text, (trace_id, tree.text[:300])
    failures = call(box, ADMIN, "GET", "/admin/auth/failures").json()["failures"]
    kept = [f for f in MANIFEST["auth_failures"] if f["at"] >= box.started - FAILURE_RETENTION_S]
    old = [f for f in failures if f["at"] <= MANIFEST["made_at"]]
    assert [(f["at"], f["last_at"], f["count"], f["reason"], f["path"]) for f in old] == \
           [(f["at"], f["at"], 1, f["reason"], f["path"]) for f in kept]


def test_the_eval_run_is_listed_and_exports(box: Box, tmp_path: Path) -> None:
    run = MANIFEST["eval_run"]
    listed = json.loads(cli(box.server, "eval", "router", "--history", "--json"))["runs"]
    assert [(r["id"], r["questions"]) for r in listed] == [(run["id"], run["questions"])]
    out = tmp_path / "run.jsonl"
    said = cli(box.server, "eval", "export", "--run", str(run["id"]), "--out", str(out))
    assert f"({run['questions']} questions)" in said and out.exists()


def test_a_second_start_changes_nothing(box: Box) -> None:
    """Runs last: it restarts the module's server."""
    stop_server(box.server)
    path = box.server.home / "appliance.db"
    before = facts(path)
    box.server = start_server(box.work, CONFIG)
    assert call(box, ADMIN, "GET", "/admin/ledger/check").json() == {"balanced": True, "problems": []}
    stop_server(box.server)
    after = facts(path)
    assert after["migrations"] == before["migrations"]  # nothing applied again, nothing re-stamped
    assert after["sqlite_master"] == before["sqlite_master"]
    assert after["counts"] == before["counts"] and after["charged"] == before["charged"]
