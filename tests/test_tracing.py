"""Traces leave the real server over OTLP/HTTP: a small collector here decodes what arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest
from appliance.server.tracing import attribute_name, request_attributes
from tests.conftest import CHAT_MODEL, config_text, free_port, start_server, stop_server

SERVER = 2  # OTLP's SPAN_KIND_SERVER: a request's span


def _value(value: object) -> object:
    """An OTLP AnyValue as Python: arrays (finish reasons, stop sequences) as lists."""
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    inner = getattr(value, kind)
    return [_value(v) for v in inner.values] if kind == "array_value" else inner


class Collector:
    """An OTLP/HTTP trace receiver: every exported span, decoded, with its attributes."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            attributes = {a.key: _value(a.value) for a in span.attributes}
                            collector.spans.append({"name": span.name, "kind": span.kind, "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                                                    "parent": span.parent_span_id.hex(), "attributes": attributes,
                                                    "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                                                    "error": span.status.code == 2})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, name: str | None, count: int = 1, timeout: float = 15.0) -> list[dict]:
        """At least `count` spans called `name`, or of requests (kind SERVER) when `name` is None."""
        deadline = time.monotonic() + timeout
        while len(found := [s for s in self.spans if (s["name"] == name if name else s["kind"] == SERVER)]) < count:
            assert time.monotonic() < deadline, f"{name}: {[s['name'] for s in self.spans]}"
            time.sleep(0.05)
        return found

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture()
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def test_a_miss_and_a_hit_are_traced_with_their_steps(tmp_path: Path, collector: Collector) -> None:
    tracing = f'[tracing]\nenabled = true\notlp_endpoint = "http://127.0.0.1:{collector.port}/v1/traces"\nexport_interval_ms = 100\n'
    server = start_server(tmp_path / "traced", config_text(embeddings=False, cache="enabled = true\nsweep_interval_s = 0", extra=tracing))
    try:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "What is the capital of Italy?"}], "max_tokens": 8, "temperature": 0,
                "user": "end-user-7"}
        miss = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        time.sleep(0.5)  # the answer is stored off the request path
        hit = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert (miss.headers["x-cache"], hit.headers["x-cache"]) == ("miss", "hit")
        unknown = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "model": "nope"}, timeout=60)
        assert unknown.status_code == 404
        roots = {s["attributes"]["appliance.request.id"]: s for s in collector.wait_for(None, 3)}
        first, second = roots[miss.json()["id"]], roots[hit.json()["id"]]
        assert first["name"] == second["name"] == f"chat {CHAT_MODEL}"
        assert first["attributes"]["appliance.cache.result"] == "miss" and first["attributes"]["appliance.tenant"] == "local"
        assert first["attributes"]["gen_ai.usage.output_tokens"] == miss.json()["usage"]["completion_tokens"]
        assert second["attributes"]["appliance.cache.result"] == "hit" and second["attributes"]["gen_ai.response.id"] == hit.json()["id"]
        children = {s["name"]: s for s in collector.spans if s["parent"] == first["id"]}
        assert {"auth", "cache.lookup", "budget.reserve", "engine.generate", "budget.settle", "cache.store"} <= set(children)
        assert children["engine.generate"]["attributes"]["appliance.finish_reason"] in ("stop", "length")
        assert children["engine.generate"]["attributes"]["appliance.model"] == CHAT_MODEL
        assert first["attributes"]["appliance.end_user"] == "end-user-7"  # the caller's own name for its user, kept
        lookups = [s for s in collector.spans if s["name"] == "cache.lookup" and s["parent"] == second["id"]]
        assert lookups and lookups[0]["attributes"]["appliance.cache.similarity"] == 1.0
        assert all(s["trace"] == first["trace"] for s in children.values())
        failed = [s for s in roots.values() if s["error"]]
        assert failed and failed[0]["attributes"]["http.response.status_code"] == 404 and failed[0]["name"] == "chat nope"
        assert failed[0]["attributes"]["error.type"] == "model_not_found"
        assert failed[0]["attributes"]["appliance.request.id"] == unknown.headers["x-request-id"]
    finally:
        stop_server(server)


