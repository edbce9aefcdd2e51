"""The semantic cache through the real server: real embedder, real SQLite, real model, real HTTP."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import apsw
import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server
from tests.test_gate_api import cli, new_key

SECOND_MODEL = "smollm2-135m-b"  # the same file under another alias: another model, another bucket
QUESTION = "How do I reset my password?"
PARAPHRASE = "What is the way to reset my password?"


def cache_config() -> str:
    text = config_text(embeddings=False, auth="keys", price_in=1.0, price_out=2.0,
                       cache="enabled = true\nsweep_interval_s = 0\nagree_threshold = 0.95")
    text = text.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\nkey_cache_s = 0.5\n')
    return text + f"""
[[models]]
alias = "{SECOND_MODEL}"
package_file = "{MODEL_FILE}"
context_length = 1024
slots = 2
threads = 2
"""


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, str]]]:
    srv = start_server(tmp_path_factory.mktemp("cached"), cache_config())
    keys = {
        "admin": new_key(srv, "ops", user="root", admin=True),
        "acme": new_key(srv, "acme"),
        "acme2": new_key(srv, "acme", user="bob"),
        "zeta": new_key(srv, "zeta"),
    }
    out = cli(srv, "keys", "create", "--tenant", "acme", "--app", "web", "--user", "carol", "--role", "support")
    keys["acme-support"] = out.strip().splitlines()[-1]
    yield srv, keys
    stop_server(srv)


def ask(server: Server, key: str, question: str, *, model: str = CHAT_MODEL, system: str | None = None, stream: bool = False,
        headers: dict[str, str] | None = None, **extra: object) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": stream, **extra}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=120)


def db(server: Server) -> apsw.Connection:
    conn = apsw.Connection(str(server.home / "appliance.db"))
    conn.setbusytimeout(10_000)  # the server's store thread may be writing a hit this moment
    return conn


def stored(server: Server, question: str, timeout: float = 10.0, count: int = 1) -> list[tuple]:
    """Entries are written off the request path: wait for `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        rows = db(server).execute("SELECT id, tenant, role, model, state FROM cache_entries WHERE question = ?", (question,)).fetchall()
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def eventually(server: Server, sql: str, *params: object, timeout: float = 10.0) -> tuple | None:
    """A row written off the request path (settlements, the request log)."""
    deadline = time.monotonic() + timeout
    while (row := db(server).execute(sql, params).fetchone()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return row


def test_a_reworded_question_gets_the_stored_answer(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    first = ask(server, keys["acme"], QUESTION)
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    assert stored(server, QUESTION)
    again = ask(server, keys["acme"], QUESTION)
    assert again.headers["x-cache"] == "hit" and float(again.headers["x-cache-similarity"]) == 1.0
    reworded = ask(server, keys["acme2"], PARAPHRASE)  # another user of the same tenant and role
    assert reworded.headers["x-cache"] == "hit" and 0.7 <= float(reworded.headers["x-cache-similarity"]) < 1.0
    answer = first.json()["choices"][0]["message"]["content"]
    assert reworded.json()["choices"][0]["message"]["content"] == answer
    assert reworded.json()["id"] != first.json()["id"]
    trap = ask(server, keys["acme"], "How do I reset my password in 2 minutes?")
    assert trap.headers["x-cache"] == "miss" and trap.headers["x-cache-reason"] == "guard:number"

    streamed = ask(server, keys["acme"], PARAPHRASE, stream=True, stream_options={"include_usage": True})
    assert streamed.headers["x-cache"] == "hit" and streamed.headers["content-type"].startswith("text/event-stream")
    chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    import json

    bodies = [json.loads(c) for c in chunks[:-1]]
    text = "".join(b["choices"][0]["delta"].get("content") or "" for b in bodies if b["choices"])
    assert text == answer and len([b for b in bodies if b["choices"]]) > 3
    assert bodies[-1]["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]


def test_never_served_across_tenants_roles_prompt_versions_or_models(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the boiling point of water?"
    assert ask(server, keys["acme"], question).headers["x-cache"] == "miss"
    assert stored(server, question)
    assert ask(server, keys["acme"], question).headers["x-cache"] == "hit"
    for response in (
        ask(server, keys["zeta"], question),  # another tenant
        ask(server, keys["acme-support"], question),  # another role
        ask(server, keys["acme"], question, system="Answer in French."),  # another prompt version
        ask(server, keys["acme"], question, model=SECOND_MODEL),  # another model
        ask(server, keys["acme"], question, max_tokens=13),  # another answer-changing setting
    ):
        assert response.status_code == 200 and response.headers["x-cache"] == "miss", response.headers
    rows = stored(server, question, count=6)
    assert len(rows) == 6 and len({(r[1], r[2], r[3]) for r in rows}) == 4


def test_cache_control_and_uncacheable_requests(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "Why is the sky blue?"
    assert ask(server, keys["acme"], question, headers={"Cache-Control": "no-store"}).headers["x-cache"] == "miss"
    time.sleep(0.5)
    assert stored(server, question, timeout=0.5) == []  # no-store: nothing kept
    assert ask(server, keys["acme"], question).headers["x-cache"] == "miss"
    assert stored(server, question)
    assert ask(server, keys["acme"], question, headers={"Cache-Control": "no-cache"}).headers["x-cache"] == "bypass"
    assert ask(server, keys["acme"], question, temperature=1.0).headers["x-cache"] == "bypass"
    assert ask(server, keys["acme"], question, logprobs=True).headers["x-cache"] == "bypass"
    assert ask(server, keys["acme"], question).headers["x-cache"] == "hit"


def test_a_hit_outside_the_freshness_window_is_a_miss(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the speed of light?"
    ask(server, keys["acme"], question)
    (entry_id, *_), = stored(server, question)
    assert ask(server, keys["acme"], question).headers["x-cache"] == "hit"
    conn = db(server)
    conn.execute("UPDATE cache_entries SET created_at = created_at - 8 * 86400 WHERE id = ?", (entry_id,))  # past 7 days
    conn.close()
    late = ask(server, keys["acme"], question)
    assert late.headers["x-cache"] == "miss" and late.headers["x-cache-reason"] == "stale"


def test_a_rejected_answer_is_never_served_again(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "How many legs does a spider have?"
    ask(server, keys["acme"], question)
    assert stored(server, question)
    hit = ask(server, keys["acme2"], question)
    assert hit.headers["x-cache"] == "hit"
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=keys["zeta"], max_retries=0)
    response = httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": hit.json()["id"], "rating": "bad"},
                          headers={"Authorization": f"Bearer {keys['zeta']}"})
    assert response.status_code == 404  # another tenant cannot judge acme's answers
    del c
    response = httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": hit.json()["id"], "rating": "bad"},
                          headers={"Authorization": f"Bearer {keys['acme2']}"})
    assert response.status_code == 200 and response.json()["was_hit"] is True
    for _ in range(2):
        again = ask(server, keys["acme"], question)
        assert again.headers["x-cache"] == "miss" and again.headers["x-cache-reason"] == "rejected"
    assert stored(server, question)[0][4] == "rejected"
    bad = httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": hit.json()["id"], "rating": "meh"},
                     headers={"Authorization": f"Bearer {keys['acme2']}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rating"
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "appliance_cache_false_hits_total 1.0" in metrics


def test_good_feedback_verifies_and_counts_in_the_cost_weighted_rate(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is photosynthesis?"
    miss = ask(server, keys["acme"], question)
    assert stored(server, question)
    ok = httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": miss.json()["id"], "rating": "good"},
                    headers={"Authorization": f"Bearer {keys['acme']}"})
    assert ok.status_code == 200 and ok.json()["was_hit"] is False
    hit = ask(server, keys["acme"], "Explain photosynthesis")
    assert hit.headers["x-cache"] == "hit" and hit.headers["x-cache-state"] == "verified"
    stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {keys['admin']}"}).json()
    rate = stats["since_start"]["cost_weighted_verified_hit_rate"]
    assert rate is not None and 0 < rate < 1
    assert any(b["verified"] >= 1 for b in stats["buckets"])
    found = httpx.get(f"{server.base_url}/admin/cache/entries", params={"q": "photosynthesis"},
                      headers={"Authorization": f"Bearer {keys['admin']}"}).json()["entries"]
    assert found and found[0]["state"] == "verified"


def test_a_sweep_marks_a_changed_answer_stale_and_the_next_miss_replaces_it(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the largest ocean on Earth?"
    original = ask(server, keys["zeta"], question).json()["choices"][0]["message"]["content"]
    (entry_id, *_), = stored(server, question)
    conn = db(server)
    conn.execute("UPDATE cache_entries SET answer = 'Bananas are yellow and grow in bunches.', hits = 1000 WHERE id = ?", (entry_id,))
    conn.close()
    result = httpx.post(f"{server.base_url}/admin/cache/sweep", params={"limit": 1},
                        headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=120).json()
    assert result["checked"] == 1 and result["drifted"] == 1
    assert db(server).execute("SELECT state FROM cache_entries WHERE id = ?", (entry_id,)).fetchone()[0] == "stale"
    replaced = ask(server, keys["zeta"], question)
    assert replaced.headers["x-cache"] == "miss"
    time.sleep(0.5)
    state, answer = db(server).execute("SELECT state, answer FROM cache_entries WHERE id = ?", (entry_id,)).fetchone()
    assert state == "unverified" and answer == original
    agreed = httpx.post(f"{server.base_url}/admin/cache/sweep", params={"limit": 1},
                        headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=120).json()
    assert agreed["agreed"] == 1  # the model still says the same: consistent, which verifies nothing
    assert db(server).execute("SELECT state FROM cache_entries WHERE id = ?", (entry_id,)).fetchone()[0] == "consistent"
    served = ask(server, keys["zeta"], question)
    assert served.headers["x-cache"] == "hit" and served.headers["x-cache-state"] == "consistent"
    stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=30).json()
    assert any(b["consistent"] >= 1 for b in stats["buckets"])
    saved = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert 'appliance_cache_saved_usd_total{state="consistent"}' in saved  # counted apart from verified hits


def test_a_request_that_sets_no_temperature_is_served_from_the_cache(cached: tuple[Server, dict[str, str]]) -> None:
    # Most clients set no temperature: they leave sampling to the server ([defaults] temperature, 1.0 here,
    # above max_temperature) and ask for its usual answer, so the cache may serve them; one that sets a
    # hot temperature still bypasses it.
    server, keys = cached
    question = "Which ocean is the largest?"
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12}

    def send(**extra: object) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, **extra},
                          headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=120)

    first = send()
    assert first.headers["x-cache"] == "miss"
    assert stored(server, question)
    again = send()
    assert again.headers["x-cache"] == "hit" and again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert send(temperature=1.0).headers["x-cache"] == "bypass"


def test_concurrent_identical_misses_store_one_entry(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the tallest animal?"

    async def crowd() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}
            responses = await asyncio.gather(*(client.post(f"{server.base_url}/v1/chat/completions", json=body,
                                                            headers={"Authorization": f"Bearer {keys['acme']}"}) for _ in range(6)))
            return [r.headers["x-cache"] for r in responses]

    results = asyncio.run(crowd())
    assert all(r in ("miss", "hit") for r in results)
    time.sleep(0.5)
    assert len(stored(server, question)) == 1


def test_a_hit_passes_the_budget_and_costs_nothing_without_a_judge(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What does HTTP stand for?"
    ask(server, keys["acme"], question)
    assert stored(server, question)
    hit = ask(server, keys["acme"], question)
    assert hit.headers["x-cache"] == "hit"
    settled = eventually(server, "SELECT outcome, charged_nanos FROM settlements WHERE request_id = ?", hit.json()["id"])
    assert settled == ("cache_hit", 0)
    logged = eventually(server, "SELECT status, cost_nanos, tenant FROM request_log WHERE id = ?", hit.json()["id"])
    assert logged == ("cache_hit", 0, "acme")
    with pytest.raises(openai.AuthenticationError):  # a hit still needs a key
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="apl-wrong", max_retries=0).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0)


def test_invalidating_a_tenant_stops_its_hits(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the chemical symbol for gold?"
    ask(server, keys["zeta"], question)
    assert stored(server, question)
    assert ask(server, keys["zeta"], question).headers["x-cache"] == "hit"
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    assert httpx.post(f"{server.base_url}/admin/cache/invalidate", json={}, headers=admin).status_code == 400
    assert httpx.post(f"{server.base_url}/admin/cache/invalidate", json={"tenant": "zeta"}, headers=admin).json()["invalidated"] >= 1
    assert ask(server, keys["zeta"], question).headers["x-cache"] == "miss"
    assert httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {keys['zeta']}"}).status_code == 403


def test_an_embedding_model_of_the_fleet_can_be_the_embedder(tmp_path) -> None:
    config = config_text(embeddings=True, cache='enabled = true\nsweep_interval_s = 0\nembedder = "smollm2-135m-embed"')
    server = start_server(tmp_path / "engine-embedder", config)
    try:
        first = ask(server, "unused", QUESTION)
        assert first.headers["x-cache"] == "miss"
        assert stored(server, QUESTION)
        assert ask(server, "unused", QUESTION).headers["x-cache"] == "hit"
        tables = [r[0] for r in db(server).execute("SELECT name FROM sqlite_master WHERE name LIKE 'cache_vectors_engine%'")]
        assert tables, "the vectors live in the engine embedder's own space"
    finally:
        stop_server(server)


def test_the_multilingual_embedder_ships_with_its_bound_ready(tmp_path) -> None:
    """`embedder = "e5-small"`: its vectors in a space of their own, every language's cut open at start
    from the cosines the shipped traps carry (nothing measured), and a Portuguese question typed again
    without accents served, while its negation is not."""
    config = config_text(embeddings=False, cache='enabled = true\nsweep_interval_s = 0\nembedder = "e5-small"\nsimilarity_threshold = 0.86')
    server = start_server(tmp_path / "e5", config)
    try:
        bounds = httpx.get(f"{server.base_url}/admin/cache").json()["false_hit_bound"]
        assert all(bounds[lang]["open"] and bounds[lang]["upper"] <= 0.02 for lang in ("en", "pt", "es", "de"))
        question = "Como faço para desbloquear o cartão de crédito no aplicativo?"
        assert ask(server, "unused", question).headers["x-cache"] == "miss"
        assert stored(server, question)
        again = ask(server, "unused", "como faco para desbloquear o cartao de credito no aplicativo")
        assert again.headers["x-cache"] == "hit", again.headers.get("x-cache-reason")
        assert ask(server, "unused", "Como faço para bloquear o cartão de crédito no aplicativo?").headers["x-cache"] == "miss"
        tables = [r[0] for r in db(server).execute("SELECT name FROM sqlite_master WHERE name LIKE 'cache_vectors_multilingual%'")]
        assert tables, "the vectors live in the E5 embedder's own space"
    finally:
        stop_server(server)


def test_the_metrics_carry_the_cost_weighted_rate_on_verified_answers(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    question = "What is the tallest tree species?"
    miss = ask(server, keys["zeta"], question)
    assert stored(server, question)
    httpx.post(f"{server.base_url}/v1/cache/feedback", json={"response_id": miss.json()["id"], "rating": "good"},
               headers={"Authorization": f"Bearer {keys['zeta']}"}).raise_for_status()
    assert ask(server, keys["zeta"], question).headers["x-cache-state"] == "verified"
    scraped = httpx.get(f"{server.base_url}/metrics").text
    gauge = float(re.search(r"^appliance_cache_cost_weighted_verified_hit_rate (\S+)$", scraped, re.MULTILINE).group(1))  # type: ignore[union-attr]
    saved = float(re.search(r'^appliance_cache_saved_usd_total\{state="verified"\} (\S+)$', scraped, re.MULTILINE).group(1))  # type: ignore[union-attr]
    cost = float(re.search(r"^appliance_cache_request_cost_usd_total (\S+)$", scraped, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert 0 < gauge < 1 and gauge == pytest.approx(saved / cost)
    stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {keys['admin']}"}).json()
    assert stats["since_start"]["cost_weighted_verified_hit_rate"] == pytest.approx(gauge)


def test_an_answer_that_meets_the_callers_json_schema_is_stored_verified_by_that_validator(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
    question = "Name the capital of Chile as JSON."
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    first = ask(server, keys["zeta"], question, response_format=fmt, max_tokens=40)
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    assert stored(server, question)
    row = db(server).execute("SELECT state, state_reason FROM cache_entries WHERE question = ?", (question,)).fetchone()
    assert row == ("verified", "validator:json_schema")
    plain = "Name the capital of Chile in one word."
    ask(server, keys["zeta"], plain)
    assert stored(server, plain)
    assert db(server).execute("SELECT state, state_reason FROM cache_entries WHERE question = ?", (plain,)).fetchone() == ("unverified", None)


def test_the_cache_shows_its_false_hit_bound_and_its_own_estimate_by_language(cached: tuple[Server, dict[str, str]]) -> None:
    server, keys = cached
    scraped = httpx.get(f"{server.base_url}/metrics").text

    def gauge(name: str, language: str) -> float:
        return float(re.search(rf'^{name}\{{language="{language}"\}} (\S+)$', scraped, re.MULTILINE).group(1))  # type: ignore[union-attr]

    stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {keys['admin']}"}).json()["false_hit_bound"]
    for language in ("en", "pt", "es", "de"):
        row = stats[language]
        assert row["bound"] == gauge("appliance_cache_false_hit_bound", language) == 0.02
        assert row["estimate"] == pytest.approx(gauge("appliance_cache_false_hit_estimate", language))
        assert row["upper"] == pytest.approx(gauge("appliance_cache_false_hit_upper", language))
        assert row["estimate"] <= row["upper"] <= 0.02
        assert row["traps"] >= 150 and row["open"]
    assert stats["en"]["traps"] >= 400 and stats["pt"]["traps"] >= 400


def test_an_operator_opens_a_language_with_labelled_near_misses(tmp_path) -> None:
    """At a 1% bound German starts with too few known traps (exact repeats only); 150 labelled German
    near misses from an operator open it. The same pair twice counts once; bad input is a 400."""
    config = config_text(embeddings=False, auth="keys", cache="enabled = true\nsweep_interval_s = 0\nmax_false_hit_rate = 0.01")
    config = config.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\nkey_cache_s = 0.5\n')
    server = start_server(tmp_path / "traps", config)
    try:
        admin, caller = new_key(server, "ops", user="root", admin=True), new_key(server, "acme")

        def post(body: object, key: str = admin) -> httpx.Response:
            return httpx.post(f"{server.base_url}/admin/cache/traps", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)

        stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {admin}"}).json()["false_hit_bound"]
        assert not stats["de"]["open"] and stats["de"]["traps"] < 299
        products = ["Girokonto", "Kreditkarte", "Handyvertrag", "Stromtarif", "Reiseversicherung", "Bausparvertrag", "Mietvertrag",
                    "Fitnessstudio", "Zeitungsabo", "Streamingdienst"]
        pairs = [{"cached": f"Wie kündige ich meinen {p} nach {n} Monaten?", "asked": f"Wie kündige ich meinen {p} nach {n + 1} Monaten?"}
                 for p in products for n in range(1, 16)]
        added = post({"pairs": pairs})
        assert added.status_code == 200, added.text
        assert added.json()["added"] == 150
        german = added.json()["false_hit_bound"]["de"]
        assert german["open"] and german["traps"] >= 299 and german["upper"] <= 0.01
        assert post({"pairs": pairs[:10]}).json()["added"] == 0  # known already
        assert post({"pairs": pairs[:3], "tenant": "acme"}).json()["added"] == 3  # one tenant's own
        for body, param in (({"pairs": [{"cached": "Wie spät ist es?", "asked": "Wie spät ist es?"}]}, "pairs[0]"),
                            ({"pairs": []}, None), ({"pairs": [{"cached": "x" * 2001, "asked": "y"}]}, None),
                            ({"pairs": [{"cached": "a", "asked": "b", "label": "miss"}]}, None)):
            refused = post(body)
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", refused.text
            assert param is None or refused.json()["error"]["param"] == param
        assert post({"pairs": pairs[:1]}, caller).status_code == 403
        stop_server(server)
        server = start_server(tmp_path / "traps", config)  # the labelled traps outlive a restart
        stats = httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {admin}"}).json()["false_hit_bound"]
        assert stats["de"]["open"] and stats["de"]["traps"] >= 299
        # ... scored from the cosines kept when they were added: the start embeds none of them again.
        assert "cache: 153 labelled traps scored, 0 of them embedded now" in server.log.read_text()
    finally:
        stop_server(server)


def test_the_judge_decides_the_band_through_the_server_and_never_overrides_a_guard(tmp_path) -> None:
    """The bundled SmolLM2 as the judge; a threshold no rewording reaches, so every reworded lookup
    in the band asks it, and a cut-off of 0 so its answer always lets the hit through."""
    cache = (f'enabled = true\nsweep_interval_s = 0\nsimilarity_threshold = 0.99\njudge_band = 0.3\nmax_false_hit_rate = 0\njudge_model = "{CHAT_MODEL}"\n'
             "judge_min_probability = 0.0")
    # Prompts free, output paid: a stored 12-token answer is worth more than the judge's one-token answer,
    # so asking is worth it (test_the_judge_is_not_asked_where_it_costs_more_than_the_answer_it_could_save).
    server = start_server(tmp_path / "judged", config_text(embeddings=False, price_in=0.0, price_out=2.0, cache=cache))
    try:
        def judge_calls() -> float:
            found = re.search(r"^appliance_cache_judge_calls_total (\S+)$", httpx.get(f"{server.base_url}/metrics").text, re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        first = ask(server, "unused", QUESTION)
        assert first.headers["x-cache"] == "miss" and stored(server, QUESTION)
        trap = ask(server, "unused", "How do I not reset my password?")  # in the band, but a guard says no
        assert trap.headers["x-cache"] == "miss" and trap.headers["x-cache-reason"] == "guard:negation" and judge_calls() == 0
        judged = ask(server, "unused", "I forgot my password, how can I set a new one?")  # words differ: the full threshold
        assert judged.headers["x-cache"] == "hit" and float(judged.headers["x-cache-similarity"]) < 0.99
        assert judged.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
        assert judge_calls() == 1
        # the hit costs the judge's call: its prompt and one token at the judge model's prices
        logged = eventually(server, "SELECT status, cost_nanos FROM request_log WHERE id = ?", judged.json()["id"])
        assert logged is not None and logged[0] == "cache_hit" and logged[1] > 0
        assert eventually(server, "SELECT judged FROM cache_hits WHERE response_id = ?", judged.json()["id"]) == (1,)
    finally:
        stop_server(server)


def test_a_judged_miss_pays_for_the_judge(tmp_path) -> None:
    """A cut-off the judge never reaches: the reworded lookup asks it, misses, and the judge's tokens
    are settled apart from the model call that answers (they were charged to no one before)."""
    cache = (f'enabled = true\nsweep_interval_s = 0\nsimilarity_threshold = 0.99\njudge_band = 0.3\nmax_false_hit_rate = 0\njudge_model = "{CHAT_MODEL}"\n'
             "judge_min_probability = 1.0")
    # prompts free, output paid: the judge's call costs less than the stored answer, so it is asked (and charged)
    server = start_server(tmp_path / "judged-miss", config_text(embeddings=False, price_in=0.0, price_out=2.0, cache=cache))
    try:
        ask(server, "unused", QUESTION)
        assert stored(server, QUESTION)
        missed = ask(server, "unused", "I forgot my password, how can I set a new one?")
        assert missed.headers["x-cache"] == "miss"
        judge = eventually(server, "SELECT outcome, prompt_tokens, completion_tokens, charged_nanos FROM settlements WHERE request_id = ?",
                           f"{missed.json()['id']}.judge")
        assert judge is not None and judge[0] == "cache_judge" and judge[1] > 0 and judge[2] == 1 and judge[3] > 0
        call = eventually(server, "SELECT outcome, completion_tokens FROM settlements WHERE request_id = ?", missed.json()["id"])
        assert call is not None and call[1] == missed.json()["usage"]["completion_tokens"]
    finally:
        stop_server(server)


def test_under_a_bound_the_judge_answers_the_known_traps_then_decides_with_its_own_cut(tmp_path) -> None:
    """The bundled SmolLM2 as the judge under a 20% bound. French starts with no traps (exact repeats
    only); an operator labels 30 French near misses; the judge answers them in the background (a
    language with few unanswered traps first) and French gets two cuts. A French rewording the
    embedder's cut refuses then goes to the judge, and its answer against the judge's cut decides.
    The answers outlive a restart: the judge is not asked about a trap twice. A pair too long for the
    judge's context stays unanswered (counted as served) and the others are answered all the same."""
    cache = f'enabled = true\nsweep_interval_s = 0\nmax_false_hit_rate = 0.2\njudge_band = 0.3\njudge_model = "{CHAT_MODEL}"\n'
    # prompts free, output paid: the judge's call costs less than a stored answer, so lookups ask it
    config = config_text(embeddings=False, auth="keys", price_in=0.0, price_out=2.0, cache=cache, context_length=1024)
    config = config.replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n', '[auth]\nmode = "keys"\nkey_cache_s = 0.5\n')
    server = start_server(tmp_path / "judge-bound", config)
    try:
        admin, caller = new_key(server, "ops", user="root", admin=True), new_key(server, "acme")

        def french() -> dict:
            return httpx.get(f"{server.base_url}/admin/cache", headers={"Authorization": f"Bearer {admin}"}).json()["false_hit_bound"]["fr"]

        def judge_calls() -> float:
            found = re.search(r"^appliance_cache_judge_calls_total (\S+)$", httpx.get(f"{server.base_url}/metrics").text, re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        # Reworded as well as changed, so that no guard refuses them: the judge's band (a word swapped alone is refused).
        things = ["mon abonnement", "ma carte bancaire", "mon forfait mobile", "mon contrat d'électricité", "mon assurance habitation",
                  "mon compte épargne"]
        verbs = [("résilier", "suspendre"), ("ouvrir", "fermer"), ("payer", "rembourser"), ("modifier", "transférer"), ("activer", "bloquer")]
        pairs = [{"cached": f"Comment {a} {t} ?", "asked": f"Je voudrais {b} {t}, comment faire ?"} for t in things for a, b in verbs]
        filler = " zqxjk" * 310  # over 1,024 tokens, both questions together
        pairs.append({"cached": f"Comment résilier mon contrat ?{filler}", "asked": f"Je voudrais suspendre mon contrat, comment faire ?{filler}"})
        added = httpx.post(f"{server.base_url}/admin/cache/traps", json={"pairs": pairs}, headers={"Authorization": f"Bearer {admin}"},
                           timeout=120)
        assert added.status_code == 200, added.text
        deadline = time.monotonic() + 240
        while (row := french())["judge"]["traps_asked"] < row["judge"]["traps_in_band"] - 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert row["judge"]["traps_in_band"] >= 26 and row["judge"]["traps_asked"] == row["judge"]["traps_in_band"] - 1, row
        assert "the judge cannot answer a known trap" in server.log.read_text()
        cut = row["judge"]["cut"]
        assert cut is not None and row["upper"] <= 0.2 and row["traps"] >= 30
        asked_traps = db(server).execute("SELECT count(*) FROM cache_judgements").fetchone()[0]
        assert asked_traps >= row["judge"]["traps_in_band"]

        question = "Comment puis-je résilier mon abonnement à la salle de sport ?"
        assert ask(server, caller, question).headers["x-cache"] == "miss" and stored(server, question)
        before = judge_calls()
        # cosine 0.56: under the embedder's threshold, in the judge's band
        reworded = ask(server, caller, "Je veux mettre fin à mon inscription au club de gym, je fais comment ?")
        assert judge_calls() == before + 1, reworded.headers
        if reworded.headers["x-cache"] == "hit":
            probability = eventually(server, "SELECT judge FROM cache_hits WHERE response_id = ?", reworded.json()["id"])
            assert probability is not None and probability[0] > cut
        else:
            reason = reworded.headers["x-cache-reason"]
            assert reason.startswith("judge:") and float(reason.removeprefix("judge:")) <= cut + 0.005, (reason, cut)

        stop_server(server)
        server = start_server(tmp_path / "judge-bound", config)
        assert french()["judge"]["cut"] == cut  # the kept answers: French's judge cut is back at once
    finally:
        stop_server(server)


def test_the_judge_is_not_asked_where_it_costs_more_than_the_answer_it_could_save(tmp_path) -> None:
    """The judge is the answering model at its price: its prompt (about 90 tokens) costs more than a stored
    12-token answer did, so a reworded question in the band misses without asking it, and says why."""
    cache = (f'enabled = true\nsweep_interval_s = 0\nsimilarity_threshold = 0.99\njudge_band = 0.3\nmax_false_hit_rate = 0\njudge_model = "{CHAT_MODEL}"\n'
             "judge_min_probability = 0.0")
    server = start_server(tmp_path / "dearer", config_text(embeddings=False, price_in=1.0, price_out=2.0, cache=cache))
    try:
        first = ask(server, "unused", QUESTION)
        assert first.headers["x-cache"] == "miss" and stored(server, QUESTION)
        stored_cost = db(server).execute("SELECT cost_nanos FROM cache_entries").fetchone()[0]
        assert 0 < stored_cost < 90 * 1000  # under the judge's prompt at $1 a million tokens
        reworded = ask(server, "unused", "I forgot my password, how can I set a new one?")
        assert reworded.headers["x-cache"] == "miss" and reworded.headers["x-cache-reason"] == "judge:dearer", reworded.headers
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert not re.search(r"^appliance_cache_judge_calls_total [1-9]", metrics, re.MULTILINE)
    finally:
        stop_server(server)
