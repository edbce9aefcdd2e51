"""Hostile clients, round three (issue 40): an abandoned embedding request, a trace id of another
tenant, a flood of failed sign-ins, adapters sent to a route. Against the real server in keys mode
over real HTTP, as tests/test_hostile.py."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import httpx
import pytest

from appliance.prompt.tool_calls import StreamParser, Tool, ToolPlan, parse
from appliance.store.keys import OTHER_CLIENTS, FailureTally, KeyStore, count_failures, create_tables
from policy.programs import PROMPT as PROGRAM_PROMPT
from tests.conftest import CHAT_MODEL, EMBED_MODEL, Server, config_text, start_server, stop_server
from tests.scripted_upstream import ScriptedUpstream
from tests.test_gate_api import admin_call, new_key
from tests.test_hostile import assert_refused, call, chat, database, hostile_config

ROUTE = f"""
[[routes]]
alias = "auto"
tiers = ["{CHAT_MODEL}"]
"""


@pytest.fixture(scope="module")
def misc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    server = start_server(tmp_path_factory.mktemp("hostile-misc"), hostile_config() + ROUTE)
    keys = {"admin": new_key(server, "ops", user="root", admin=True), "bob": new_key(server, "victims", user="bob"),
            "eve": new_key(server, "rivals", user="eve")}
    yield {"server": server, **keys}
    stop_server(server)


def embed_stats(server: Server) -> dict[str, Any]:
    return server.health()["models"][EMBED_MODEL]


def _embed(server: Server, key: str, inputs: Any) -> float:
    started = time.monotonic()
    answered = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": EMBED_MODEL, "input": inputs},
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert answered.status_code == 200, answered.text
    return time.monotonic() - started


def test_an_abandoned_embedding_request_stops_and_never_starves_another_tenant(misc: dict[str, Any]) -> None:
    """Thousands of inputs (about 30 s of passes on the one-slot embedding model, however fast this
    machine is), the client gone after a second: meanwhile another tenant's one-word embedding is
    answered between its passes, and once the client is gone the model is idle within a pass or two."""
    server, admin, eve = misc["server"], misc["admin"], misc["eve"]
    text = "the quick brown fox jumps over the lazy dog " * 5  # about 50 tokens
    one = max(_embed(server, admin, [text]) for _ in range(2))  # a request of one pass, as this machine runs it now
    count = min(2048, max(50, int(30 / one)))
    bound = 3 * one + 2  # the pass in flight, then the next one's, and the request's own overhead
    body = json.dumps({"model": EMBED_MODEL, "input": [f"{i} {text}" for i in range(count)]}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {admin}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while embed_stats(server)["slots_busy"] == 0:  # the request counts as running while its passes run
            assert time.monotonic() < deadline, embed_stats(server)
            time.sleep(0.05)
        waited = _embed(server, eve, "word")
        assert waited < bound, (waited, one)
        assert embed_stats(server)["slots_busy"] == 1  # the big one is still running
    left = time.monotonic()
    server.wait_idle(EMBED_MODEL, timeout=bound)  # the client is gone: its request stops at its next pass
    stopped_in = time.monotonic() - left
    assert _embed(server, eve, "word") < bound
    print(f"{count} inputs (one pass {one:.2f} s); a probe waited {waited:.2f} s beside them; idle {stopped_in:.2f} s after the client left")


def test_a_trace_id_of_another_tenant_is_never_joined(misc: dict[str, Any]) -> None:
    """Eve names Bob's trace id in `traceparent`: her request gets a trace of its own, with Bob's
    context kept as a link and as attributes, and Bob's stored trace holds only Bob's spans."""
    server, admin, bob, eve = misc["server"], misc["admin"], misc["bob"], misc["eve"]
    first = call(server, bob, "/v1/chat/completions", chat())
    assert first.status_code == 200, first.text
    victim = first.headers["x-trace-id"]
    span = "00f067aa0ba902b7"
    second = call(server, eve, "/v1/chat/completions", chat(), headers={"traceparent": f"00-{victim}-{span}-01"})
    assert second.status_code == 200, second.text
    own = second.headers["x-trace-id"]
    assert own != victim and len(own) == 32
    deadline = time.monotonic() + 15
    while True:
        stored = admin_call(server, admin, "GET", f"/admin/traces/{own}")
        if stored.status_code == 200 and [r["name"] for r in stored.json()["spans"]] == [f"chat {CHAT_MODEL}"]:
            break  # children are stored before their root ends: the whole tree is in
        assert time.monotonic() < deadline, stored.text
        time.sleep(0.1)
    (root,) = stored.json()["spans"]
    assert root["attributes"]["appliance.tenant"] == "rivals"
    assert (root["attributes"]["appliance.caller.trace_id"], root["attributes"]["appliance.caller.span_id"]) == (victim, span)
    time.sleep(1)  # whatever else was exported has landed
    roots = admin_call(server, admin, "GET", f"/admin/traces/{victim}").json()["spans"]
    assert [r["attributes"].get("appliance.tenant") for r in roots] == ["victims"]
    assert database(server).execute("SELECT count(*) FROM spans WHERE trace_id = ? AND attributes LIKE '%rivals%'", (victim,)).fetchone()[0] == 0


def test_a_flood_of_failed_sign_ins_is_counted_in_a_few_rows(misc: dict[str, Any]) -> None:
    server, admin = misc["server"], misc["admin"]
    flood = 300
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for i in range(flood):
            refused = client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "x"}, headers={"Authorization": f"Bearer apl-wrong-{i}"})
            assert refused.status_code == 401
    failures = admin_call(server, admin, "GET", "/admin/auth/failures").json()["failures"]
    mine = [f for f in failures if f["path"] == "/v1/embeddings" and f["reason"] == "unknown"]
    assert sum(f["count"] for f in mine) == flood and len(mine) <= 2  # one row a minute (the flood may straddle two)
    assert all(f["fingerprint"] and f["last_at"] >= f["at"] for f in mine)
    rows = database(server).execute("SELECT count(*), sum(count) FROM auth_failures WHERE path = '/v1/embeddings'").fetchone()
    assert rows == (len(mine), flood)


def test_the_failure_table_is_capped_whatever_the_sources() -> None:
    db = apsw.Connection(":memory:")
    create_tables(db)
    count_failures(db)
    store = KeyStore(db)
    for minute in range(5):
        tally = FailureTally(room=50)
        for client in range(80):  # more sources than the tally has room for: the rest share one bucket
            tally.add(minute * 60.0 + client / 100, "unknown", None, f"fp{client}", f"10.0.0.{client}", "/v1/chat/completions")
        assert len(tally.counts) == 51
        store.record_failures(tally.take(), keep=120)
    assert db.execute("SELECT count(*) FROM auth_failures").fetchone()[0] == 120
    newest = db.execute("SELECT count, client FROM auth_failures WHERE client = ? ORDER BY id DESC LIMIT 1", (OTHER_CLIENTS,)).fetchone()
    assert newest == (30, OTHER_CLIENTS)
    # A second flush in the same minute adds to that minute's rows.
    tally = FailureTally(room=50)
    tally.add(4 * 60 + 30.0, "unknown", None, "fp0", "10.0.0.0", "/v1/chat/completions")
    store.record_failures(tally.take(), keep=120)
    assert db.execute("SELECT count, last_at FROM auth_failures WHERE client = '10.0.0.0' ORDER BY id DESC LIMIT 1").fetchone() == (2, 270.0)


def test_adapters_on_a_route_are_refused_as_documented(misc: dict[str, Any]) -> None:
    server, admin = misc["server"], misc["admin"]
    body = {**chat(model="auto"), "adapters": [{"name": "anything"}]}
    assert assert_refused(call(server, admin, "/v1/chat/completions", body))["param"] == "adapters"
    assert call(server, admin, "/v1/chat/completions", {**chat(model="auto"), "adapters": []}).status_code == 200


def _writer_config(upstream: ScriptedUpstream) -> str:
    """The bundled model's config with the scripted upstream served as the model "writer"."""
    return config_text(embeddings=False) + f"""
[[models]]
alias = "writer"
engine = "openai"
base_url = "{upstream.url}"
upstream_model = "anything"
health_interval_s = 0
"""


