"""Hostile JSON Schemas: every field that takes one (chat's `response_format`, Responses'
`text.format`, a tool's `parameters` with `tool_choice: "required"`) gets a schema at each bound
(accepted, and a real generation runs) and just past it (a 400 naming the field, the keyword and the
limit), against the real server in keys mode, while a thread checks that `/health` keeps answering
within a second. Then the cases that used to end the process or stall every tenant: `maxLength:
30000` (a segfault in llama.cpp's recursive grammar parser) and an enum of 50,000 strings (seconds
of grammar compile on the event loop). The pure bounds are tested first, without a server."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.prompt.schema_bounds import SCHEMA_LIMITS, TOOLS_LIMITS, pattern_problem, schema_grammar, schema_problem
from engines.grammar_bounds import GRAMMAR_LIMITS, grammar_depth, grammar_problem
from tests.conftest import CHAT_MODEL, Server, start_server, stop_server
from tests.test_gate_api import new_key
from tests.test_hostile import hostile_config

L = SCHEMA_LIMITS


# -- the pure bounds --------------------------------------------------------------------------------

def nested(levels: int) -> dict[str, Any]:
    """Objects nested `levels` deep, the innermost a string: `levels` + 1 schemas deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def words(count: int, width: int) -> list[str]:
    """`count` distinct strings of exactly `width` characters."""
    return [f"{i:0{width}d}" for i in range(count)]


@dataclass(frozen=True)
class Bound:
    name: str
    keyword: str  # the keyword the refusal names
    make: Callable[[bool], dict[str, Any]]  # past=False: at the bound; True: just past it
    says: str  # and the limit it names


