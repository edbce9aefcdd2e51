"""Ollama's API wire format: /api/chat and /api/generate answers, whole or as NDJSON lines (one
JSON object a line, the last with `done: true`, why it ended and the counts and durations in
nanoseconds), the model listings (/api/tags, /api/ps, /api/show) and Ollama's error body,
`{"error": "..."}`, for the call module's `Wire`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import msgspec

from appliance.pipeline.choices import Collected
from appliance.pipeline.errors import APIError
from appliance.pipeline.prepare import Prepared
from appliance.prompt.tool_calls import ToolCall, answer_calls
from engines.interface import FinishEvent, TokenLogprob

_encoder = msgspec.json.Encoder()
NDJSON = "application/x-ndjson"
# The Ollama API level this server speaks (VS Code's Ollama provider wants 0.6.4 or later).
VERSION = "0.13.0"


def error_envelope(error: APIError) -> dict[str, Any]:
    return {"error": error.message}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)


def done(total: FinishEvent) -> dict[str, Any]:
    """The last line's fields: why the answer ended, and Ollama's counts and durations."""
    first = total.time_to_first_token_s or 0.0
    return {"done": True, "done_reason": "length" if total.reason == "length" else "stop", "total_duration": _ns(total.total_time_s),
            "load_duration": 0, "prompt_eval_count": total.usage.prompt_tokens, "prompt_eval_duration": _ns(first),
            "eval_count": total.usage.completion_tokens, "eval_duration": _ns(max(0.0, total.total_time_s - first))}


def _call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"id": call.id, "function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}}


class OllamaWire:
    """One /api/chat (`message`) or /api/generate (`response`) answer. A request asks one answer:
    choice 0. Streamed, each piece of text is a line, each tool call a line of its own."""

    media_type = NDJSON

    def __init__(self, prepared: Prepared, model: str, created: int, kind: Literal["chat", "generate"]) -> None:
        self.model, self.kind, self.tools = model, kind, prepared.tools

    def _line(self, payload: dict[str, Any]) -> bytes:
        return _encoder.encode(payload) + b"\n"

    def _piece(self, text: str, calls: list[dict[str, Any]] | None = None, thinking: str = "") -> dict[str, Any]:
        head: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.kind == "generate":
            return {**head, "response": text, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {**head, "message": message}

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        (answer,) = choices
        text, calls = answer_calls(answer.text, self.tools)
        return _encoder.encode({**self._piece(text, [_call(c) for c in calls], answer.reasoning), **done(total)})

    def opening(self, choices: int) -> list[bytes]:
        assert choices == 1
        return []

    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        return [self._line({**self._piece(text), "done": False})] if text else []

    def reasoning(self, index: int, text: str) -> list[bytes]:
        return [self._line({**self._piece("", thinking=text), "done": False})]

    def tool_call(self, index: int, call: ToolCall, position: int) -> list[bytes]:
        return [self._line({**self._piece("", [_call(call)]), "done": False})]

    def closing(self, index: int, finish: FinishEvent) -> list[bytes]:
        return []

    def ending(self, total: FinishEvent) -> list[bytes]:
        return [self._line({**self._piece(""), **done(total)})]

    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]:
        return [self._line(error_envelope(error))]

    def keepalive(self) -> list[bytes]:
        return []  # NDJSON has no comment line; Ollama's clients wait for the first line without a timer


def chat_wire(prepared: Prepared, model: str, created: int) -> OllamaWire:
    return OllamaWire(prepared, model, created, "chat")


def generate_wire(prepared: Prepared, model: str, created: int) -> OllamaWire:
    return OllamaWire(prepared, model, created, "generate")


def lifecycle_answer(model: str, kind: Literal["chat", "generate"], reason: Literal["load", "unload"]) -> dict[str, Any]:
    """An empty request's answer: the model was loaded (or unloaded), nothing was asked of it."""
    piece: dict[str, Any] = {"response": ""} if kind == "generate" else {"message": {"role": "assistant", "content": ""}}
    return {"model": model, "created_at": now(), **piece, "done_reason": reason, "done": True}
