"""Response headers clients read (`x-request-id`, `x-ratelimit-*`) and traces that join the
caller's: the pure pieces, then one real server with keys, limits and an OTLP collector, asked
through the official SDK and httpx."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import apsw
import httpx
import openai
import pytest

from policy.identity import Principal
from policy.limits import LimitRule, LimitState, RateLimiter
from policy.rate_headers import duration_text, rate_limit_headers, tightest
from tests.conftest import CHAT_MODEL, EMBED_MODEL, Server, config_text, start_server, stop_server
from tests.test_gate_api import new_key
from tests.test_tracing import SERVER, Collector

# -- the pure pieces -------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.02, "20ms"), (0.0004, "1ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"), (8.64, "8.64s"), (59.9991, "1m0s"),
    (360, "6m0s"), (90.25, "1m30.25s"), (3723.25, "1h2m3.25s"), (float("inf"), "24h0m0s"),
])
def test_resets_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_each_header_pair_reports_the_tightest_level() -> None:
    states = (
        LimitState("user", "ann", "requests", 10, 3.7, 12.0),
        LimitState("tenant", "acme", "requests", 100, 3.2, 1.0),  # as few left, but a looser limit
        LimitState("user", "ann", "tokens", 5000, 4000.0, 2.0),
        LimitState("tenant", "acme", "tokens", 1000, -20.0, 61.5),  # in debt: none remain
    )
    assert tightest(states, "requests") == states[0]
    assert rate_limit_headers(states) == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "12s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m1.5s",
    }
    assert rate_limit_headers(states[:2]).keys() == {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                                      "x-ratelimit-reset-requests"}
    assert rate_limit_headers(()) == {}


def test_the_limiter_reports_its_buckets_as_they_stand() -> None:
    ann = Principal("ann", "acme", "web", "dev", "key_1")
    limiter = RateLimiter((LimitRule("user", "*", 3, 1000), LimitRule("tenant", "acme", 100, None)))
    untouched = {(s.level, s.what): s for s in limiter.states(ann, 0.0)}
    assert untouched.keys() == {("user", "requests"), ("user", "tokens"), ("tenant", "requests")}
    assert untouched["user", "tokens"].remaining == 1000 and untouched["user", "tokens"].reset_s == 0
    assert limiter.admit(ann, 100, 0.0) is None
    assert rate_limit_headers(limiter.states(ann, 0.0)) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "20s",  # 3 a minute: one per 20 s
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "6s",
    }
    limiter.settle(ann, 100, 40, 3.0)  # 60 unused tokens come back; 3 s refilled 50 of the rest
    later = {(s.level, s.what): s for s in limiter.states(ann, 3.0)}
    assert later["user", "tokens"].remaining == pytest.approx(1000.0) and later["user", "requests"].remaining == pytest.approx(2.15)
    assert rate_limit_headers(limiter.states(ann, 3.0))["x-ratelimit-reset-requests"] == "17s"


# -- through the server ----------------------------------------------------------------------

LIMITS = """
[[limits]]
level = "user"
name = "rl-user"
requests_per_minute = 4
tokens_per_minute = 3000