def test_traces_are_kept_in_the_database_and_read_back(tmp_path: Path) -> None:
    """No collector configured: the spans still land in SQLite, behind the admin API."""
    server = start_server(tmp_path / "stored", config_text(embeddings=False, extra="[tracing]\nretention_days = 1\n"))
    try:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 6, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        trace_id = response.headers["x-trace-id"]
        assert len(trace_id) == 32
        deadline = time.monotonic() + 15
        while True:  # children are exported before their root ends: wait for the whole tree
            found = httpx.get(f"{server.base_url}/admin/traces/{trace_id}", timeout=10)
            if found.status_code == 200 and [s["name"] for s in found.json()["spans"]] == [f"chat {CHAT_MODEL}"]:
                break
            assert time.monotonic() < deadline, found.text
            time.sleep(0.1)
        tree = found.json()
        (root,) = tree["spans"]
        assert root["name"] == f"chat {CHAT_MODEL}" and root["attributes"]["appliance.request.id"] == response.json()["id"]
        assert {"budget.reserve", "engine.generate"} <= {c["name"] for c in root["children"]}
        listed = httpx.get(f"{server.base_url}/admin/traces", params={"limit": 5}, timeout=10).json()["traces"]
        assert any(t["trace_id"] == trace_id for t in listed)
        assert httpx.get(f"{server.base_url}/admin/traces/{'0' * 32}", timeout=10).status_code == 404
    finally:
        stop_server(server)


def test_one_mapping_names_every_attribute() -> None:
    assert attribute_name("gen_ai__usage__input_tokens") == "gen_ai.usage.input_tokens"
    assert attribute_name("cache__result") == "appliance.cache.result" and attribute_name("tenant") == "appliance.tenant"
    assert attribute_name("http__status_code") == "http.response.status_code" and attribute_name("error__type") == "error.type"


def test_the_request_attributes_are_what_the_caller_sent() -> None:
    body = msgspec.json.decode(msgspec.json.encode({
        "model": "m" * 1000, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "max_tokens": 99,
        "temperature": 1, "stop": "END", "n": 2, "seed": 3, "response_format": {"type": "json_object"}}), type=ChatCompletionRequest)
    got = {attribute_name(k): v for k, v in request_attributes(body).items() if v is not None}
    assert got == {"gen_ai.request.model": "m" * 256, "gen_ai.request.max_tokens": 7, "gen_ai.request.temperature": 1.0,
                   "gen_ai.request.seed": 3, "gen_ai.request.stop_sequences": ["END"], "gen_ai.request.choice.count": 2,
                   "gen_ai.output.type": "json"}
    plain = msgspec.json.decode(b'{"model": "m", "prompt": "x", "stop": ["a", "b"]}', type=CompletionRequest)
    assert request_attributes(plain)["gen_ai__request__stop_sequences"] == ["a", "b"]
    assert request_attributes(plain)["gen_ai__request__choice__count"] is None  # n = 1 is left out


@pytest.mark.parametrize("join", [True, False])
def test_a_callers_trace_is_joined_only_where_callers_are_one_tenant(tmp_path: Path, join: bool) -> None:
    """Open mode joins the caller's trace; with keys the server's trace is its own, linked to the caller's span."""
    from appliance.config.settings import TracingSettings
    from appliance.store.db import connect, migrate
    from appliance.server.tracing import Tracing

    migrate(connect(tmp_path / "t.db"))
    tracing = Tracing(TracingSettings(), tmp_path / "t.db", join_callers=join)
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    span = tracing.start_server("chat", {"traceparent": f"00-{trace_id}-{span_id}-01"})
    span.end()
    context, parent = span.get_span_context(), span.parent  # type: ignore[attr-defined]
    if join:
        assert format(context.trace_id, "032x") == trace_id and format(parent.span_id, "016x") == span_id and not span.links  # type: ignore[attr-defined]
    else:
        assert format(context.trace_id, "032x") != trace_id and parent is None
        (link,) = span.links  # type: ignore[attr-defined]
        assert (format(link.context.trace_id, "032x"), format(link.context.span_id, "016x")) == (trace_id, span_id)
        assert span.attributes["appliance.caller.trace_id"] == trace_id  # type: ignore[attr-defined]
    fresh = tracing.start_server("chat", {})
    assert fresh.parent is None and not fresh.links  # type: ignore[attr-defined]
    fresh.end()
    tracing.close()
