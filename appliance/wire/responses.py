"""The Responses API's wire format: the response object, and the typed SSE events the official
SDK parses (each with its sequence number), for the call module's `Wire`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.pipeline.choices import Collected
from appliance.pipeline.errors import APIError
from appliance.wire.responses_input import (
    Message,
    conversation_turn,
    function_call_events,
    function_call_item,
    message_item,
    namespaces,
    new_id,
    output_items,
    output_text_part,
)
from appliance.pipeline.prepare import Prepared
from appliance.prompt.tool_calls import ToolCall, answer_calls, argument_pieces
from appliance.wire.openai import KEEPALIVE
from appliance.wire.schemas import ResponsesRequest
from engines.interface import FinishEvent, TokenLogprob

_encoder = msgspec.json.Encoder()

# (the response object, the conversation it ends) once an answer is complete: where it is stored.
Save = Callable[[dict[str, Any], list[Message]], None]


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def usage(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}


_REASONING = "reasoning"  # the streamed items' marker for the reasoning item (None marks the message)


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning model's reasoning as an output item: its text in full (no summary is written)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "encrypted_content": None, "status": status}


def _error_code(error: APIError) -> str:
    # ResponseError.code is an enumeration; the nearest of its values.
    return "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 else "invalid_prompt"


def _echoed(tool: Any) -> Any:
    """A function tool as the response object shows it: every field present, null where not given."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"), "parameters": tool.get("parameters"),
            "strict": tool.get("strict"), **{k: v for k, v in tool.items() if k not in ("type", "name", "description", "parameters", "strict")}}


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
                   {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}}, [_echoed(t) for t in body.tools or []],
                   body.tool_choice or "auto", body.parallel_tool_calls, body.truncation or "disabled", body.store, body.user,
                   body.service_tier or "default", body.safety_identifier, body.prompt_cache_key,
                   body.frequency_penalty or 0.0, body.presence_penalty or 0.0)


def _status(finish: FinishEvent) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