def test_a_program_past_the_evaluators_bounds_is_refused_and_the_request_answered_as_asked(tmp_path: Path) -> None:
    """A tier steered into writing 1,200 nested minus signs: the evaluator refuses the program (it
    raised RecursionError, a 500), and the request is answered the usual way."""
    program, answer = "```python\nanswer = " + "-" * 1200 + "1\n```", "The answer is 4."

    def script(body: dict[str, Any]) -> list[dict[str, Any]]:
        first = body["messages"][0]
        return [{"content": program if first["role"] == "system" and first["content"] == PROGRAM_PROMPT else answer}]

    upstream = ScriptedUpstream(script)
    config = _writer_config(upstream) + """
[[routes]]
alias = "sums"
tiers = ["writer"]
program_families = ["sums"]
"""
    server = start_server(tmp_path, config)
    try:
        body = {"model": "sums", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 50, "metadata": {"family": "sums"}}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers={"Cache-Control": "no-store"}, timeout=60)
        assert response.status_code == 200, response.text
        attempts = json.loads(response.headers["x-route-attempts"])
        assert attempts[0]["outcome"] == "program: nested more than 64 deep" and attempts[1]["outcome"] == "ok", attempts
        assert response.json()["choices"][0]["message"]["content"] == "The answer is 4."
    finally:
        stop_server(server)
        upstream.close()
        upstream.close()