def _anyof(branches: int) -> dict[str, Any]:
    # the root, its property and the branches: `branches` + 2 schemas
    return {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": i} for i in range(branches)]}}, "required": ["v"]}


def _big(past: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"], "description": ""}
    schema["description"] = "x" * (L.schema_chars - len(json.dumps(schema)) + past)
    return schema


BOUNDS = [
    Bound("maxLength", "maxLength", lambda past: {"type": "string", "maxLength": L.repetitions + past}, "1,000"),
    Bound("minLength", "minLength", lambda past: {"type": "string", "minLength": L.repetitions + past}, "1,000"),
    Bound("maxItems", "maxItems", lambda past: {"type": "array", "items": {"type": "integer"}, "maxItems": L.repetitions + past}, "1,000"),
    Bound("minItems", "minItems", lambda past: {"type": "array", "items": {"type": "integer"}, "minItems": L.repetitions + past}, "1,000"),
    Bound("enum values", "enum", lambda past: {"enum": words(L.enum_values + past, 3)}, "500"),
    # 100 strings of w characters are 100 * (w + 2) characters of JSON
    Bound("enum characters", "enum", lambda past: {"enum": words(99, L.enum_chars // 100 - 2) + ["x" * (L.enum_chars // 100 - 2 + past)]},
          "10,000"),
    Bound("depth", "schema", lambda past: nested(L.depth - 1 + past), "16"),
    Bound("properties", "properties",
          lambda past: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(L.properties + past)}}, "128"),
    Bound("subschemas", "schema", lambda past: _anyof(L.subschemas - 2 + past), "256"),
    Bound("schema size", "schema", _big, "131,072"),
    Bound("pattern length", "pattern", lambda past: {"type": "string", "pattern": "^" + "a" * (L.pattern_chars - 2 + past) + "$"}, "500"),
    Bound("pattern quantifiers", "pattern", lambda past: {"type": "string", "pattern": "^" + "a?" * (L.pattern_quantifiers + past) + "$"}, "16"),
    Bound("pattern count", "pattern", lambda past: {"type": "string", "pattern": "^[a-z]{0,%d}$" % (L.repetitions + past)}, "1,000"),
    # a counted repetition of an item of one width is cheap; of items of two widths, combinatorial
    Bound("pattern ambiguity", "pattern", lambda past: {"type": "string", "pattern": "^(a|bb){0,5}$" if past else "^(ab|cd){0,5}$"},
          "fixed, non-zero length"),
    # within every schema bound, but the grammar it needs passes 128 KiB (16 such strings write 128,564 characters)
    Bound("grammar size", "the grammar it needs",
          lambda past: {"anyOf": [{"type": "string", "minLength": i, "maxLength": L.repetitions} for i in range(16 + past)]}, "131,072"),
]


@pytest.mark.parametrize("bound", BOUNDS, ids=lambda b: b.name)
def test_each_bound_takes_its_limit_and_refuses_one_more(bound: Bound) -> None:
    at, past = bound.make(False), bound.make(True)
    assert schema_problem(at) is None
    schema_grammar(at)  # and llama.cpp may be given its grammar
    problem = schema_problem(past)
    if problem is None:  # only the grammar is past its bound
        with pytest.raises(ValueError, match=f"{bound.keyword}.*{bound.says}"):
            schema_grammar(past)
        return
    assert problem.keyword == bound.keyword and bound.says in problem.reason, problem


def test_the_refusal_says_where_in_the_schema() -> None:
    problem = schema_problem({"type": "object", "properties": {"a/b": {"type": "array", "items": {"type": "string", "maxLength": 30000}}}})
    assert problem is not None
    assert (problem.where, problem.keyword) == ("/properties/a~1b/items/maxLength", "maxLength")
    assert str(problem) == "'maxLength' at /properties/a~1b/items/maxLength: 30,000 is more than the 1,000 this server enforces"


@pytest.mark.parametrize("pattern", ["^(((a$", "^a{2,1}$", "^[z-a]$", "^(?P<x>a)(?P<x>b)$"])
def test_a_pattern_that_is_no_regular_expression_is_refused(pattern: str) -> None:
    """One validation for every field: the same schema is refused in response_format and in tools."""
    problem = schema_problem({"type": "string", "pattern": pattern})
    assert problem is not None and problem.keyword == "pattern" and "not a valid regular expression" in problem.reason


@pytest.mark.parametrize("pattern", [
    "^[0-9]{3}-[0-9]{4}$", "^[A-Z]{2}[0-9]{6}$", "^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$",
    "^([a-z0-9-]+\\.)*[a-z]+$", "^(\\+[0-9]{1,3})?[0-9]{10}$", "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "^[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\\.[0-9]+)?)?(Z|[+-][0-9]{2}:[0-9]{2})?)?$",
])
def test_everyday_patterns_pass(pattern: str) -> None:
    assert pattern_problem(pattern) is None


@pytest.mark.parametrize("pattern", ["^(a?){0,100}$", "^((a|aa){0,8}){0,8}$", "^(a+b?){0,100}$", "^(a?){1000}$", "^(a?){50,}$"])
def test_repetitions_that_split_text_many_ways_are_refused(pattern: str) -> None:
    """Each of these took from hundreds of milliseconds to minutes a token in llama.cpp's grammar."""
    assert "fixed, non-zero length" in (pattern_problem(pattern) or "")


def test_bounds_run_before_validity_and_without_recursion() -> None:
    """A schema nested far past the bound is refused by the walk, never reaching the (recursive) metaschema check."""
    problem = schema_problem(nested(5000))
    assert problem is not None and problem.keyword == "schema" and "nest" in problem.reason


