"""The Responses API's mapping onto chat requests and back, without IO."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from appliance.pipeline.errors import APIError
from appliance.wire.responses_input import (
    chat_tool_choice,
    chat_tools,
    conversation_turn,
    function_call_events,
    input_messages,
    output_items,
    responses_param,
    to_chat,
)
from appliance.wire.schemas import ResponsesRequest

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def request(**fields: object) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "hi", **fields}, ResponsesRequest)


def test_a_string_is_one_user_turn_and_parts_are_joined() -> None:
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]}]
    assert input_messages(items) == [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": "c"}]


def test_function_calls_and_outputs_become_tool_calls_and_tool_messages() -> None:
    items = [{"role": "user", "content": "add 1 and 2, and 3 and 4"},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 3, "b": 4}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "7"}]}]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]  # parallel calls share one turn
    assert messages[1]["tool_calls"][0] == CALL
    assert messages[3] == {"role": "tool", "tool_call_id": "call_2", "content": "7"}


@pytest.mark.parametrize(("items", "param"), [
    ([], "input"),
    (["text"], "input[0]"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "http://x"}]}],
     "input[0].content[1]"),
    ([{"role": "user", "content": [{"type": "video"}]}], "input[0].content[0].type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call_output", "output": "3"}], "input[0].call_id"),
])
def test_unsupported_input_names_the_item(items: list, param: str) -> None:
    with pytest.raises(APIError) as caught:
        input_messages(items)
    assert caught.value.status == 400 and caught.value.param == param


def test_function_tools_map_onto_chat_tools_and_choices() -> None:
    tools = [{"type": "function", "name": "add", "description": "Adds.", "parameters": {"type": "object"}, "strict": True}]
    assert chat_tools(tools) == [{"type": "function", "function": {"name": "add", "description": "Adds.",
                                                                  "parameters": {"type": "object"}, "strict": True}}]
    assert chat_tool_choice("required", tools) == "required"
    assert chat_tool_choice({"type": "function", "name": "add"}, tools) == {"type": "function", "function": {"name": "add"}}
    for bad, param in (({"type": "function", "name": "sub"}, "tool_choice"), ({"type": "file_search"}, "tool_choice")):
        with pytest.raises(APIError) as caught:
            chat_tool_choice(bad, tools)
        assert caught.value.param == param
    with pytest.raises(APIError) as caught:
        chat_tools([*tools, {"type": "web_search"}])
    assert caught.value.param == "tools[1].type"


def test_tool_calls_become_output_items_and_stream_events() -> None:
    items = output_items("", [CALL], "completed", "msg_1")
    assert items == [{"type": "function_call", "id": "fc_call_1", "call_id": "call_1", "name": "add",
                      "arguments": '{"a": 1, "b": 2}', "status": "completed"}]
    assert [i["type"] for i in output_items("Sure.", [CALL], "completed", "msg_1")] == ["message", "function_call"]
    assert output_items("", [], "completed", "msg_1")[0]["content"][0]["text"] == ""  # an empty answer is still a message
    events = function_call_events(1, CALL, ['{"a": ', "", '1, "b": 2}'])
    assert [e["type"] for e in events] == ["response.output_item.added", "response.function_call_arguments.delta",
                                           "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                           "response.output_item.done"]
    assert events[0]["item"]["arguments"] == "" and events[-1]["item"]["arguments"] == '{"a": 1, "b": 2}'
    assert json.loads(events[3]["arguments"]) == {"a": 1, "b": 2} and {e["output_index"] for e in events} == {1}
    assert conversation_turn("", [CALL]) == {"role": "assistant", "content": None, "tool_calls": [CALL]}


def test_a_request_becomes_the_chat_request_with_history_and_instructions() -> None:
    history = [{"role": "user", "content": "I am Ann."}, {"role": "assistant", "content": "Hello Ann."}]
    body = request(input="Who am I?", instructions="Be brief.", max_output_tokens=20, temperature=0.5, top_p=0.9, user="u1",
                   text={"format": {"type": "json_schema", "name": "who", "schema": {"type": "object"}, "strict": True}})
    chat, turns = to_chat(body, history)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "I am Ann."),
                                                            ("assistant", "Hello Ann."), ("user", "Who am I?")]
    assert turns == [*history, {"role": "user", "content": "Who am I?"}]  # instructions are not carried on
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user) == (20, 0.5, 0.9, "u1")
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.schema == {"type": "object"}
    assert to_chat(request(text={"format": {"type": "json_object"}}), [])[0].response_format.type == "json_object"  # type: ignore[union-attr]
    assert to_chat(request(text={"format": {"type": "text"}}), [])[0].response_format is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True}, "background"),
    ({"reasoning": "high"}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        to_chat(request(**fields), [])
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_parameter_names_read_as_the_responses_fields() -> None:
    assert responses_param("messages[3].content") == "input"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("temperature") == "temperature" and responses_param(None) is None


def _wire(saved: list) -> Any:
    from appliance.wire.responses import Echo, ResponsesWire
    from appliance.pipeline.prepare import Prepared
    from engines.interface import GenerationRequest

    echo = Echo.of(request(instructions="Be brief."), 0.0, 1.0)
    return ResponsesWire(Prepared(GenerationRequest("resp_1", (1, 2), 8), "p"), "m", 100, echo,
                         [{"role": "user", "content": "hi"}], lambda body, turns: saved.append((body, turns)))


def _events(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        name, data = frame.decode().split("\n")[:2]
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_the_wire_streams_numbered_events_and_stores_the_finished_response() -> None:
    from engines.interface import FinishEvent, Usage

    saved: list = []
    wire = _wire(saved)
    finish = FinishEvent("length", Usage(2, 8))
    events = _events([*wire.opening(1), *wire.delta(0, "Hel", None), *wire.delta(0, "lo", None), *wire.closing(0, finish), *wire.ending(finish)])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["instructions"] == "Be brief."
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["content"][0]["text"] == "Hello" and final["response"]["usage"]["total_tokens"] == 10
    body, turns = saved[0]
    assert body == final["response"] and turns == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]


def test_an_error_mid_stream_ends_with_error_and_failed_events_and_is_not_stored() -> None:
    from engines.interface import FinishEvent, Usage

    saved: list = []
    wire = _wire(saved)
    wire.opening(1)
    wire.delta(0, "Hel", None)
    error = APIError(503, "The upstream went away.", type="server_error", code="upstream_unavailable")
    events = _events(wire.failed(error, FinishEvent("error", Usage(2, 1), error="gone")))
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[0]["code"] == "upstream_unavailable" and events[0]["message"] == "The upstream went away."
    failed = events[1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "The upstream went away."}
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hel"
    assert saved == []


def test_the_wire_streams_calls_as_function_call_items_in_their_order() -> None:
    from appliance.prompt.tool_calls import ToolCall
    from engines.interface import FinishEvent, Usage

    saved: list = []
    wire = _wire(saved)
    call = ToolCall("call_9", "add", '{"a": 1, "b": 2, "note": "a long enough note to be cut"}')
    frames = [*wire.opening(1), *wire.tool_call(0, call, 0), *wire.delta(0, "Done.", None),
              *wire.closing(0, FinishEvent("stop", Usage(2, 8))), *wire.ending(FinishEvent("stop", Usage(2, 8)))]
    events = _events(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # the arguments come in pieces
    # The call is item 0 (it came first), the text after it item 1, and the final object lists them so.
    assert {e["output_index"] for e in events if "function_call" in e["type"]} == {0}
    assert {e["output_index"] for e in events if e["type"].startswith("response.output_text")} == {1}
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call", "message"] and final["status"] == "completed"
    assert final["output"][0] == {"type": "function_call", "id": "fc_call_9", "call_id": "call_9", "name": "add",
                                  "arguments": call.arguments, "status": "completed"}
    body, turns = saved[0]
    assert body == final and turns[-1] == {"role": "assistant", "content": "Done.", "tool_calls": [call.wire()]}


def test_a_tool_parameter_reads_as_the_flat_responses_tool() -> None:
    assert responses_param("tools[2].function.parameters") == "tools[2].parameters"
    assert responses_param("tools[0].function") == "tools[0]"
    assert responses_param("tools[1].type") == "tools[1].type"


def test_penalties_reach_the_chat_request_and_are_echoed() -> None:
    from appliance.wire.responses import Echo, ResponsesWire
    from appliance.pipeline.prepare import Prepared
    from engines.interface import GenerationRequest

    body = request(frequency_penalty=0.5, presence_penalty=-0.25)
    chat, _ = to_chat(body, [])
    assert (chat.frequency_penalty, chat.presence_penalty) == (0.5, -0.25)
    wire = ResponsesWire(Prepared(GenerationRequest("resp_1", (1, 2), 8), "p"), "m", 100, Echo.of(body, 0.0, 1.0), [], None)
    shown = wire.response("in_progress", [])
    assert (shown["frequency_penalty"], shown["presence_penalty"]) == (0.5, -0.25)