class ResponsesWire:
    """One response, whole or as its events. `save` is called once with the finished object.
    A Responses request asks for one answer (no `n`): choice 0. Streamed, its output items open in
    the order the answer brings them: the message at its first text (or at the end, when nothing
    else came), each function call whole as it completes."""

    media_type = "text/event-stream"

    def __init__(self, prepared: Prepared, model: str, created: int, echo: Echo, turns: list[Message], save: Save | None) -> None:
        self.id, self.model, self.created, self.echo = prepared.request.id, model, created, echo
        self.turns, self.save, self.tools = turns, save, prepared.tools
        self.message_id = new_id("msg")
        self.reasoning_id = new_id("rs")
        self._thought: list[str] = []
        self._thinking = False  # the reasoning item is open
        self.declared = namespaces(echo.tools)  # whose functions' calls are named as namespace and name
        self._sequence = 0
        self._text: list[str] = []
        self._order: list[dict[str, Any] | str | None] = []  # streamed items: a chat tool call, _REASONING, or None for the message
        self._calls: list[dict[str, Any]] = []

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

    def _finished(self, text: str, calls: list[dict[str, Any]], finish: FinishEvent,
                  items: Callable[[str], list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        status = _status(finish)
        output = items(status) if items is not None else output_items(text, calls, status, self.message_id, self.declared)
        body = self.response(status, output, finish)
        if self.save is not None:
            self.save(body, [*self.turns, conversation_turn(text, calls)])
        return body

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        (answer,) = choices
        text, found = answer_calls(answer.text, self.tools)
        calls = [c.wire() for c in found]
        if not answer.reasoning:
            return _encoder.encode(self._finished(text, calls, total))
        thought = reasoning_item(self.reasoning_id, answer.reasoning, "completed")
        items = lambda status: [thought, *output_items(text, calls, status, self.message_id, self.declared)]  # noqa: E731
        return _encoder.encode(self._finished(text, calls, total, items))

    def opening(self, choices: int) -> list[bytes]:
        assert choices == 1
        created = self.response("in_progress", [])
        return [
            self._event({"type": "response.created", "response": created}),
            self._event({"type": "response.in_progress", "response": created}),
        ]

    def reasoning(self, index: int, text: str) -> list[bytes]:
        frames = []
        if _REASONING not in self._order:
            self._order.append(_REASONING)
            self._thinking = True
            frames.append(self._event({"type": "response.output_item.added", "output_index": self._order.index(_REASONING),
                                       "item": reasoning_item(self.reasoning_id, None, "in_progress")}))
        self._thought.append(text)
        return [*frames, self._event({"type": "response.reasoning_text.delta", "output_index": self._order.index(_REASONING),
                                      "content_index": 0, "item_id": self.reasoning_id, "delta": text})]

    def _close_reasoning(self, status: str = "completed") -> list[bytes]:
        """The reasoning item done, before anything else of the answer opens."""
        if not self._thinking:
            return []
        self._thinking = False
        at, text = self._order.index(_REASONING), "".join(self._thought)
        return [self._event({"type": "response.reasoning_text.done", "output_index": at, "content_index": 0, "item_id": self.reasoning_id,
                             "text": text}),
                self._event({"type": "response.output_item.done", "output_index": at, "item": reasoning_item(self.reasoning_id, text, status)})]

    def _open_message(self) -> list[bytes]:
        if None in self._order:
            return []
        closed = self._close_reasoning()
        self._order.append(None)
        index = self._order.index(None)
        return [
            *closed,
            self._event({"type": "response.output_item.added", "output_index": index, "item": message_item(self.message_id, None, "in_progress")}),
            self._event({"type": "response.content_part.added", "output_index": index, "content_index": 0, "item_id": self.message_id,
                         "part": output_text_part("")}),
        ]

    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        if not text:
            return []
        frames = self._open_message()
        self._text.append(text)
        return [*frames, self._event({"type": "response.output_text.delta", "output_index": self._order.index(None), "content_index": 0,
                                      "item_id": self.message_id, "delta": text, "logprobs": []})]

    def tool_call(self, index: int, call: ToolCall, position: int) -> list[bytes]:
        closed = self._close_reasoning()
        wired = call.wire()
        self._calls.append(wired)
        self._order.append(wired)
        events = function_call_events(len(self._order) - 1, wired, argument_pieces(call.arguments), self.declared)
        return [*closed, *(self._event(e) for e in events)]

    def _item(self, item: dict[str, Any] | str | None, text: str, status: str) -> dict[str, Any]:
        if item is None:
            return message_item(self.message_id, text, status)
        if item == _REASONING:
            return reasoning_item(self.reasoning_id, "".join(self._thought), "completed")
        assert isinstance(item, dict)
        return function_call_item(item, status, declared=self.declared)

    def _items(self, text: str) -> Callable[[str], list[dict[str, Any]]]:
        """The streamed items, in their stream's order, as the finished response lists them."""
        return lambda status: [self._item(item, text, status) for item in self._order]

    def closing(self, index: int, finish: FinishEvent) -> list[bytes]:
        # An empty answer is still a message; so is one that only reasoned.
        frames = self._open_message() if not self._order or self._order == [_REASONING] else []
        if None not in self._order:
            return frames
        text = "".join(self._text)
        at = self._order.index(None)
        item = message_item(self.message_id, text, _status(finish))
        return [
            *frames,
            self._event({"type": "response.output_text.done", "output_index": at, "content_index": 0, "item_id": self.message_id,
                         "text": text, "logprobs": []}),
            self._event({"type": "response.content_part.done", "output_index": at, "content_index": 0, "item_id": self.message_id,
                         "part": item["content"][0]}),
            self._event({"type": "response.output_item.done", "output_index": at, "item": item}),
        ]

    def ending(self, total: FinishEvent) -> list[bytes]:
        text = "".join(self._text)
        body = self._finished(text, self._calls, total, self._items(text))
        return [self._event({"type": f"response.{body['status']}", "response": body})]

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE]

    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]:
        partial = "".join(self._text)
        output = [self._item(item, partial, "incomplete" if item is None else "completed") for item in self._order if item is not None or partial]
        return [
            self._event({"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param}),
            self._event({"type": "response.failed", "response": self.response("failed", output, total, error)}),
        ]
