"""The OpenAI wire format as an upstream speaks it: the request body we send, the stream chunks
we read back, and the error bodies we name. Pure: no network here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import msgspec

from engines.interface import THINK_CLOSE, THINK_OPEN, FinishReason, GenerationRequest, TokenLogprob, TopLogprob


def request_body(request: GenerationRequest, upstream_model: str) -> dict:
    """Always a stream (with usage when the upstream reports it): tokens pass through as they
    arrive, and a non-streamed call is the same stream collected here."""
    s = request.sampling
    body: dict = {
        "model": upstream_model,
        "messages": json.loads(request.messages_json) if request.messages_json is not None else
                    [{"role": role, "content": content} for role, content in request.messages],
        "max_tokens": request.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if s.top_k:
        body["top_k"] = s.top_k  # vLLM's, llama-server's and Ollama's OpenAI routes take it
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if request.stop:
        body["stop"] = list(request.stop)
    if s.logprobs:
        body["logprobs"] = True
        if s.top_logprobs:
            body["top_logprobs"] = s.top_logprobs
    if request.response_format is not None:
        body["response_format"] = json.loads(request.response_format)
    if request.tools_json is not None:
        body.update(json.loads(request.tools_json))
    if request.reasoning_effort is not None:
        body["reasoning_effort"] = request.reasoning_effort
    return body


class _Top(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class _TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[_Top] | None = None


class _Logprobs(msgspec.Struct):
    content: list[_TokenLogprob] | None = None


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None
    # A reasoning model's reasoning: llama-server and older vLLM name it reasoning_content, newer
    # vLLM and Ollama reasoning (a server that sends both sends the same text twice).
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: dict | str | None = None


@dataclass(frozen=True)
class Piece:
    """What one stream chunk carries for us."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: tuple[int, int, int, int] | None = None  # prompt, completion, cached prompt, reasoning tokens
    error: str | None = None  # an error the upstream reported inside the stream
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


class CallText:
    """An upstream's streamed tool calls written as `<tool_call>{"id", "name", "arguments"}</tool_call>`
    text (appliance/prompt/tool_calls.py's "hermes" form), so the API reads local and upstream calls, whole
    and streamed, with one parser. The arguments go in as the upstream wrote them (JSON text)."""

    def __init__(self) -> None:
        self._open: int | None = None
        self._args = False

    def feed(self, deltas: tuple[ToolCallDelta, ...]) -> str:
        out = []
        for d in deltas:
            if d.index != self._open:
                out.append(self.close())
                self._open, self._args = d.index, False
                head = {"id": d.id or "", "name": d.name or ""}
                out.append("<tool_call>\n" + json.dumps(head, ensure_ascii=False)[:-1] + ', "arguments": ')
            if d.arguments:
                self._args = True
                out.append(d.arguments)
        return "".join(out)

    def close(self) -> str:
        if self._open is None:
            return ""
        text = ("" if self._args else "{}") + "}\n</tool_call>"
        self._open = None
        return text


class ThinkText:
    """An upstream's reasoning deltas written as `<think>…</think>` before the answer, the markers the
    API's reasoning split reads (appliance/prompt/reasoning.py), so local and upstream reasoning
    reach every wire format one way. The reasoning closes when the answer or a tool call starts;
    reasoning sent after that is dropped (every wire format puts the reasoning before the answer, and
    markers in the answer's text would be the upstream's words to the caller)."""

    def __init__(self) -> None:
        self._state = "before"  # then "open", then "closed"

    def feed(self, reasoning: str) -> str:
        if not reasoning or self._state == "closed":
            return ""
        opening = THINK_OPEN if self._state == "before" else ""
        self._state = "open"
        return opening + reasoning

    def close(self) -> str:
        """The closing marker if the reasoning is open; from here on none is let out."""
        was_open, self._state = self._state == "open", "closed"
        return THINK_CLOSE if was_open else ""


class ChunkError(ValueError):
    """A line that is not a chunk of the OpenAI stream format."""


_DECODER = msgspec.json.Decoder(_Chunk)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def parse_chunk(data: bytes | str) -> Piece:
    try:
        chunk = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ChunkError(f"not an OpenAI stream chunk ({exc}): {str(data)[:120]!r}") from None
    if chunk.error is not None:
        return Piece(error=error_message(chunk.error))
    usage = None
    if chunk.usage is not None and (chunk.usage.prompt_tokens or chunk.usage.completion_tokens):
        details, thought = chunk.usage.prompt_tokens_details, chunk.usage.completion_tokens_details
        usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, (details.cached_tokens or 0) if details else 0,
                 (thought.reasoning_tokens or 0) if thought else 0)
    if not chunk.choices:
        return Piece(usage=usage)
    choice = chunk.choices[0]
    logprobs: tuple[TokenLogprob, ...] = ()
    if choice.logprobs is not None and choice.logprobs.content:
        logprobs = tuple(
            TokenLogprob(lp.token, bytes(lp.bytes) if lp.bytes is not None else lp.token.encode(), _logprob(lp.logprob),
                         tuple(TopLogprob(t.token, bytes(t.bytes) if t.bytes is not None else t.token.encode(), _logprob(t.logprob))
                               for t in lp.top_logprobs or ()))
            for lp in choice.logprobs.content)
    reason: FinishReason | None = None
    if choice.finish_reason is not None:
        reason = "length" if choice.finish_reason == "length" else "stop"  # content_filter and the like end it too
    delta = choice.delta
    text = (delta.content or "") if delta is not None else ""
    reasoning = (delta.reasoning_content or delta.reasoning or "") if delta is not None else ""
    calls = tuple(ToolCallDelta(d.index, d.id, d.function.name if d.function else None, (d.function.arguments or "") if d.function else "")
                  for d in (choice.delta.tool_calls or ())) if choice.delta is not None else ()
    return Piece(text, logprobs, reason, usage, tool_calls=calls, reasoning=reasoning)


class DataLines:
    """The `data:` payloads of a server-sent event stream, as its bytes arrive (a line may span
    blocks). Bytes all the way: msgspec decodes them without a text copy."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, block: bytes) -> list[bytes]:
        lines = (self._rest + block).split(b"\n")
        self._rest = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def end(self) -> list[bytes]:
        rest, self._rest = self._rest, b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


def error_message(body: object) -> str:
    """The human part of an upstream's error body, whatever shape it came in."""
    if isinstance(body, (bytes, str)):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(text)
        except ValueError:
            return " ".join(text.split())[:300] or "(empty body)"
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"][:300]
        if isinstance(inner, str):
            return inner[:300]
        if "detail" in body:
            return str(body["detail"])[:300]
    return json.dumps(body)[:300]


def estimate_tokens(messages: tuple[tuple[str, str], ...]) -> int:
    """A prompt's tokens before the upstream counts them: a byte per third of a token is above
    what BPE vocabularies give for English and code (about 4 bytes per token) and near CJK's,
    so a budget reserved on it rarely runs short; plus a few tokens of template per message."""
    return sum(len(content.encode()) // 3 + 1 + 4 for _, content in messages) + 2
