"""The Responses API in terms of chat completions: a Responses request becomes the chat request
the rest of the server already serves (input items to messages, `text.format` to
`response_format`, function tools to chat tools), and chat's tool calls become Responses output
items. Pure functions; every refusal names the Responses field at fault."""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec

from appliance.pipeline.errors import APIError, invalid
from appliance.pipeline.prepare import check_metadata
from appliance.wire.decode import from_validation
from appliance.wire.schemas import ChatCompletionRequest, ChatMessage, ResponsesRequest

Message = dict[str, Any]  # one chat message as the chat API's JSON has it

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("A message's content must be a string or a list of content parts.", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in _MEDIA_PARTS:
            raise invalid(f"This model does not accept {_MEDIA_PARTS[kind]}: '{kind}' parts are not supported.", f"{where}[{j}]")
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        else:
            raise invalid(f"Unsupported content part type {kind!r}; use 'input_text'.", f"{where}[{j}].type")
    return "".join(out)


# A namespace's function is one chat function, `<namespace>__<name>`, and splits back in the answer.
NAMESPACED = "__"


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str) or (field != "arguments" and not value):
            raise invalid(f"A function_call item needs a string '{field}'.", f"{where}.{field}")
    namespace = item.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise invalid("A function_call item's 'namespace' is a string.", f"{where}.namespace")
    flat = f"{namespace}{NAMESPACED}{name}" if namespace else name
    return {"id": call_id, "type": "function", "function": {"name": flat, "arguments": arguments}}


def namespaces(tools: list[Any] | None) -> frozenset[str]:
    """The namespaces a request's tools declare."""
    return frozenset(t["name"] for t in tools or [] if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("name"), str))


def split_name(flat: str, declared: frozenset[str]) -> tuple[str | None, str]:
    """(namespace, name) of a chat function: one of a declared namespace splits, any other is itself."""
    namespace, sep, name = flat.partition(NAMESPACED)
    return (namespace, name) if sep and namespace in declared and name else (None, flat)


def input_messages(value: str | list[Any]) -> list[Message]:
    """`input` as chat messages: a string is one user turn; message items keep their role (text
    parts joined); function_call items become an assistant turn's tool_calls (consecutive ones
    share a turn, as parallel calls do) and function_call_output items become tool messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise invalid("'input' must not be empty.", "input")
    out: list[Message] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid("Each input item must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"Unsupported role {role!r}: use one of {', '.join(_ROLES)}.", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _tool_call(item, where)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1].get("content"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid("A function_call_output item needs a string 'call_id'.", f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise invalid(f"Input items of type {kind!r} are not supported; use message, function_call or function_call_output.",
                          f"{where}.type")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) as chat tools; a
    namespace's functions as `<namespace>__<name>` (their calls come back split: function_call_item)."""
    if not tools:
        return None
    declared = namespaces(tools)
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise invalid("A namespace tool needs a list of 'tools'.", f"tools[{i}].tools")
            out += [_chat_function(t, f"tools[{i}].tools[{j}]", tool["name"]) for j, t in enumerate(inner)]
            continue
        function = _chat_function(tool, f"tools[{i}]", None)
        if split_name(function["function"]["name"], declared)[0] is not None:
            raise invalid(f"The function name {function['function']['name']!r} reads as a namespace's function.", f"tools[{i}].name")
        out.append(function)
    return out


