"""Identity, rate limits and budgets through the real server, real model and real HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import apsw
import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, ROOT, Server, config_text, start_server, stop_server
from policy.budgets import Price

PRICE_IN, PRICE_OUT = 1.0, 2.0  # dollars per million tokens, in the test config
PRICE = Price.per_million(PRICE_IN, PRICE_OUT)
GATE_CONFIG = """
[auth]
mode = "keys"
key_cache_s = 0.5

[budgets]
lease_s = {lease_s}

[[limits]]
level = "tenant"
name = "throttled"
requests_per_minute = 2

[[limits]]
level = "tenant"
name = "t-tpm"
tokens_per_minute = 400
"""


def gate_config(lease_s: float = 300.0) -> str:
    text = config_text(embeddings=False, price_in=PRICE_IN, price_out=PRICE_OUT, auth="keys")
    # the auth table config_text writes is replaced by this file's
    text = text.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', "")
    return GATE_CONFIG.format(lease_s=lease_s) + text


def cli(server: Server, *args: str) -> str:
    env = {**os.environ, "APPLIANCE_HOME": str(server.home)}
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli.main", *args, "--config", str(server.home.parent / "models.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def new_key(server: Server, tenant: str, *, user: str = "ann", app: str = "web", admin: bool = False) -> str:
    out = cli(server, "keys", "create", "--tenant", tenant, "--app", app, "--user", user, "--role", "dev", *(["--admin"] if admin else []))
    return out.strip().splitlines()[-1]  # the secret, alone on the last line


def db(server: Server) -> apsw.Connection:
    return apsw.Connection(str(server.home / "appliance.db"), flags=apsw.SQLITE_OPEN_READONLY)


def wait_settled(server: Server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while db(server).execute("SELECT count(*) FROM reservations").fetchone()[0]:
        assert time.monotonic() < deadline, "reservations still held"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    srv = start_server(tmp_path_factory.mktemp("gated"), gate_config())
    admin = new_key(srv, "ops", user="root", admin=True)
    yield srv, admin
    stop_server(srv)


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def admin_call(server: Server, admin: str, method: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", headers={"Authorization": f"Bearer {admin}"}, timeout=30, **kwargs)  # type: ignore[arg-type]


def ask(c: openai.OpenAI, max_tokens: int = 8) -> openai.types.chat.ChatCompletion:
    return c.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=max_tokens, temperature=0)


def test_no_key_or_a_wrong_key_is_401_in_openai_format(gated: tuple[Server, str]) -> None:
    server, _ = gated
    for key in ("apl-not-a-real-key", "x"):
        with pytest.raises(openai.AuthenticationError) as caught:
            ask(client(server, key))
        assert caught.value.status_code == 401
        assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    response = httpx.get(f"{server.base_url}/v1/models")
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Basic abc"})
    assert response.status_code == 401 and "Bearer" in response.json()["error"]["message"]
    assert ask(client(server, new_key(server, "t-ok"))).choices[0].message.content


def test_failed_attempts_are_logged_without_the_secret(gated: tuple[Server, str]) -> None:
    server, admin = gated
    secret = "apl-this-secret-must-never-be-stored-anywhere"
    with pytest.raises(openai.AuthenticationError):
        ask(client(server, secret))
    failures = admin_call(server, admin, "GET", "/admin/auth/failures").json()["failures"]
    mine = [f for f in failures if f["reason"] == "unknown" and f["path"] == "/v1/chat/completions"]
    assert mine and all(secret not in str(f) for f in failures)
    stored = b"".join(p.read_bytes() for p in server.home.glob("appliance.db*"))
    assert secret.encode() not in stored and secret not in server.log.read_text()


def test_revoked_and_expired_keys_are_refused(gated: tuple[Server, str]) -> None:
    server, admin = gated
    made = admin_call(server, admin, "POST", "/admin/keys", json={"tenant": "t-exp", "app": "a", "user": "u", "role": "dev", "expires_in_s": 1.5})
    assert made.status_code == 201
    short = made.json()["secret"]
    assert ask(client(server, short)).choices
    time.sleep(1.6)
    with pytest.raises(openai.AuthenticationError, match="expired"):
        ask(client(server, short))

    key = new_key(server, "t-rev")
    assert ask(client(server, key)).choices
    key_id = next(k["id"] for k in admin_call(server, admin, "GET", "/admin/keys").json()["keys"] if k["tenant"] == "t-rev")
    assert "secret" not in str(admin_call(server, admin, "GET", "/admin/keys").json())
    assert admin_call(server, admin, "DELETE", f"/admin/keys/{key_id}").status_code == 200
    with pytest.raises(openai.AuthenticationError, match="revoked"):  # at once through the admin API
        ask(client(server, key))

    other = new_key(server, "t-rev-cli")
    assert ask(client(server, other)).choices
    other_id = next(k["id"] for k in admin_call(server, admin, "GET", "/admin/keys").json()["keys"] if k["tenant"] == "t-rev-cli")
    cli(server, "keys", "revoke", other_id)
    time.sleep(0.6)  # the test config trusts a checked key for 0.5 s
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        ask(client(server, other))


def test_admin_routes_need_an_admin_key(gated: tuple[Server, str]) -> None:
    server, admin = gated
    user_key = new_key(server, "t-user")
    response = admin_call(server, user_key, "GET", "/admin/budgets")
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_required"
    assert httpx.get(f"{server.base_url}/admin/budgets").status_code == 401
    assert admin_call(server, admin, "GET", "/admin/budgets").status_code == 200
    bad = admin_call(server, admin, "PUT", "/admin/budgets", json={"level": "galaxy", "name": "x", "usd": 1, "period": "day"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    bad = admin_call(server, admin, "PUT", "/admin/budgets", json={"level": "tenant", "name": "x", "usd": 1, "period": "week"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "period"
    bad = admin_call(server, admin, "PUT", "/admin/budgets", json={"level": "tenant", "usd": 1, "period": "day"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"


def test_a_rate_limit_refuses_with_retry_after_and_names_the_level(gated: tuple[Server, str]) -> None:
    server, _ = gated
    c = client(server, new_key(server, "throttled"))
    ask(c, 2)
    ask(c, 2)
    with pytest.raises(openai.RateLimitError) as caught:
        ask(c, 2)
    assert "tenant 'throttled'" in caught.value.message and "2 requests per minute" in caught.value.message
    assert 1 <= int(caught.value.response.headers["Retry-After"]) <= 30
    assert caught.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert ask(client(server, new_key(server, "t-free")), 2).choices  # other tenants are not throttled


def _prompt_tokens(server: Server) -> int:
    return ask(client(server, new_key(server, "t-probe")), 1).usage.prompt_tokens  # type: ignore[union-attr]


def test_64_concurrent_requests_never_overspend_a_budget_that_covers_10(gated: tuple[Server, str]) -> None:
    server, admin = gated
    max_tokens = 24
    per_request = PRICE.cost(_prompt_tokens(server), max_tokens)
    budget_nanos = 10 * per_request + per_request // 3
    cli(server, "budgets", "set", "tenant", "crowd", "--usd", f"{budget_nanos / 1e9:.9f}", "--period", "day")
    key = new_key(server, "crowd")

    async def one(c: openai.AsyncOpenAI) -> str:
        try:
            await c.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                            max_tokens=max_tokens, temperature=0)
            return "served"
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "budget_exceeded", exc.body  # type: ignore[index]
            assert "tenant 'crowd'" in exc.message
            return "refused"

    async def crowd() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c) for _ in range(64)))

    outcomes = asyncio.run(crowd())
    wait_settled(server)
    conn = db(server)
    charged = conn.execute("SELECT coalesce(sum(charged_nanos), 0) FROM settlements WHERE tenant = 'crowd'").fetchone()[0]
    spent, held = conn.execute("SELECT spent_nanos, held_nanos FROM budget_usage WHERE level = 'tenant' AND name = 'crowd' AND window LIKE 'd:%'").fetchone()
    assert outcomes.count("served") >= 10 and outcomes.count("refused") >= 1, outcomes
    assert charged == spent <= budget_nanos and held == 0
    served_rows = conn.execute("SELECT count(*) FROM settlements WHERE tenant = 'crowd' AND outcome IN ('stop', 'length')").fetchone()[0]
    assert served_rows == outcomes.count("served")
    assert admin_call(server, admin, "GET", "/admin/ledger/check").json() == {"balanced": True, "problems": []}
    metrics = httpx.get(f"{server.base_url}/metrics").text
    refused = next(line for line in metrics.splitlines() if line.startswith('appliance_budget_refused_total{level="tenant"}'))
    assert float(refused.split()[-1]) >= outcomes.count("refused")
    assert "appliance_budget_reservations_open 0.0" in metrics


def test_max_tokens_is_lowered_to_what_the_budget_covers(gated: tuple[Server, str]) -> None:
    server, admin = gated
    prompt = _prompt_tokens(server)
    budget = PRICE.cost(prompt, 20)
    put = admin_call(server, admin, "PUT", "/admin/budgets", json={"level": "user", "name": "carol", "usd": budget / 1e9, "period": "total"})
    assert put.status_code == 200
    c = client(server, new_key(server, "t-clamp", user="carol"))
    raw = c.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=500, temperature=0)
    assert int(raw.headers["x-budget-max-tokens"]) == 20
    assert raw.parse().usage.completion_tokens <= 20  # type: ignore[union-attr]
    wait_settled(server)
    with pytest.raises(openai.RateLimitError, match="user 'carol'") as caught:  # what is left is below min_tokens
        ask(c, 500)
    assert caught.value.body["type"] == "insufficient_quota"  # type: ignore[index]
    assert "Retry-After" not in caught.value.response.headers  # a total budget never resets by itself


def test_a_client_gone_mid_stream_pays_for_the_tokens_generated_and_no_more(gated: tuple[Server, str]) -> None:
    server, _ = gated
    key = new_key(server, "t-cancel")
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    seen, request_id = 0, None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                request_id = request_id or line.split('"id":"')[1].split('"')[0]
                seen += 1
                if seen == 5:
                    break
    wait_settled(server)
    row = db(server).execute(
        "SELECT outcome, reserved_nanos, charged_nanos, prompt_tokens, completion_tokens FROM settlements WHERE request_id = ?", (request_id,)
    ).fetchone()
    assert row is not None, request_id
    outcome, reserved, charged, prompt, completion = row
    assert outcome == "cancelled"
    assert 5 <= completion < 200
    assert charged == PRICE.cost(prompt, completion) < reserved == PRICE.cost(prompt, 400)
    spent = db(server).execute("SELECT spent_nanos FROM budget_usage WHERE level = 'tenant' AND name = 't-cancel' AND window = 't'").fetchone()[0]
    assert spent == charged
    server.wait_idle()


def long_streams(server: Server, key: str, count: int) -> list[threading.Thread]:
    """`count` long streamed requests, returned once every one has its first tokens (and so its
    reservation); each thread ends when its stream does, or breaks."""
    started = threading.Barrier(count + 1)
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Count from one to five hundred."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 3:
                        started.wait(timeout=30)
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    return threads


def test_kill_9_mid_stream_leaves_nothing_held_after_the_lease(tmp_path: Path) -> None:
    workdir = tmp_path / "crash"
    server = start_server(workdir, gate_config(lease_s=2.0))
    threads = long_streams(server, new_key(server, "t-crash"), 3)
    assert db(server).execute("SELECT count(*) FROM reservations").fetchone()[0] == 3
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    for t in threads:
        t.join(timeout=30)

    restarted = start_server(workdir, gate_config(lease_s=2.0))
    try:
        admin = new_key(restarted, "ops", admin=True)
        wait_settled(restarted, timeout=20)
        conn = db(restarted)
        assert conn.execute("SELECT count(*) FROM settlements WHERE tenant = 't-crash' AND outcome = 'expired'").fetchone()[0] == 3
        assert conn.execute("SELECT held_nanos FROM budget_usage WHERE level = 'global' AND window = 't'").fetchone()[0] == 0
        assert admin_call(restarted, admin, "GET", "/admin/ledger/check").json()["balanced"]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert admin_call(restarted, admin, "GET", "/admin/budgets").json()["reservations"] == []
    finally:
        stop_server(restarted)


def test_budgets_cli_show_lists_levels_and_spend(gated: tuple[Server, str]) -> None:
    server, _ = gated
    cli(server, "budgets", "set", "global", "--usd", "50", "--period", "month")
    ask(client(server, new_key(server, "t-show")), 4)
    wait_settled(server)
    import json

    shown = json.loads(cli(server, "budgets", "show", "--json"))
    glob = next(b for b in shown["budgets"] if b["level"] == "global")
    assert glob["limit_usd"] == 50 and glob["spent_usd"] > 0 and glob["held_usd"] == 0
    assert shown["balanced"] and shown["reservations"] == []
    assert any(t["name"] == "t-show" for t in shown["top_spenders_today"]["tenant"])
    cli(server, "budgets", "unset", "global")


def test_sigterm_mid_stream_loses_no_spend(tmp_path: Path) -> None:
    workdir = tmp_path / "term"
    config = gate_config().replace("[server]\n", "[server]\nshutdown_grace_s = 1\n")
    server = start_server(workdir, config)
    threads = long_streams(server, new_key(server, "t-term"), 2)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    conn = db(server)
    assert conn.execute("SELECT count(*) FROM reservations").fetchone()[0] == 0
    rows = conn.execute("SELECT completion_tokens, charged_nanos FROM settlements WHERE tenant = 't-term'").fetchall()
    assert len(rows) == 2 and all(completion > 0 and charged > 0 for completion, charged in rows), rows
    spent = conn.execute("SELECT spent_nanos FROM budget_usage WHERE level = 'tenant' AND name = 't-term' AND window = 't'").fetchone()[0]
    assert spent == sum(charged for _, charged in rows)


def test_n_choices_reserve_for_every_completion(gated: tuple[Server, str]) -> None:
    # Last in the module: its tenants' spend would push the small spenders that the budgets listing test
    # looks for out of the day's top ten.
    server, admin = gated
    prompt = _prompt_tokens(server)
    budget = PRICE.cost(prompt, 40)
    put = admin_call(server, admin, "PUT", "/admin/budgets", json={"level": "user", "name": "nina", "usd": budget / 1e9, "period": "total"})
    assert put.status_code == 200
    c = client(server, new_key(server, "t-n", user="nina"))
    raw = c.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=500, temperature=1, seed=1, n=4)
    assert int(raw.headers["x-budget-max-tokens"]) == 10  # 40 tokens covered, shared by 4 choices
    response = raw.parse()
    assert len(response.choices) == 4 and response.usage is not None and response.usage.completion_tokens <= 40
    wait_settled(server)
    spent = db(server).execute("SELECT spent_nanos FROM budget_usage WHERE level = 'user' AND name = 'nina' AND window = 't'").fetchone()[0]
    assert spent == PRICE.cost(response.usage.prompt_tokens, response.usage.completion_tokens)  # the prompt once, every choice's tokens

    # 400 tokens a minute (a full bucket admits anything, so it is first drawn down by a real call):
    # one choice of up to 150 tokens still fits what is left, three do not.
    limited = client(server, new_key(server, "t-tpm"))
    count = [{"role": "user", "content": "Count from 1 to 40."}]
    used = limited.chat.completions.create(model=CHAT_MODEL, messages=count, max_tokens=100, temperature=0).usage
    assert used is not None and used.total_tokens >= 60  # ~10 s of refill at 400 a minute
    with pytest.raises(openai.RateLimitError, match="400 tokens per minute"):
        limited.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=150, n=3)
    assert limited.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=150).choices