def test_tools_are_bounded_together() -> None:
    one = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(L.properties)}}
    assert schema_problem(one) is None
    assert schema_problem({"anyOf": [one] * (TOOLS_LIMITS.properties // L.properties)}, TOOLS_LIMITS) is None
    problem = schema_problem({"anyOf": [one] * (TOOLS_LIMITS.properties // L.properties + 1)}, TOOLS_LIMITS)
    assert problem is not None and problem.keyword == "properties"


def test_grammar_depth_counts_parentheses_outside_literals_and_classes() -> None:
    assert grammar_depth('root ::= "((" [()] ( "a" ( "\\"(" )? )') == 2
    deep = "root ::= " + "(" * (GRAMMAR_LIMITS.depth + 1) + '"a"' + ")" * (GRAMMAR_LIMITS.depth + 1)
    assert "nests" in (grammar_problem(deep) or "")
    assert grammar_problem("root ::= " + "(" * GRAMMAR_LIMITS.depth + '"a"' + ")" * GRAMMAR_LIMITS.depth) is None
    assert "characters long" in (grammar_problem('root ::= "' + "a" * GRAMMAR_LIMITS.chars + '"') or "")


def test_escapes_llama_cpp_cannot_read_are_named() -> None:
    assert "\\d" in (grammar_problem('root ::= "\\"" [\\d]+ "\\""') or "")
    assert grammar_problem('root ::= [^"\\\\\\x7F\\x00-\\x1F] "\\n\\t\\"" [\\[\\]-]') is None


def test_a_schema_at_every_bound_at_once_stays_under_the_grammar_limits() -> None:
    """The deepest grammar the schema bounds allow (a maxLength of 1,000) is within what llama.cpp is given."""
    grammar = schema_grammar({"type": "string", "maxLength": L.repetitions})
    assert L.repetitions <= grammar_depth(grammar) <= GRAMMAR_LIMITS.depth


# -- the real server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hostile_schemas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # the hostile suite's keys-mode server (the model's whole trained context, for tools rendered into
    # the prompt), and a tenant of its own with no rate limit or budget
    config = hostile_config(slots=2).replace("context_length = 2048", "context_length = 8192")
    server = start_server(tmp_path_factory.mktemp("schemas"), config)
    yield {"server": server, "key": new_key(server, "schemas", user="eve")}
    stop_server(server)


class HealthWatch:
    """GET /health in a loop on a thread; `slowest` is the longest any answer took (a timeout counts)."""

    def __init__(self, server: Server) -> None:
        self.server, self.slowest, self.answered = server, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.server.base_url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.perf_counter() - start
                self.slowest = max(self.slowest, took if ok else 5.0)
                self.answered += ok
                self._stop.wait(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def health_within_a_second(server: Server) -> Iterator[HealthWatch]:
    with HealthWatch(server) as watch:
        yield watch
    assert watch.answered and watch.slowest < 1.0, f"/health took {watch.slowest:.2f} s"


def _as_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters must describe an object: other schemas go in a property."""
    if schema.get("type") == "object":
        return schema
    return {"type": "object", "properties": {"v": schema}, "required": ["v"]}


# Each field that takes a schema: the request carrying it, and the param a refusal names.
FIELDS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "response_format": ("/v1/chat/completions", lambda s: {
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}, "response_format.json_schema.schema"),
    "text.format": ("/v1/responses", lambda s: {
        "model": CHAT_MODEL, "input": "Answer in JSON.", "max_output_tokens": 3, "store": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": s}}}, "text.format.schema"),
    "tool parameters": ("/v1/chat/completions", lambda s: {
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 3, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": _as_parameters(s)}}]}, "tools[0].function.parameters"),
}


def post(server: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body).encode(), timeout=300,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def assert_answers(server: Server, key: str) -> None:
    """The server is alive and still generates."""
    path, make, _ = FIELDS["response_format"]
    response = post(server, key, path, make({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert response.status_code == 200, response.text[:300]


def assert_refused_naming(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    return error["message"]


@pytest.mark.parametrize("field", list(FIELDS))
def test_every_schema_field_takes_each_bound_and_refuses_past_it(hostile_schemas: dict[str, Any], field: str) -> None:
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, param = FIELDS[field]
    for bound in BOUNDS:
        with health_within_a_second(server):
            at = post(server, key, path, make(bound.make(False)))
            if field == "tool parameters" and at.status_code == 400:
                # tools are written into the prompt: the largest schemas the bounds take do not fit the context
                assert at.json()["error"]["code"] == "context_length_exceeded", (bound.name, at.text[:300])
            else:
                assert at.status_code == 200, (bound.name, at.text[:300])
            past = post(server, key, path, make(bound.make(True)))
            assert_refused_naming(past, param, bound.keyword, bound.says)


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_30000_maxlength_is_refused_and_the_server_lives(hostile_schemas: dict[str, Any], field: str) -> None:
    """It was a SIGSEGV: the converter nested 30,000 parentheses and llama.cpp's parser overflowed its stack."""
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, param = FIELDS[field]
    with health_within_a_second(server):
        for length in (30_000, 100_000):
            message = assert_refused_naming(post(server, key, path, make({"type": "string", "maxLength": length})), param, "maxLength")
            assert f"{length:,}" in message and f"{L.repetitions:,}" in message
    assert server.process.poll() is None
    assert_answers(server, key)


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_pattern_that_is_no_regular_expression_is_refused_in_every_field(hostile_schemas: dict[str, Any], field: str) -> None:
    """It was accepted in response_format and refused in tool parameters: one validation serves both now."""
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, param = FIELDS[field]
    assert_refused_naming(post(server, key, path, make({"type": "string", "pattern": "^(((a$"})), param, "pattern", "not a valid regular expression")


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_pattern_llama_cpp_cannot_read_is_a_400_before_any_work(hostile_schemas: dict[str, Any], field: str) -> None:
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, param = FIELDS[field]
    assert_refused_naming(post(server, key, path, make({"type": "string", "pattern": "^\\d+$"})), param, "\\d", "[0-9]")


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_big_enum_near_the_body_limit_is_refused_and_health_keeps_answering(hostile_schemas: dict[str, Any], field: str) -> None:
    """50,000 strings (445 KB) stalled /health for 4.8 s while llama.cpp compiled them on the event loop."""
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, param = FIELDS[field]
    body = make({"enum": words(60_000, 12)})
    assert 900_000 < len(json.dumps(body)) < 1 << 20  # the test server's max_body_bytes
    with health_within_a_second(server):
        assert_refused_naming(post(server, key, path, body), param, "enum", str(L.enum_values))
    assert_answers(server, key)


def test_grammars_at_the_bounds_compile_while_health_answers(hostile_schemas: dict[str, Any]) -> None:
    """The costliest grammars the bounds allow, sent at once: /health never waits for one (they
    compile on the engine's grammar threads, checked and converted on worker threads), and each answers."""
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    heavy = [b.make(False) for b in BOUNDS if b.name in ("grammar size", "enum values", "properties", "maxItems", "subschemas")]
    jobs = [(FIELDS[field][0], FIELDS[field][1](schema)) for field in ("response_format", "text.format") for schema in heavy]
    results: list[int] = []

    def send(path: str, body: dict[str, Any]) -> None:
        results.append(post(server, key, path, body).status_code)

    with health_within_a_second(server):
        threads = [threading.Thread(target=send, args=job) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [200] * len(jobs)


def test_a_streamed_request_whose_grammar_llama_cpp_refuses_is_an_http_error(hostile_schemas: dict[str, Any], tmp_path: Path) -> None:
    """Grammars compile after `generate` returns, so a stream with a grammar waits for its first
    event: a grammar llama.cpp refuses (past every check here) is an HTTP 400, not a 200 with an
    error inside. An optional group around a 1,000-long chain passes the checks here, and llama.cpp
    refuses it (more than 2,000 rules under one repetition)."""
    server, key = hostile_schemas["server"], hostile_schemas["key"]
    path, make, _ = FIELDS["response_format"]
    body = {**make({"type": "string", "pattern": "^(a{0,1000})?$"}), "stream": True}
    response = post(server, key, path, body)
    assert response.status_code == 400, response.text[:300]
    assert "grammar" in response.json()["error"]["message"]
    assert_answers(server, key)
