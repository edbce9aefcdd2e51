"""OpenAI response shapes for chat and legacy completions, whole and streamed."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from appliance.fleet.registry import LoadedModel
from appliance.pipeline.choices import Collected
from appliance.pipeline.errors import APIError
from appliance.pipeline.prepare import Prepared
from appliance.prompt.tool_calls import ToolCall, argument_pieces, parse
from engines.interface import FinishEvent, TokenLogprob

FINGERPRINT = "appliance-0.1"
_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"  # an SSE comment: every client skips it


def error_envelope(error: APIError) -> dict[str, object]:
    """OpenAI's error body: every error the HTTP layer answers with, and an error that ends a stream."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _finish_reason(finish: FinishEvent, calls: bool = False) -> str:
    if calls:
        return "tool_calls"
    return "length" if finish.reason == "length" else "stop"


def _usage(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def _reasoning_fields(text: str) -> dict[str, str]:
    """A reasoning model's reasoning on a chat message or delta: `reasoning_content` (DeepSeek's
    API, llama-server, most clients) and `reasoning` (vLLM's newer name); both, for either client."""
    return {"reasoning_content": text, "reasoning": text} if text else {}


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
        # Per choice (n > 1): where the next completion logprob's text_offset counts from.
        self._offsets: dict[int, int] = {}
        self._start = len(prepared.prompt_text) if prepared.echo else 0
        self.wants_logprobs = prepared.request.sampling.logprobs

    def _envelope(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "system_fingerprint": FINGERPRINT, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    def first_chunk(self, include_usage: bool, index: int = 0) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        else:
            text = self.prepared.prompt_text if self.prepared.echo else ""
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return self._envelope([choice], include_usage)

    def delta_chunk(self, text: str, logprob: TokenLogprob | None, include_usage: bool, index: int = 0) -> dict[str, Any]:
        offset = self._offsets.get(index, self._start)
        if self.kind == "chat":
            lp = {"content": [_chat_logprob(logprob)]} if logprob is not None else None
            choice = {"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            lp = _completion_logprobs([logprob], offset) if logprob is not None else None
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
        self._offsets[index] = offset + len(text)
        return self._envelope([choice], include_usage)

    def reasoning_chunk(self, text: str, include_usage: bool, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": _reasoning_fields(text), "logprobs": None, "finish_reason": None}
        return self._envelope([choice], include_usage)

    def call_chunks(self, call: ToolCall, position: int, include_usage: bool, index: int = 0) -> list[dict[str, Any]]:
        """Choice `index`'s call number `position` as OpenAI streams one: its position, id, type and
        name with empty arguments, then the arguments in pieces (the SDK's stream helpers join them)."""
        first = {"index": position, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        deltas = [first] + [{"index": position, "function": {"arguments": p}} for p in argument_pieces(call.arguments)]
        return [self._envelope([{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}], include_usage)
                for d in deltas]

    def finish_chunk(self, finish: FinishEvent, include_usage: bool, index: int = 0, calls: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(finish, calls)}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": _finish_reason(finish)}
        return self._envelope([choice], include_usage)

    def usage_chunk(self, finish: FinishEvent) -> dict[str, Any]:
        out = self._envelope([], False)
        out["usage"] = _usage(finish)
        return out

    def _message(self, c: Collected) -> tuple[dict[str, Any], str]:
        """A chat choice's message and finish reason: calls read out of its text when tools were offered."""
        parsed = parse(c.text, self.prepared.tools) if self.prepared.tools is not None else None
        thought = _reasoning_fields(c.reasoning)
        if parsed is not None and parsed.calls:
            return ({"role": "assistant", "content": parsed.content, **thought, "refusal": None, "annotations": [],
                     "tool_calls": [t.wire() for t in parsed.calls]}, _finish_reason(c.finish, True))
        return {"role": "assistant", "content": c.text, **thought, "refusal": None, "annotations": []}, _finish_reason(c.finish)

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        """The whole response: choice i from choices[i]; usage from `total` (all choices together)."""
        out = []
        for index, c in enumerate(choices):
            if self.kind == "chat":
                lp = {"content": [_chat_logprob(x) for x in c.logprobs]} if self.wants_logprobs else None
                message, reason = self._message(c)
                out.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                prefix = self.prepared.prompt_text if self.prepared.echo else ""
                lp = _completion_logprobs(c.logprobs, len(prefix)) if self.wants_logprobs else None
                out.append({"index": index, "text": prefix + c.text, "logprobs": lp, "finish_reason": _finish_reason(c.finish)})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return _encoder.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "system_fingerprint": FINGERPRINT, "choices": out, "usage": _usage(total)})


def model_entry(model: LoadedModel, created: int) -> dict[str, Any]:
    s = model.settings
    return {
        "id": s.alias, "object": "model", "created": created, "owned_by": "appliance",
        "meta": {"engine": model.engine.name, "kind": s.kind, "tier": s.tier, "context_length": model.engine.context_length,
                 "slots": s.slots, "price_input_per_mtok": s.price_input_per_mtok, "price_output_per_mtok": s.price_output_per_mtok},
    }


def model_list(models: list[LoadedModel], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m, created) for m in models]}


def _encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    # base64 of little-endian float32, which the OpenAI SDK asks for by default
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()


def embedding_list(vectors: np.ndarray, model: str, prompt_tokens: int, encoding: str = "float") -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)} for i, v in enumerate(vectors)]
    return _encoder.encode({"object": "list", "data": data, "model": model,
                            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


class ChatWire:
    """The call's Wire for chat and legacy completions: chunks naming their choice's index, then
    the usage chunk (when asked for: once, for every choice) and `[DONE]`."""

    media_type = "text/event-stream"

    def __init__(self, fmt: Formatter, include_usage: bool) -> None:
        self.fmt, self.include_usage = fmt, include_usage
        self.calls: set[int] = set()  # choices that streamed a tool call: their finish reason is tool_calls

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes:
        return self.fmt.full(choices, total)

    def opening(self, choices: int) -> list[bytes]:
        return [sse(self.fmt.first_chunk(self.include_usage, index)) for index in range(choices)]

    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        return [sse(self.fmt.delta_chunk(text, logprob, self.include_usage, index))]

    def reasoning(self, index: int, text: str) -> list[bytes]:
        return [sse(self.fmt.reasoning_chunk(text, self.include_usage, index))]

    def tool_call(self, index: int, call: ToolCall, position: int) -> list[bytes]:
        self.calls.add(index)
        return [sse(chunk) for chunk in self.fmt.call_chunks(call, position, self.include_usage, index)]

    def closing(self, index: int, finish: FinishEvent) -> list[bytes]:
        return [sse(self.fmt.finish_chunk(finish, self.include_usage, index, index in self.calls))]

    def ending(self, total: FinishEvent) -> list[bytes]:
        return [sse(self.fmt.usage_chunk(total)), DONE] if self.include_usage else [DONE]

    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]:
        # The error in the envelope, the usage it was charged, [DONE].
        return [sse(error_envelope(error)), *self.ending(total)]

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE]


def chat_wire(kind: str, stream_options: Any = None) -> Callable[[Prepared, str, int], ChatWire]:
    """The wire factory for a chat (or completion) request with these stream options."""
    include_usage = bool(stream_options and stream_options.include_usage)
    return lambda prepared, model, created: ChatWire(Formatter(kind, prepared, model, created), include_usage)