def test_a_vanishing_temperature_answers_as_greedy_does(misc: dict[str, Any]) -> None:
    """1e-40 is a valid temperature whose scaled logits overflow float32: llama.cpp's chain then drew
    out of NaNs (a token the greedy one was not). Every sampler path must answer as temperature 0."""
    server, key = misc["server"], misc["bob"]

    def text(**sampling: Any) -> str:
        body = chat(max_tokens=12, messages=[{"role": "user", "content": "Write one sentence about the sea."}], **sampling)
        answered = call(server, key, "/v1/chat/completions", body, headers={"Cache-Control": "no-store"})
        assert answered.status_code == 200, answered.text
        return answered.json()["choices"][0]["message"]["content"]

    greedy = text(temperature=0)
    assert greedy
    for sampling in ({"temperature": 1e-40}, {"temperature": 1e-40, "top_p": 0.5}, {"temperature": 1e-40, "top_k": 40},
                     {"temperature": 5e-324, "top_p": 0.9, "top_k": 40, "seed": 3}):
        assert text(**sampling) == greedy, sampling


def test_the_multilingual_embedder_takes_any_text_a_caller_sends() -> None:
    """A lone surrogate (valid JSON, not UTF-8), a NUL and a question far past the model's window: each
    embeds, within the character bound, instead of raising or taking time in proportion to its length."""
    import numpy as np

    from appliance.fleet.embedders import E5_MAX_CHARS, bundled_e5

    embedder = bundled_e5()
    try:
        long = "Como faço para desbloquear o cartão? " * 2000
        started = time.perf_counter()
        rows = embedder.embed_now(["caf\ud800 aberto?", "a\x00b", long, long[:E5_MAX_CHARS]])
        assert time.perf_counter() - started < 5
        assert rows.shape == (4, embedder.dimension) and np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-4)
        assert float(rows[2] @ rows[3]) > 0.9999  # cut at the bound, not embedded in full
    finally:
        embedder.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_nested_past_pythons_recursion_limit_is_text_not_a_failure(tmp_path: Path, stream: bool) -> None:
    """A model steered into 3,000 brackets after a call marker: the JSON decoder raised RecursionError
    (not ValueError) in the tool parser, failing the answer; it is text that is not a call."""
    nested = "<tool_call>\n" + "[" * 3000

    upstream = ScriptedUpstream(lambda body: [{"content": nested}])
    config = _writer_config(upstream)
    server = start_server(tmp_path, config)
    try:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        body = {"model": "writer", "messages": [{"role": "user", "content": "Nest."}], "tools": [tool], "stream": stream}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text[:300]
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
            assert not any("error" in c for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            message = response.json()["choices"][0]["message"]
            text = message["content"]
            assert not message.get("tool_calls")
        assert text == nested
        turns = [{"role": "user", "content": "Nest."}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "messages": turns}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments", refused.text[:300]
    finally:
        stop_server(server)
        upstream.close()


def test_a_run_of_spaces_in_a_harmony_call_header_is_read_in_linear_time() -> None:
    """`to=functions.f` and 400 spaces took the header's pattern 7.6 s (O(n^4): four optional whitespace
    runs around optional parts); a model's 100,000 would have held its answer for ever. Read at the
    parser, since no model here writes gpt-oss's channels; streamed and whole."""
    plan = ToolPlan((Tool("f", "", {"type": "object"}),), format="harmony")
    text = "<|channel|>commentary to=functions.f" + " " * 100_000 + "x"
    started = time.monotonic()
    assert parse(text, plan).calls == ()
    parser = StreamParser(plan)
    streamed = [out for i in range(0, len(text), 64) for out in parser.feed(text[i:i + 64])] + parser.end()
    assert "".join(o for o in streamed if isinstance(o, str)) == text
    assert time.monotonic() - started < 5  # linear: about 0.05 s here
