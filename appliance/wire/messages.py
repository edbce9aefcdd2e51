"""Anthropic's Messages API wire format: the message object, its SSE event sequence
(message_start, content blocks opened, filled and stopped, message_delta, message_stop), and
Anthropic's error envelope, for the call module's `Wire`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from appliance.pipeline.choices import Collected
from appliance.pipeline.errors import APIError
from appliance.pipeline.prepare import Prepared
from appliance.prompt.tool_calls import ToolCall, answer_calls, argument_pieces
from engines.interface import FinishEvent, TokenLogprob

_encoder = msgspec.json.Encoder()

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_envelope(error: APIError) -> dict[str, Any]:
    """Anthropic's error body; `request_id` is where its SDK looks for the id to quote."""
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def usage(finish: FinishEvent) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from cache apart from the others; every field its
    schema requires is there, null where this box has nothing to say (no server tools, no region)."""
    u = finish.usage
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_prompt_tokens, "output_tokens": u.completion_tokens, "cache_creation": None,
            "inference_geo": None, "output_tokens_details": None, "server_tool_use": None, "service_tier": "standard"}


def stop_reason(finish: FinishEvent, calls: bool) -> str:
    if calls:
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments if isinstance(arguments, dict) else {},
            "caller": {"type": "direct"}}


class MessagesWire:
    """One message, whole or as its events. A Messages request asks for one answer: choice 0.
    Streamed, a text block opens at the answer's first text, and each tool call is a block of its
    own, opened, filled and stopped as it completes."""

    media_type = "text/event-stream"

    def __init__(self, prepared: Prepared, model: str, created: int) -> None:
        self.id, self.model, self.tools = prepared.request.id, model, prepared.tools
        self.prompt_tokens = prepared.request.prompt_length
        self._blocks = 0  # content blocks opened so far
        self._open: tuple[str, int] | None = None  # the text or thinking block open now: its type and index
        self._calls = False

    def _message(self, content: list[dict[str, Any]], finish: FinishEvent | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(finish, self._calls) if finish is not None else None,
                "stop_sequence": finish.stop_sequence if finish is not None else None, "stop_details": None, "container": None,
                "usage": usage(finish) if finish is not None else {"input_tokens": self.prompt_tokens, "output_tokens": 0}}

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        (answer,) = choices
        text, calls = answer_calls(answer.text, self.tools)
        self._calls = bool(calls)
        thinking = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
        content = ([{"type": "text", "text": text, "citations": None}] if text or not calls else []) + [_tool_use(c) for c in calls]
        return _encoder.encode(self._message(thinking + content, total))

    def opening(self, choices: int) -> list[bytes]:
        assert choices == 1
        return [event({"type": "message_start", "message": self._message([], None)}), event({"type": "ping"})]

    def _opened(self, kind: str) -> tuple[list[bytes], int]:
        """A block of `kind` ("text" or "thinking") open, the other closed first; its index."""
        if self._open is not None and self._open[0] == kind:
            return [], self._open[1]
        frames = self._close_block()
        at, self._blocks = self._blocks, self._blocks + 1
        self._open = (kind, at)
        block = {"type": "text", "text": "", "citations": None} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
        return [*frames, event({"type": "content_block_start", "index": at, "content_block": block})], at

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        (kind, at), self._open = self._open, None
        # A thinking block ends with its signature: none here (it is checked only by Anthropic's own servers).
        signed = [event({"type": "content_block_delta", "index": at, "delta": {"type": "signature_delta", "signature": ""}})]
        return [*(signed if kind == "thinking" else []), event({"type": "content_block_stop", "index": at})]

    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        if not text:
            return []
        frames, at = self._opened("text")
        return [*frames, event({"type": "content_block_delta", "index": at, "delta": {"type": "text_delta", "text": text}})]

    def reasoning(self, index: int, text: str) -> list[bytes]:
        frames, at = self._opened("thinking")
        return [*frames, event({"type": "content_block_delta", "index": at, "delta": {"type": "thinking_delta", "thinking": text}})]

    def tool_call(self, index: int, call: ToolCall, position: int) -> list[bytes]:
        frames = self._close_block()
        at, self._blocks, self._calls = self._blocks, self._blocks + 1, True
        block = {**_tool_use(call), "input": {}}
        frames.append(event({"type": "content_block_start", "index": at, "content_block": block}))
        frames.extend(event({"type": "content_block_delta", "index": at, "delta": {"type": "input_json_delta", "partial_json": piece}})
                      for piece in argument_pieces(json.dumps(_tool_use(call)["input"])))
        frames.append(event({"type": "content_block_stop", "index": at}))
        return frames

    def closing(self, index: int, finish: FinishEvent) -> list[bytes]:
        # An empty answer is still one (empty) text block; so is one that only reasoned.
        opened = self._opened("text")[0] if self._blocks == 0 or (self._open is not None and self._open[0] == "thinking") else []
        return [*opened, *self._close_block()]

    def ending(self, total: FinishEvent) -> list[bytes]:
        return [event({"type": "message_delta", "delta": {"stop_reason": stop_reason(total, self._calls),
                                                          "stop_sequence": total.stop_sequence}, "usage": usage(total)}),
                event({"type": "message_stop"})]

    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]:
        return [event(error_envelope(error))]

    def keepalive(self) -> list[bytes]:
        return [event({"type": "ping"})]


def messages_wire(prepared: Prepared, model: str, created: int) -> MessagesWire:
    return MessagesWire(prepared, model, created)
