"""OpenAI response shapes for chat and legacy completions, whole and streamed."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from appliance.api.errors import APIError
from appliance.api.translate import Prepared
from appliance.registry import LoadedModel
from appliance.tool_calls import ToolCall, argument_pieces, parse
from engines.base import FinishEvent, TokenLogprob

FINGERPRINT = "appliance-0.1"
_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _finish_reason(finish: FinishEvent, calls: bool = False) -> str:
    if calls:
        return "tool_calls"
    return "length" if finish.reason == "length" else "stop"


def _usage(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token_bytes),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in lp.top],
    }


def _completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


class Formatter:
    def __init__(self, kind: str, prepared: Prepared, model: str, created: int) -> None:
        self.kind, self.prepared, self.model, self.created = kind, prepared, model, created
        self.id = prepared.request.id
        self._offset = len(prepared.prompt_text) if prepared.echo else 0
        self.wants_logprobs = prepared.request.sampling.logprobs

    def _envelope(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "system_fingerprint": FINGERPRINT, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    def first_chunk(self, include_usage: bool) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        else:
            text = self.prepared.prompt_text if self.prepared.echo else ""
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return self._envelope([choice], include_usage)

    def delta_chunk(self, text: str, logprob: TokenLogprob | None, include_usage: bool) -> dict[str, Any]:
        if self.kind == "chat":
            lp = {"content": [_chat_logprob(logprob)]} if logprob is not None else None
            choice = {"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            lp = _completion_logprobs([logprob], self._offset) if logprob is not None else None
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
        self._offset += len(text)
        return self._envelope([choice], include_usage)

    def call_chunks(self, call: ToolCall, index: int, include_usage: bool) -> list[dict[str, Any]]:
        """A call as OpenAI streams one: its index, id, type and name with empty arguments, then
        the arguments in pieces (the SDK's stream helpers join them)."""
        first = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        deltas = [first] + [{"index": index, "function": {"arguments": p}} for p in argument_pieces(call.arguments)]
        return [self._envelope([{"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}], include_usage)
                for d in deltas]

    def finish_chunk(self, finish: FinishEvent, include_usage: bool, calls: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(finish, calls)}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": _finish_reason(finish)}
        return self._envelope([choice], include_usage)

    def usage_chunk(self, finish: FinishEvent) -> dict[str, Any]:
        out = self._envelope([], False)
        out["usage"] = _usage(finish)
        return out

    def full(self, text: str, logprobs: list[TokenLogprob], finish: FinishEvent) -> bytes:
        if self.kind == "chat":
            lp = {"content": [_chat_logprob(x) for x in logprobs]} if self.wants_logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            reason = _finish_reason(finish)
            if self.prepared.tools is not None:
                parsed = parse(text, self.prepared.tools)
                if parsed.calls:
                    message = {"role": "assistant", "content": parsed.content, "refusal": None,
                               "tool_calls": [c.wire() for c in parsed.calls]}
                    reason = _finish_reason(finish, True)
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": reason}
            obj = "chat.completion"
        else:
            prefix = self.prepared.prompt_text if self.prepared.echo else ""
            lp = _completion_logprobs(logprobs, len(prefix)) if self.wants_logprobs else None
            choice = {"index": 0, "text": prefix + text, "logprobs": lp, "finish_reason": _finish_reason(finish)}
            obj = "text_completion"
        return _encoder.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "system_fingerprint": FINGERPRINT, "choices": [choice], "usage": _usage(finish)})


def model_entry(model: LoadedModel, created: int) -> dict[str, Any]:
    s = model.settings
    return {
        "id": s.alias, "object": "model", "created": created, "owned_by": "appliance",
        "meta": {"engine": model.engine.name, "kind": s.kind, "tier": s.tier, "context_length": model.engine.context_length,
                 "slots": s.slots, "price_input_per_mtok": s.price_input_per_mtok, "price_output_per_mtok": s.price_output_per_mtok},
    }


def model_list(models: list[LoadedModel], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m, created) for m in models]}


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    # base64 of little-endian float32, which the OpenAI SDK asks for by default
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode() if encoding == "base64" else vector


def embedding_list(vectors: list[list[float]], model: str, prompt_tokens: int, encoding: str = "float") -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)} for i, v in enumerate(vectors)]
    return _encoder.encode({"object": "list", "data": data, "model": model,
                            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


class ChatWire:
    """The call's Wire for chat and legacy completions: chunks, then `[DONE]`."""

    def __init__(self, fmt: Formatter, include_usage: bool) -> None:
        self.fmt, self.include_usage = fmt, include_usage
        self.calls = False  # any tool call streamed: the finish reason is tool_calls

    def full(self, text: str, logprobs: list[TokenLogprob], finish: FinishEvent) -> bytes:
        return self.fmt.full(text, logprobs, finish)

    def opening(self) -> list[bytes]:
        return [sse(self.fmt.first_chunk(self.include_usage))]

    def delta(self, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        return [sse(self.fmt.delta_chunk(text, logprob, self.include_usage))]

    def tool_call(self, call: ToolCall, index: int) -> list[bytes]:
        self.calls = True
        return [sse(chunk) for chunk in self.fmt.call_chunks(call, index, self.include_usage)]

    def closing(self, finish: FinishEvent) -> list[bytes]:
        frames = [sse(self.fmt.finish_chunk(finish, self.include_usage, self.calls))]
        if self.include_usage:
            frames.append(sse(self.fmt.usage_chunk(finish)))
        return [*frames, DONE]

    def failed(self, error: APIError, finish: FinishEvent) -> list[bytes]:
        # The error in the envelope, the usage it was charged, [DONE].
        frames = [sse(error.body())]
        if self.include_usage:
            frames.append(sse(self.fmt.usage_chunk(finish)))
        return [*frames, DONE]


def chat_wire(kind: str, stream_options: Any = None) -> Callable[[Prepared, str, int], ChatWire]:
    """The wire factory for a chat (or completion) request with these stream options."""
    include_usage = bool(stream_options and stream_options.include_usage)
    return lambda prepared, model, created: ChatWire(Formatter(kind, prepared, model, created), include_usage)