[[limits]]
level = "tenant"
name = "rl"
requests_per_minute = 60
tokens_per_minute = 1000
"""
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?$|^(\d+)ms$")


def seconds(text: str) -> float:
    match = _DURATION.fullmatch(text)
    assert match, text
    h, m, s, ms = match.groups()
    return int(ms) / 1000 if ms else int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, str], Collector]]:
    collector = Collector()
    tracing = f'[tracing]\nenabled = true\notlp_endpoint = "http://127.0.0.1:{collector.port}/v1/traces"\nexport_interval_ms = 100\n'
    text = config_text(auth="keys", extra=tracing).replace('[auth]\nmode = "keys"\n\n[auth.open_principal]\nadmin = true\n',
                                                           '[auth]\nmode = "keys"\n')
    server = start_server(tmp_path_factory.mktemp("headers"), LIMITS + text)
    try:
        admin = new_key(server, "ops", user="root", admin=True)
        made = httpx.post(f"{server.base_url}/admin/keys", headers={"Authorization": f"Bearer {admin}"}, timeout=30,
                          json={"tenant": "rl", "app": "web", "user": "rl-user", "role": "dev"})
        assert made.status_code == 201, made.text
        yield server, {"admin": admin, "limited": made.json()["secret"]}, collector
    finally:
        stop_server(server)
        collector.close()


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _root(collector: Collector, request_id: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while not (found := [s for s in collector.spans if s["kind"] == SERVER and s["attributes"].get("appliance.request.id") == request_id]):
        assert time.monotonic() < deadline, f"no server span for {request_id}: {[s['name'] for s in collector.spans]}"
        time.sleep(0.05)
    return found[0]


HELLO = [{"role": "user", "content": "Name a colour."}]


def test_every_response_names_its_request(served: tuple[Server, dict[str, str], Collector]) -> None:
    server, keys, collector = served
    client = _client(server, keys["admin"])
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                                           extra_headers={"X-Request-Id": "mine-1", "X-Client-Request-Id": "client-7"})
    completion = raw.parse()
    # The SDK's `_request_id` is ours, the body's id, never the caller's own.
    assert completion._request_id == raw.headers["x-request-id"] == completion.id and completion.id.startswith("chatcmpl-")
    root = _root(collector, completion.id)
    assert root["attributes"]["appliance.client_request_id"] == "client-7"
    logged = apsw.Connection(str(server.home / "appliance.db"), flags=apsw.SQLITE_OPEN_READONLY)
    deadline = time.monotonic() + 10
    while logged.execute("SELECT count(*) FROM request_log WHERE id = ?", (completion.id,)).fetchone()[0] == 0:
        assert time.monotonic() < deadline, "not in the request log"
        time.sleep(0.05)
    with client.chat.completions.with_streaming_response.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, stream=True,  # type: ignore[arg-type]
                                                                temperature=0) as streamed:
        chunk_ids = {chunk.id for chunk in streamed.parse()}
        assert chunk_ids == {streamed.headers["x-request-id"]}
    embedded = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input="a colour")
    assert embedded.headers["x-request-id"].startswith("emb-")
    _root(collector, embedded.headers["x-request-id"])
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
    failed = _root(collector, caught.value.request_id or "")
    assert caught.value.request_id.startswith("chatcmpl-") and failed["error"]  # type: ignore[union-attr]
    assert f"(request {caught.value.request_id})" in server.log.read_text()  # the operator's log line names it too
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(server, "apl-wrong").models.list()
    other = httpx.get(f"{server.base_url}/v1/nowhere", timeout=10)
    ids = {refused.value.request_id, other.headers["x-request-id"], client.models.with_raw_response.list().headers["x-request-id"]}
    assert len(ids) == 3 and all(re.fullmatch(r"req_[0-9a-f]{32}", i or "") for i in ids)
    # Nobody here has a rate limit: no rate-limit headers.
    assert not any(h.startswith("x-ratelimit") for h in raw.headers)


def test_rate_limit_headers_count_down_and_come_with_a_429(served: tuple[Server, dict[str, str], Collector]) -> None:
    server, keys, _ = served
    client = _client(server, keys["limited"])
    before = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=HELLO, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    took = time.monotonic() - before
    usage = raw.parse().usage
    assert usage is not None
    h = raw.headers
    # Requests: the user's 4 a minute is tighter than the tenant's 60; tokens: the tenant's 1,000 than the user's 3,000.
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("4", "3")
    assert 60 / 4 - took - 1 < seconds(h["x-ratelimit-reset-requests"]) <= 60 / 4
    assert h["x-ratelimit-limit-tokens"] == "1000"
    # Settled before the answer was sent: the actual tokens are charged, not the estimate; the bucket refills at 1000/60 a second.
    remaining = int(h["x-ratelimit-remaining-tokens"])
    assert 1000 - usage.total_tokens <= remaining <= 1000 - usage.total_tokens + 1000 / 60 * (took + 1)
    assert seconds(h["x-ratelimit-reset-tokens"]) == pytest.approx((1000 - remaining) * 60 / 1000, abs=1.1)
    with client.chat.completions.with_streaming_response.create(model=CHAT_MODEL, messages=HELLO, max_tokens=1, stream=True) as streamed:  # type: ignore[arg-type]
        assert streamed.headers["x-ratelimit-remaining-requests"] == "2"
        list(streamed.parse())
    for left in ("1", "0"):
        assert client.chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=HELLO, max_tokens=1).headers["x-ratelimit-remaining-requests"] == left  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    refused = caught.value.response.headers
    assert caught.value.code == "rate_limit_exceeded" and refused["x-request-id"] == caught.value.request_id
    assert refused["x-ratelimit-limit-requests"] == "4" and refused["x-ratelimit-remaining-requests"] == "0"
    assert 0 < seconds(refused["x-ratelimit-reset-requests"]) <= 60 and int(refused["retry-after"]) >= 1
    assert refused["x-ratelimit-limit-tokens"] == "1000"


def test_a_callers_trace_context_is_linked_to_the_servers_trace(served: tuple[Server, dict[str, str], Collector]) -> None:
    """With keys, a trace id is the caller's word and may be another tenant's: the server's trace
    is its own, linked to the caller's span (open mode joins it: tests/test_tracing.py)."""
    server, keys, collector = served
    client = _client(server, keys["admin"])
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=HELLO, max_tokens=5, temperature=0.5, top_p=0.9, seed=11,  # type: ignore[arg-type]
        extra_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
    completion = raw.parse()
    own = raw.headers["x-trace-id"]
    assert own != trace_id and len(own) == 32
    root = _root(collector, completion.id)
    assert (root["trace"], root["parent"], root["links"], root["name"]) == (own, "", [(trace_id, span_id)], f"chat {CHAT_MODEL}")
    assert (root["attributes"]["appliance.caller.trace_id"], root["attributes"]["appliance.caller.span_id"]) == (trace_id, span_id)
    assert completion.usage is not None
    attributes = root["attributes"]
    assert {k: v for k, v in attributes.items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "appliance", "gen_ai.request.model": CHAT_MODEL,
        "gen_ai.request.max_tokens": 5, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9, "gen_ai.request.seed": 11,
        "gen_ai.response.id": completion.id, "gen_ai.response.model": completion.model,
        "gen_ai.response.finish_reasons": [completion.choices[0].finish_reason],
        "gen_ai.usage.input_tokens": completion.usage.prompt_tokens, "gen_ai.usage.output_tokens": completion.usage.completion_tokens,
    }
    assert all(k.startswith(("gen_ai.", "appliance.", "http.", "error.")) for k in attributes), attributes
    children = [s for s in collector.spans if s["parent"] == root["id"]]
    assert children and all(s["trace"] == own for s in children)
    assert not any(k.startswith("gen_ai.") for s in children for k in s["attributes"])  # one GenAI span per request
    # The stored copy: the server's own trace, the caller's span in its attributes; the caller's trace id stores nothing.
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    deadline = time.monotonic() + 15
    while True:  # children are stored before their root ends: wait for the whole tree
        stored = httpx.get(f"{server.base_url}/admin/traces/{own}", headers=admin, timeout=10)
        if stored.status_code == 200 and [s["name"] for s in stored.json()["spans"]] == [f"chat {CHAT_MODEL}"]:
            break
        assert time.monotonic() < deadline, stored.text
        time.sleep(0.1)
    (top,) = stored.json()["spans"]
    assert top["remote_parent_id"] is None and top["attributes"]["appliance.caller.span_id"] == span_id
    assert httpx.get(f"{server.base_url}/admin/traces/{trace_id}", headers=admin, timeout=10).status_code == 404
    listed = httpx.get(f"{server.base_url}/admin/traces", headers=admin, params={"name": f"chat {CHAT_MODEL}"}, timeout=10).json()
    assert any(t["trace_id"] == own for t in listed["traces"])
    # A caller that does not sample its trace does not switch ours off; a malformed traceparent is no link.
    unsampled = client.completions.with_raw_response.create(model=CHAT_MODEL, prompt="Colours:", max_tokens=3, n=2,  # type: ignore[arg-type]
                                                            extra_headers={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"})
    text = unsampled.parse()
    text_root = _root(collector, text.id)
    assert (text_root["trace"], text_root["links"], text_root["name"]) == (unsampled.headers["x-trace-id"], [("ab" * 16, "cd" * 8)],
                                                                          f"text_completion {CHAT_MODEL}")
    assert text_root["attributes"]["gen_ai.operation.name"] == "text_completion"
    # n choices: every choice's finish reason, the usage of them all.
    assert text_root["attributes"]["gen_ai.request.choice.count"] == 2
    assert text_root["attributes"]["gen_ai.response.finish_reasons"] == [c.finish_reason for c in text.choices]
    assert text.usage is not None and text_root["attributes"]["gen_ai.usage.output_tokens"] == text.usage.completion_tokens
    bad = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input="x", extra_headers={"traceparent": "00-zz-yy-01"})
    embedded = _root(collector, bad.headers["x-request-id"])
    assert embedded["parent"] == "" and embedded["links"] == [] and embedded["trace"] == bad.headers["x-trace-id"] != trace_id
    assert embedded["name"] == f"embeddings {EMBED_MODEL}" and embedded["attributes"]["gen_ai.usage.input_tokens"] == bad.parse().usage.prompt_tokens


def test_a_refusal_is_an_error_span_with_its_type(served: tuple[Server, dict[str, str], Collector]) -> None:
    server, keys, collector = served
    with pytest.raises(openai.BadRequestError) as caught:
        _client(server, keys["admin"]).chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, temperature=9)  # type: ignore[arg-type]
    root = _root(collector, caught.value.request_id or "")
    assert root["error"] and root["attributes"]["http.response.status_code"] == 400
    assert root["attributes"]["error.type"] == (caught.value.code or "invalid_request_error")
