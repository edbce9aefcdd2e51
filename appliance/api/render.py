"""OpenAI response shapes for chat and legacy completions, whole and streamed."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np

from appliance.api.translate import Prepared
from appliance.registry import LoadedModel
from appliance.tool_calls import StreamParser, ToolCall, parse
from engines.base import FinishEvent, TokenLogprob

FINGERPRINT = "appliance-0.1"
_encoder = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _finish_reason(finish: FinishEvent, calls: bool = False) -> str:
    if calls:
        return "tool_calls"
    return "length" if finish.reason == "length" else "stop"


_ARGUMENT_PIECE = 24  # characters of arguments per streamed delta, as OpenAI sends them in pieces


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
        # With tools offered, text that may open a call is held until it is known to be one or not.
        self.parser = StreamParser(prepared.tools) if kind == "chat" and prepared.tools is not None else None

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

    def text_chunks(self, text: str, logprob: TokenLogprob | None, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks for generated text: content deltas, or, with tools, calls as they complete."""
        if self.parser is None:
            return [self.delta_chunk(text, logprob, include_usage)] if text or logprob is not None else []
        return self._outs(self.parser.feed(text), include_usage)

    def end_chunks(self, finish: FinishEvent, include_usage: bool) -> list[dict[str, Any]]:
        """What the parser still held, then the finish chunk."""
        out = self._outs(self.parser.end(), include_usage) if self.parser is not None else []
        return out + [self.finish_chunk(finish, include_usage)]

    def _outs(self, outs: list[str | ToolCall], include_usage: bool) -> list[dict[str, Any]]:
        chunks = []
        for out in outs:
            if isinstance(out, str):
                chunks.append(self.delta_chunk(out, None, include_usage))
            else:
                chunks += self._call_chunks(out, include_usage)
        return chunks

    def _call_chunks(self, call: ToolCall, include_usage: bool) -> list[dict[str, Any]]:
        """A call as OpenAI streams one: its index, id, type and name with empty arguments, then
        the arguments in pieces (the SDK's stream helpers join them)."""
        assert self.parser is not None
        index = len(self.parser.calls) - 1
        first = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        pieces = [call.arguments[i:i + _ARGUMENT_PIECE] for i in range(0, len(call.arguments), _ARGUMENT_PIECE)]
        deltas = [first] + [{"index": index, "function": {"arguments": p}} for p in pieces]
        return [self._envelope([{"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}], include_usage)
                for d in deltas]

    def finish_chunk(self, finish: FinishEvent, include_usage: bool) -> dict[str, Any]:
        if self.kind == "chat":
            calls = self.parser is not None and bool(self.parser.calls)
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
