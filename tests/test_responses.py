"""The Responses API through the official SDK against a real server on the bundled model, in
keys mode with prices, so tenants, budgets and the shared call path are exercised."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import CHAT_MODEL, Server, start_server, stop_server
from tests.test_gate_api import PRICE, client, db, gate_config, new_key, wait_settled

GREETING = "Say hello to the world."


ROUTE = """
[[routes]]
alias = "auto"
tiers = ["smollm2-135m"]
"""
NO_CACHE = {"Cache-Control": "no-cache"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, openai.OpenAI, openai.OpenAI]]:
    config = gate_config().replace("[cache]\nenabled = false", "[cache]\nenabled = true\nsweep_interval_s = 0") + ROUTE
    assert "enabled = true" in config
    srv = start_server(tmp_path_factory.mktemp("responses"), config)
    yield srv, client(srv, new_key(srv, "acme")), client(srv, new_key(srv, "globex"))
    stop_server(srv)


def ask(c: openai.OpenAI, **fields: object) -> openai.types.responses.Response:
    return c.responses.create(**{"model": CHAT_MODEL, "input": GREETING, "max_output_tokens": 24, "temperature": 0, **fields})  # type: ignore[arg-type]


def test_text_input_answers_in_openai_shape_and_is_charged(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    server, acme, _ = served
    r = ask(acme)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == CHAT_MODEL
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.usage is not None and r.usage.input_tokens > 5 and 1 <= r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.temperature == 0 and r.store is True
    wait_settled(server)
    charged, prompt, completion = db(server).execute(
        "SELECT charged_nanos, prompt_tokens, completion_tokens FROM settlements WHERE request_id = ?", (r.id,)).fetchone()
    assert (prompt, completion) == (r.usage.input_tokens, r.usage.output_tokens) and charged == PRICE.cost(prompt, completion) > 0


def test_message_input_with_instructions_reaches_the_prompt(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    items = [{"role": "user", "content": [{"type": "input_text", "text": GREETING}]}]
    # (SmolLM2's template puts a default system turn where there are no instructions, so two
    # instructions are compared, not instructions and none.)
    brief = ask(acme, input=items, instructions="Be brief.", store=False)
    pirate = "You are a pirate on a ship in the Caribbean. Answer every question like one, with plenty of pirate words."
    instructed = ask(acme, input=items, instructions=pirate, store=False)
    assert brief.usage is not None and instructed.usage is not None
    assert instructed.usage.input_tokens > brief.usage.input_tokens + 10
    assert instructed.instructions == pirate


class Colour(BaseModel):
    name: str


def test_a_json_schema_format_parses(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    r = acme.responses.parse(model=CHAT_MODEL, input="Name a colour.", text_format=Colour, max_output_tokens=40, temperature=0)
    assert isinstance(r.output_parsed, Colour) and r.output_parsed.name
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_max_output_tokens_cuts_to_incomplete(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    r = ask(acme, input="Write a long story about a lighthouse keeper.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_stored_responses_are_retrieved_deleted_and_only_within_the_tenant(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, globex = served
    r = ask(acme, metadata={"ticket": "42"})
    again = acme.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text and again.metadata == {"ticket": "42"}
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(r.id)  # another tenant: as if absent
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as caught:
        ask(globex, previous_response_id=r.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    raw = acme.responses.with_raw_response.delete(r.id)
    assert raw.http_request.method == "DELETE" and raw.parse() is None
    assert httpx.Response(200, content=raw.content).json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(r.id)
    unstored = ask(acme, store=False)
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    first = ask(acme, input="My name is Ann and I keep bees.", instructions="Be brief.")
    follow = ask(acme, input="What is my name?", previous_response_id=first.id)
    alone = ask(acme, input="What is my name?", store=False)
    assert first.usage is not None and follow.usage is not None and alone.usage is not None
    # The earlier turn and its answer are in the prompt; its instructions are not carried on.
    assert follow.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 8
    assert follow.previous_response_id == first.id
    third = ask(acme, input="And what do I keep?", previous_response_id=follow.id)
    assert third.usage is not None and third.usage.input_tokens > follow.usage.input_tokens + follow.usage.output_tokens
    with pytest.raises(openai.BadRequestError):
        ask(acme, previous_response_id="resp_unknown")


def test_streamed_events_come_in_order_and_assemble_the_same_text(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    server, acme, _ = served
    asked = {"model": CHAT_MODEL, "input": "What is 2+2?", "max_output_tokens": 32, "temperature": 0}
    whole = acme.responses.create(**asked, store=False)  # type: ignore[call-overload]
    assert whole.status == "completed"  # this question ends well inside its max_output_tokens
    with acme.responses.stream(**asked, extra_headers=NO_CACHE) as stream:  # type: ignore[arg-type]  # the model, not a replay
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1 and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == whole.output_text and final.id.startswith("resp_") and final.id != whole.id
    assert acme.responses.retrieve(final.id).output_text == whole.output_text  # a streamed response is stored too
    raw = list(acme.responses.create(**asked, stream=True, store=False, extra_headers=NO_CACHE))  # type: ignore[call-overload]
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == whole.output_text
    usage, whole_usage = raw[-1].response.usage, whole.usage  # type: ignore[union-attr]
    assert raw[-1].type == "response.completed" and usage is not None and whole_usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (whole_usage.input_tokens, whole_usage.output_tokens)
    server.wait_idle()


def test_the_cache_and_the_router_serve_responses_too(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    asked = {"input": "Which planet is known as the red planet?", "max_output_tokens": 24, "temperature": 0}
    first = acme.responses.with_raw_response.create(model=CHAT_MODEL, **asked)  # type: ignore[call-overload]
    again = acme.responses.with_raw_response.create(model=CHAT_MODEL, **asked)  # type: ignore[call-overload]
    assert first.headers["x-cache"] == "miss" and again.headers["x-cache"] == "hit"
    hit = again.parse()
    assert hit.output_text == first.parse().output_text and hit.id != first.parse().id
    assert acme.responses.retrieve(hit.id).output_text == hit.output_text  # a hit is stored like any answer
    routed = acme.responses.with_raw_response.create(model="auto", **asked, extra_headers=NO_CACHE)  # type: ignore[call-overload]
    assert routed.headers["x-route"] == "auto" and routed.headers["x-route-model"] == CHAT_MODEL
    answer = routed.parse()
    assert answer.model == CHAT_MODEL and answer.output_text == hit.output_text
    with acme.responses.stream(model="auto", **asked, extra_headers=NO_CACHE) as stream:  # type: ignore[arg-type]
        final = stream.get_final_response()
    assert final.output_text == answer.output_text and final.status == answer.status


LOOKUP = {"type": "function", "name": "lookup", "description": "Look up a fact about a country.",
          "parameters": {"type": "object", "properties": {"country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
                                                          "fact": {"type": "string", "enum": ["capital", "currency"]}},
                         "required": ["country", "fact"], "additionalProperties": False}}
ASK_CAPITAL = "What is the capital of Peru? Use the lookup tool."


def _valid_call(item: object) -> dict:
    assert getattr(item, "type") == "function_call" and getattr(item, "name") == "lookup"
    assert getattr(item, "call_id").startswith("call_") and getattr(item, "id").startswith("fc_")
    arguments = json.loads(getattr(item, "arguments"))
    jsonschema.validate(arguments, LOOKUP["parameters"])
    return arguments


def test_a_forced_function_call_and_its_output_fed_back(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    r = ask(acme, input=ASK_CAPITAL, tools=[LOOKUP], tool_choice="required", max_output_tokens=60)
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"] and r.output_text == ""
    (call,) = r.output
    _valid_call(call)
    assert r.tools[0].name == "lookup" and r.tool_choice == "required"  # the request echoed
    assert acme.responses.retrieve(r.id).output[0].arguments == call.arguments  # type: ignore[union-attr]
    # The tool's result, continuing from the stored response: a plain answer this time.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Lima"}  # type: ignore[union-attr]
    follow = ask(acme, input=[result], previous_response_id=r.id, tools=[LOOKUP], tool_choice="none", max_output_tokens=16)
    assert [i.type for i in follow.output] == ["message"] and follow.output_text.strip()
    # The same conversation given whole in `input` (the SDK's items sent back) is the same prompt.
    whole = ask(acme, input=[{"role": "user", "content": ASK_CAPITAL}, *r.output, result], tools=[LOOKUP], tool_choice="none",
                max_output_tokens=16, store=False)
    alone = ask(acme, input=ASK_CAPITAL, tools=[LOOKUP], tool_choice="none", max_output_tokens=1, store=False)
    assert follow.usage is not None and whole.usage is not None and alone.usage is not None
    assert whole.usage.input_tokens == follow.usage.input_tokens >= alone.usage.input_tokens + 10  # the call and its result
    assert whole.output_text == follow.output_text
    with pytest.raises(openai.BadRequestError) as caught:  # an output for a call never made
        ask(acme, input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}], previous_response_id=r.id,
            tools=[LOOKUP])
    assert caught.value.body["param"] == "input"  # type: ignore[index]


def test_a_streamed_function_call_assembles_through_the_sdk(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    _, acme, _ = served
    named = {"type": "function", "name": "lookup"}
    with acme.responses.stream(model=CHAT_MODEL, input=ASK_CAPITAL, tools=[LOOKUP], tool_choice=named,  # type: ignore[arg-type]
                               max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert deltas >= 2 and types == [  # the arguments come in pieces
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (call,) = final.output
    arguments = _valid_call(call)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == arguments  # type: ignore[union-attr]
    assert acme.responses.retrieve(final.id).output[0].call_id == call.call_id  # type: ignore[union-attr]
    # Through the router the call is validated whole, then replayed as the same events.
    with acme.responses.stream(model="auto", input=ASK_CAPITAL, tools=[LOOKUP], tool_choice=named,  # type: ignore[arg-type]
                               max_output_tokens=60, temperature=0) as stream:
        routed = stream.get_final_response()
    (routed_call,) = routed.output
    assert _valid_call(routed_call) == arguments


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input[0].content[0]"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, 400, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, 400, "tools[0].parameters"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"model": "nope"}, 404, "model"),
    ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"background": True}, 400, "background"),
])
def test_bad_input_is_refused_naming_the_field(served: tuple[Server, openai.OpenAI, openai.OpenAI], body: dict, status: int,
                                               param: str) -> None:
    server, acme, _ = served
    payload = {"model": CHAT_MODEL, "input": "hi", **body}
    r = httpx.post(f"{server.base_url}/v1/responses", json=payload, headers={"Authorization": f"Bearer {acme.api_key}"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_compaction_is_not_served_and_says_so(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    server, acme, _ = served
    r = httpx.post(f"{server.base_url}/v1/responses/compact", json={"model": CHAT_MODEL, "input": "hi"},
                   headers={"Authorization": f"Bearer {acme.api_key}"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_namespaces_function_is_called_by_namespace_and_name(served: tuple[Server, openai.OpenAI, openai.OpenAI]) -> None:
    """As Codex sends its sub-agent tools: a namespace of functions; the call names both, whole and
    streamed, and a function_call item naming them is read back as the same call."""
    _, acme, _ = served
    facts = {"type": "namespace", "name": "facts", "description": "Facts about countries.",
             "tools": [{**LOOKUP, "name": "lookup"}]}
    r = ask(acme, input=ASK_CAPITAL, tools=[facts], tool_choice="required", max_output_tokens=60,
            include=["reasoning.encrypted_content"], reasoning={"summary": "auto"})
    (call,) = r.output
    assert (call.type, call.namespace, call.name) == ("function_call", "facts", "lookup")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), LOOKUP["parameters"])  # type: ignore[union-attr]
    with acme.responses.stream(model=CHAT_MODEL, input=ASK_CAPITAL, tools=[facts], tool_choice="required",  # type: ignore[list-item]
                               max_output_tokens=60, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert [(i.namespace, i.name) for i in streamed.output] == [("facts", "lookup")]  # type: ignore[union-attr]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Lima"}  # type: ignore[union-attr]
    whole = ask(acme, input=[{"role": "user", "content": ASK_CAPITAL}, *r.output, result], tools=[facts], tool_choice="none",
                max_output_tokens=8, store=False)
    assert whole.output_text.strip()
    with pytest.raises(openai.BadRequestError) as clash:  # a plain function named like a namespace's is ambiguous
        ask(acme, input="Hi", tools=[facts, {**LOOKUP, "name": "facts__lookup"}])
    assert clash.value.body["param"] == "tools[1].name"  # type: ignore[index]
