"""Anthropic's Messages API request (POST /v1/messages) as msgspec structs, and the chat request
that answers it: the server serves one request flow (appliance/pipeline/flow.py), so a Messages
request is asked as chat and only its wire differs.

Unknown fields are ignored, as on the OpenAI side; a field that would change the answer and that
no served model implements (images, documents, server tools, MCP servers, a container) is a 400
naming it."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from appliance.pipeline.errors import invalid
from appliance.wire.decode import from_validation
from appliance.wire.schemas import ChatCompletionRequest


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str
    cache_control: Any = None  # the prefix cache reuses any prompt it has seen: nothing to mark
    citations: Any = None


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: Any = None
    cache_control: Any = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    source: Any = None
    cache_control: Any = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolReferenceBlock(msgspec.Struct, tag_field="type", tag="tool_reference", kw_only=True):
    """A tool named in a tool result (a tool search's answer): the model reads its name."""

    tool_name: str
    cache_control: Any = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock] | None = None
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", kw_only=True):
    data: str


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageParam(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]  # a system turn between others, as Claude Code sends one
    content: str | list[Block]


class ToolParam(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # None: a server tool (web search, bash, ...), refused
    type: str | None = None  # "custom", or a server tool's versioned type
    cache_control: Any = None


class ToolChoiceParam(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None  # an allowance for reasoning, as thinking is: a model that does not reason answers directly


class ContextEdit(msgspec.Struct, kw_only=True):
    type: str  # clear_thinking_20251015, clear_tool_uses_20250919, ...


class ContextManagement(msgspec.Struct, kw_only=True):
    edits: list[ContextEdit] = []


class MetadataParam(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Sampling: today's SDK no longer sends these, earlier clients (and LiteLLM's) do.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: MetadataParam | None = None
    # `adaptive` lets the model decide whether to think: one that does not reason answers directly.
    # `enabled` requires thinking, which no served model does: a 400 (docs/api.md).
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    # One box: no tier, speed, region or workspace to choose; its prefix cache reuses any prompt
    # it has seen, so there is nothing to mark for caching.
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None
    cache_control: Any = None
    diagnostics: Any = None
    # Would change the answer, and are not served: declared to be refused by name.
    container: Any = None
    mcp_servers: Any = None
    # Clearing earlier thinking changes nothing here (it is never read back); clearing tool results would.
    context_management: ContextManagement | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens: what a Messages request would send to the model."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    mcp_servers: Any = None

    def asked(self) -> MessagesRequest:
        return MessagesRequest(model=self.model, max_tokens=1, messages=self.messages, system=self.system, tools=self.tools,
                               tool_choice=self.tool_choice, thinking=self.thinking, output_config=self.output_config,
                               output_format=self.output_format, mcp_servers=self.mcp_servers)


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers a Messages request."""
    _check(body)
    messages: list[dict[str, Any]] = []
    system = _system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, f"messages.{i}"))
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences,
        "user": body.metadata.user_id if body.metadata is not None else None,
        # A reasoning model thinks unless told not to; "disabled" turns it off where its template can.
        "reasoning_effort": "none" if body.thinking is not None and body.thinking.type == "disabled" else None,
    }
    fmt = body.output_config.format if body.output_config is not None and body.output_config.format is not None else body.output_format
    if fmt is not None:  # structured outputs: the answer is JSON that meets the schema
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                         for t in body.tools]
        if body.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(body.tool_choice)
            chat["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    try:
        return msgspec.convert({k: v for k, v in chat.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None


def _check(body: MessagesRequest) -> None:
    if body.max_tokens < 1:
        raise invalid(f"max_tokens: {body.max_tokens} is not valid; it must be at least 1.", "max_tokens")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise invalid(f"temperature: {body.temperature} is not valid; it must be between 0 and 1.", "temperature")
    if not body.messages:
        raise invalid("messages: at least one message is required.", "messages")
    if body.thinking is not None and body.thinking.type == "enabled":
        raise invalid("thinking: 'enabled' sets a budget_tokens this server cannot hold a model to; send 'adaptive' (a "
                      "reasoning model thinks, in a thinking block, as long as it needs), 'disabled', or leave thinking out.",
                      "thinking.type")
    for name in ("container", "mcp_servers"):
        if getattr(body, name) is not None:
            raise invalid(f"{name}: not supported by this server; the answer would not be what was asked.", name)
    for i, edit in enumerate(body.context_management.edits if body.context_management is not None else []):
        if not edit.type.startswith("clear_thinking"):
            raise invalid(f"context_management.edits.{i}: '{edit.type}' is not supported by this server; only clearing thinking "
                          "(which it never reads back) is.", f"context_management.edits.{i}")
    for i, tool in enumerate(body.tools or []):
        if tool.input_schema is None or tool.type not in (None, "custom"):
            raise invalid(f"tools.{i}: the server tool '{tool.name}' ({tool.type}) is not supported; declare a custom tool with "
                          "an input_schema.", f"tools.{i}")
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise invalid("tool_choice.name: a tool choice of type 'tool' names the tool.", "tool_choice.name")
        if not body.tools and choice.type in ("any", "tool"):
            raise invalid(f"tool_choice: '{choice.type}' needs tools.", "tool_choice")
        if choice.type == "tool" and choice.name not in {t.name for t in body.tools or []}:
            raise invalid(f"tool_choice.name: '{choice.name}' is not one of the tools.", "tool_choice.name")


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(block.text for block in system)


def _chat_messages(message: MessageParam, where: str) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: a user turn's tool results become tool messages (which
    follow the assistant's calls in chat), its text one user message; an assistant turn is one
    message with its text and its calls. Earlier thinking is left out: the served models do not
    read it back."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "system":
        if any(not isinstance(block, TextBlock) for block in message.content):
            raise invalid(f"{where}.content: a system turn holds text blocks only.", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise invalid(f"{at}: {'images' if isinstance(block, ImageBlock) else 'documents'} are not supported; "
                          "the served models read text.", at)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise invalid(f"{at}: tool_use blocks belong to assistant turns.", at)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise invalid(f"{at}: tool_result blocks belong to user turns.", at)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, at)})
    out = results
    if message.role == "system":
        out.append({"role": "system", "content": "\n\n".join(texts)})
    elif message.role == "assistant":
        out.append({"role": "assistant", "content": "\n\n".join(texts) or None, **({"tool_calls": calls} if calls else {})})
    elif texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _result_text(block: ToolResultBlock, at: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        if any(isinstance(part, (ImageBlock, DocumentBlock)) for part in content):
            raise invalid(f"{at}.content: only text and tool references are supported in a tool result.", f"{at}.content")
        text = "\n\n".join(part.text if isinstance(part, TextBlock) else f"Tool: {part.tool_name}" for part in content)  # type: ignore[union-attr]
    # The chat template has no place for Anthropic's flag: the model reads it in the text.
    return f"Error: {text}" if block.is_error else text


def _tool_choice(choice: ToolChoiceParam) -> str | dict[str, Any]:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
