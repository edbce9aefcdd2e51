"""A chat request's tools, tool_choice and tool turns, checked and put in the shapes the templates
and upstreams take. Every refusal names the field at fault."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from typing import Any

from appliance.pipeline.errors import invalid
from appliance.prompt.schema_bounds import SCHEMA_LIMITS, TOOLS_LIMITS, SchemaLimits, bounds_problem, validity_problem
from appliance.prompt.tool_calls import CLOSE, OPEN, Format, Mode, Tool, ToolPlan, call_text, system_prompt
from appliance.wire.schemas import ChatCompletionRequest, ChatMessage, FunctionSpec, NamedToolChoice, ToolSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Without a forced call no grammar is built from the schemas: a length or count (`maxLength`,
# `maxItems`) is only checked on the call afterwards and costs nothing to allow. Agents' tools ask
# for more than a grammar could hold (Claude Code: `maxLength` 524,288); every other bound stays.
_FREE = (replace(SCHEMA_LIMITS, repetitions=sys.maxsize), replace(TOOLS_LIMITS, repetitions=sys.maxsize))


def has_tools(body: ChatCompletionRequest) -> bool:
    """Tools offered, or tool turns in the chat: such an answer depends on the tool set and on
    results from outside."""
    return bool(body.tools or body.functions) or any(
        m.role in ("tool", "function") or m.tool_calls or m.function_call is not None for m in body.messages)


def _specs(body: ChatCompletionRequest) -> tuple[list[ToolSpec], str]:
    if body.functions is not None:
        if body.tools is not None:
            raise invalid("Give tools or the legacy functions, not both.", "functions")
        return [ToolSpec(f) for f in body.functions], "functions"
    return list(body.tools or []), "tools"


def _tool(spec: ToolSpec, where: str, limits: SchemaLimits) -> Tool:
    if spec.type != "function":
        raise invalid(f"Only tools of type 'function' are supported, not {spec.type!r}.", f"{where}.type")
    fn: FunctionSpec = spec.function
    if not _NAME.match(fn.name):
        raise invalid(f"{fn.name!r} is not a valid function name: use 1 to 64 letters, digits, '_' or '-'.", f"{where}.function.name")
    parameters = _EMPTY_PARAMETERS if fn.parameters is None else fn.parameters
    problem = bounds_problem(parameters, limits)  # validity once every tool and the lot are within bounds (tool_plan)
    if problem is not None:
        raise invalid(f"The parameters of {fn.name!r} cannot be taken: {problem}.", f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":
        raise invalid(f"The parameters of {fn.name!r} must describe a JSON object.", f"{where}.function.parameters")
    return Tool(fn.name, fn.description or "", parameters)


def tool_plan(body: ChatCompletionRequest, fmt: Format) -> ToolPlan | None:
    """The tools and the choice a request makes, or None when it offers none."""
    specs, field = _specs(body)
    choice = body.function_call if field == "functions" else body.tool_choice
    choice_param = "function_call" if field == "functions" else "tool_choice"
    where = "functions[{}]" if field == "functions" else "tools[{}]"
    if not specs:
        if body.tools is not None or body.functions is not None:
            raise invalid(f"'{field}' must contain at least one tool.", field)
        if body.tool_choice is not None or body.function_call is not None:
            param = "tool_choice" if body.tool_choice is not None else "function_call"
            raise invalid(f"'{param}' is only allowed when tools are given.", param)
        return None
    mode: Mode = "auto"
    forced: str | None = None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required") or (field == "functions" and choice == "required"):
            raise invalid(f"{choice!r} is not a valid {choice_param}: use 'auto', 'none', 'required' or a named function.", choice_param)
        mode = choice  # type: ignore[assignment]
    elif choice is not None:
        if isinstance(choice, NamedToolChoice) and choice.type != "function":
            raise invalid(f"{choice_param} type must be 'function'.", f"{choice_param}.type")
        forced = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
        mode = "required"
    each, together = (SCHEMA_LIMITS, TOOLS_LIMITS) if mode == "required" else _FREE
    tools = tuple(_tool(spec, where.format(i), each) for i, spec in enumerate(specs))
    problem = bounds_problem({"anyOf": [t.parameters for t in tools]}, together)
    if problem is not None:
        raise invalid(f"Together, the tools' parameters go past a bound: {problem}.", field)
    for i, tool in enumerate(tools):
        problem = validity_problem(tool.parameters)
        if problem is not None:
            raise invalid(f"The parameters of {tool.name!r} cannot be taken: {problem}.", f"{where.format(i)}.function.parameters")
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"The function name {name!r} is given twice.", f"{where.format(i)}.function.name")
    if forced is not None and forced not in names:
        raise invalid(f"{choice_param} names the function {forced!r}, which is not among the tools.", choice_param)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolPlan(tools, mode, forced, parallel, fmt)


def _arguments(text: str, param: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested past Python's limit: a caller's string, refused like any other
        raise invalid("Tool call arguments must be a JSON object written as a string.", param) from None
    if not isinstance(value, dict):
        raise invalid("Tool call arguments must be a JSON object written as a string.", param)
    return value


def tool_turns(message: ChatMessage, i: int, content: str, calls_seen: dict[str, str]) -> dict[str, Any]:
    """One assistant or tool turn in the Hugging Face template shape (tool_calls with arguments as
    objects; tool results with their call's id). `calls_seen` maps each earlier call's id to its
    function's name; a result must answer one of them."""
    if message.role == "assistant":
        raw = list(message.tool_calls or [])
        calls = []
        for j, call in enumerate(raw):
            param = f"messages[{i}].tool_calls[{j}]"
            if call.type != "function":
                raise invalid("Only tool calls of type 'function' are supported.", f"{param}.type")
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, f"{param}.function.arguments")}})
            calls_seen[call.id] = call.function.name
        if message.function_call is not None:
            legacy_id = f"call_legacy_{i}"
            calls.append({"id": legacy_id, "type": "function", "function": {
                "name": message.function_call.name,
                "arguments": _arguments(message.function_call.arguments, f"messages[{i}].function_call.arguments")}})
            calls_seen[legacy_id] = message.function_call.name
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            out["tool_calls"] = calls
        return out
    if message.role == "function":  # legacy: answers the latest call of that name
        if not message.name:
            raise invalid("A function message needs the 'name' of the function it answers.", f"messages[{i}].name")
        match = [cid for cid, name in calls_seen.items() if name == message.name]
        if not match:
            raise invalid(f"No earlier assistant message calls the function {message.name!r}.", f"messages[{i}].name")
        return {"role": "tool", "content": content, "tool_call_id": match[-1], "name": message.name}
    if not message.tool_call_id:
        raise invalid("A tool message needs the 'tool_call_id' of the call it answers.", f"messages[{i}].tool_call_id")
    if message.tool_call_id not in calls_seen:
        raise invalid(f"The tool_call_id {message.tool_call_id!r} matches no tool call of an earlier assistant message.",
                      f"messages[{i}].tool_call_id")
    return {"role": "tool", "content": content, "tool_call_id": message.tool_call_id, "name": calls_seen[message.tool_call_id]}


def generic_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The chat for a template that knows nothing of tools: the tools and the call form in the
    system message, past calls written in that form, results as user turns. All of it is message
    text, so a caller's text in tools stays plain text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            written = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{written}" if m["content"] else written})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    if plan is not None and plan.offered:
        prompt = system_prompt(plan.offered)
        if plan.mode == "required":
            prompt += f"\n\nAnswer with a function call in {OPEN}{CLOSE} tags."
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