def _chat_function(tool: Any, where: str, namespace: str | None) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"Only function tools (and namespaces of them) are supported; {kind!r} is not.", f"{where}.type")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("A function tool needs a 'name'.", f"{where}.name")
    function = {"name": f"{namespace}{NAMESPACED}{name}" if namespace else name,
                **{k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any, tools: list[Any] | None) -> Any:
    """`tool_choice`: the modes pass as they are; {"type": "function", "name"} becomes chat's
    {"type": "function", "function": {"name"}}."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if not any(isinstance(t, dict) and t.get("name") == choice["name"] for t in tools or []):
            raise invalid(f"tool_choice names the function {choice['name']!r}, which is not in 'tools'.", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}.", "tool_choice")


def output_items(text: str, tool_calls: list[dict[str, Any]], status: str, message_id: str,
                 declared: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """An answer as Responses output items: its text (if any, or if nothing else) as one message,
    then one function_call item per chat tool call."""
    items: list[dict[str, Any]] = []
    if text or not tool_calls:
        items.append(message_item(message_id, text, status))
    for call in tool_calls:
        items.append(function_call_item(call, status, declared=declared))
    return items


def message_item(message_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict[str, Any], status: str, arguments: str | None = None,
                       declared: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A chat tool call ({id, type, function: {name, arguments}}) as a function_call output item
    (a namespace's function named as its namespace and its own name); the item's own id is derived
    from the call's, so a stream and its final object agree."""
    function = call["function"]
    namespace, name = split_name(function["name"], declared)
    item = {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": name,
            "arguments": function.get("arguments", "") if arguments is None else arguments, "status": status}
    return {**item, "namespace": namespace} if namespace else item


def function_call_events(output_index: int, call: dict[str, Any], pieces: list[str],
                         declared: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A streamed function call as the Responses events for it (without sequence numbers): the item
    added with empty arguments, the arguments in pieces, then done."""
    added = function_call_item(call, "in_progress", "", declared)
    arguments = "".join(pieces)
    done = function_call_item(call, "completed", arguments, declared)
    events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": output_index, "item": added}]
    events += [{"type": "response.function_call_arguments.delta", "output_index": output_index, "item_id": added["id"], "delta": p}
               for p in pieces if p]
    events.append({"type": "response.function_call_arguments.done", "output_index": output_index, "item_id": added["id"],
                   "name": done["name"], "arguments": arguments})
    events.append({"type": "response.output_item.done", "output_index": output_index, "item": done})
    return events


def conversation_turn(text: str, tool_calls: list[dict[str, Any]]) -> Message:
    """The answer as the assistant turn a later `previous_response_id` request continues from."""
    turn: Message = {"role": "assistant", "content": text or (None if tool_calls else "")}
    if tool_calls:
        turn["tool_calls"] = tool_calls
    return turn


def _check(body: ResponsesRequest) -> None:
    """Fields that would change the answer and that this server does not implement are refused."""
    if body.background:
        raise invalid("Background responses are not supported by this server.", "background")
    if body.conversation is not None:
        raise invalid("'conversation' is not supported by this server; use previous_response_id.", "conversation")
    if body.prompt is not None:
        raise invalid("Stored prompts are not supported by this server.", "prompt")
    if body.reasoning is not None and not isinstance(body.reasoning, dict):
        raise invalid("reasoning must be an object, such as {\"effort\": \"none\"}.", "reasoning")
    if body.top_logprobs:
        raise invalid("'top_logprobs' is not supported by this server for responses yet.", "top_logprobs")
    # Reasoning is shown whole (its text in the reasoning item), so there is nothing encrypted to include.
    unserved = [value for value in body.include or [] if value != "reasoning.encrypted_content"]
    if unserved:
        raise invalid(f"'include' values are not supported by this server: {', '.join(unserved)}.", "include")
    if body.max_tool_calls is not None:
        raise invalid("'max_tool_calls' is not supported by this server.", "max_tool_calls")
    check_metadata(body.metadata)


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema is None:
        raise invalid("text.format json_schema needs a 'schema' object.", "text.format.schema")
    spec = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def to_chat(body: ResponsesRequest, history: list[Message]) -> tuple[ChatCompletionRequest, list[Message]]:
    """The chat request that answers this Responses request, and the conversation so far (the
    earlier response's turns and this input, without instructions: OpenAI does not carry
    instructions over to a continued response)."""
    _check(body)
    turns = [*history, *input_messages(body.input)]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + turns
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
                            "response_format": _response_format(body), "frequency_penalty": body.frequency_penalty,
                            "presence_penalty": body.presence_penalty, "metadata": body.metadata,
                            # chat's own check names the values; "none" turns a reasoning model's thinking off
                            "reasoning_effort": body.reasoning.get("effort") if isinstance(body.reasoning, dict) else None}
    tools = chat_tools(body.tools)
    if tools is not None:
        chat["tools"] = tools
        chat["tool_choice"] = chat_tool_choice(body.tool_choice, body.tools)
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    elif body.tool_choice not in (None, "auto", "none"):
        raise invalid("tool_choice needs 'tools'.", "tool_choice")
    _no_field_dropped(messages)
    try:
        request = msgspec.convert({k: v for k, v in chat.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise renamed(from_validation(exc)) from None
    return request, turns


def _no_field_dropped(messages: list[Message]) -> None:
    """Every field a message carries must be one chat messages know, or it would be lost on the way
    (an input item's field that chat messages have no place for)."""
    known = set(ChatMessage.__struct_fields__)
    for message in messages:
        extra = set(message) - known
        if extra:
            raise invalid(f"Input items carrying {', '.join(sorted(extra))} are not supported by this server.",
                          "input")


_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("reasoning_effort", "reasoning.effort"))


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter name as the Responses request spells it."""
    if param is None:
        return None
    tool = re.fullmatch(r"(tools\[\d+\])\.function(\..+)?", param)
    if tool is not None:  # a Responses function tool is flat: tools[i].name, not tools[i].function.name
        return tool.group(1) + (tool.group(2) or "")
    for chat, ours in _PARAMS:
        if param == chat or param.startswith(chat + "[") or param.startswith(chat + "."):
            return ours if chat == "messages" else ours + param[len(chat):]
    return param


def renamed(error: APIError) -> APIError:
    error.param = responses_param(error.param)
    return error
