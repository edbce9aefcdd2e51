"""The Responses API's wire format: the response object, and the typed SSE events the official
SDK parses (each with its sequence number), for the call module's `Wire`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.api.choices import Collected
from appliance.api.errors import APIError
from appliance.api.responses_translate import Message, conversation_turn, message_item, new_id, output_items, output_text_part
from appliance.api.schemas import ResponsesRequest
from appliance.api.translate import Prepared
from engines.base import FinishEvent, TokenLogprob

_encoder = msgspec.json.Encoder()

# (the response object, the conversation it ends) once an answer is complete: where it is stored.
Save = Callable[[dict[str, Any], list[Message]], None]


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def usage(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.total_tokens}


def _error_code(error: APIError) -> str:
    # ResponseError.code is an enumeration; the nearest of its values.
    return "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 else "invalid_prompt"


@dataclass(frozen=True)
class Echo:
    """What a response object repeats of its request."""

    instructions: str | None
    metadata: dict[str, str]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    text: dict[str, Any]
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    truncation: str
    store: bool
    user: str | None
    service_tier: str
    safety_identifier: str | None
    prompt_cache_key: str | None
    frequency_penalty: float
    presence_penalty: float

    @classmethod
    def of(cls, body: ResponsesRequest, temperature: float, top_p: float) -> Echo:
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return cls(body.instructions, body.metadata or {}, temperature, top_p, body.max_output_tokens, body.previous_response_id,
                   {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}}, body.tools or [],
                   body.tool_choice or "auto", body.parallel_tool_calls, body.truncation or "disabled", body.store, body.user,
                   body.service_tier or "default", body.safety_identifier, body.prompt_cache_key,
                   body.frequency_penalty or 0.0, body.presence_penalty or 0.0)


def _status(finish: FinishEvent) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


class ResponsesWire:
    """One response, whole or as its events. `save` is called once with the finished object.
    A Responses request asks for one answer (no `n`): its message is choice 0, output item 0."""

    def __init__(self, prepared: Prepared, model: str, created: int, echo: Echo, turns: list[Message], save: Save | None) -> None:
        self.id, self.model, self.created, self.echo = prepared.request.id, model, created, echo
        self.turns, self.save = turns, save
        self.message_id = new_id("msg")
        self._sequence = 0
        self._text: list[str] = []

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._sequence
        self._sequence += 1
        return event(payload)

    def response(self, status: str, output: list[dict[str, Any]], finish: FinishEvent | None = None,
                  error: APIError | None = None) -> dict[str, Any]:
        e = self.echo
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": _error_code(error), "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": e.parallel_tool_calls, "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": e.store, "temperature": e.temperature, "text": e.text,
            "tool_choice": e.tool_choice, "tools": e.tools, "top_p": e.top_p, "truncation": e.truncation,
            "usage": usage(finish) if finish is not None else None, "user": e.user, "metadata": e.metadata,
            # What this server does not do, said as the Open Responses schema requires it said.
            "background": False, "frequency_penalty": e.frequency_penalty, "presence_penalty": e.presence_penalty, "top_logprobs": 0,
            "max_tool_calls": None,
            "service_tier": e.service_tier, "safety_identifier": e.safety_identifier, "prompt_cache_key": e.prompt_cache_key,
        }

    def _finished(self, text: str, finish: FinishEvent) -> dict[str, Any]:
        status = _status(finish)
        body = self.response(status, output_items(text, [], status, self.message_id), finish)
        if self.save is not None:
            self.save(body, [*self.turns, conversation_turn(text, [])])
        return body

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        (answer,) = choices
        return _encoder.encode(self._finished(answer.text, total))

    def opening(self, choices: int) -> list[bytes]:
        assert choices == 1
        created = self.response("in_progress", [])
        return [
            self._event({"type": "response.created", "response": created}),
            self._event({"type": "response.in_progress", "response": created}),
            self._event({"type": "response.output_item.added", "output_index": 0, "item": message_item(self.message_id, None, "in_progress")}),
            self._event({"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": self.message_id,
                         "part": output_text_part("")}),
        ]

    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        if not text:
            return []
        self._text.append(text)
        return [self._event({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": self.message_id,
                             "delta": text, "logprobs": []})]

    def closing(self, index: int, finish: FinishEvent) -> list[bytes]:
        text = "".join(self._text)
        item = output_items(text, [], _status(finish), self.message_id)[0]
        return [
            self._event({"type": "response.output_text.done", "output_index": 0, "content_index": 0, "item_id": self.message_id,
                         "text": text, "logprobs": []}),
            self._event({"type": "response.content_part.done", "output_index": 0, "content_index": 0, "item_id": self.message_id,
                         "part": item["content"][0]}),
            self._event({"type": "response.output_item.done", "output_index": 0, "item": item}),
        ]

    def ending(self, total: FinishEvent) -> list[bytes]:
        body = self._finished("".join(self._text), total)
        return [self._event({"type": f"response.{body['status']}", "response": body})]

    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]:
        partial = "".join(self._text)
        output = [message_item(self.message_id, partial, "incomplete")] if partial else []
        return [
            self._event({"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param}),
            self._event({"type": "response.failed", "response": self.response("failed", output, total, error)}),
        ]
