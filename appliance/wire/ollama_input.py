"""Ollama's API requests (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show) as
msgspec structs, and the chat or completion request that answers each: the server serves one
request flow (appliance/pipeline/flow.py), so an Ollama request is asked as OpenAI's and only its
wire differs (appliance/wire/ollama.py).

Unknown fields are ignored. Options that only say how the server runs a model (threads, GPU
layers, batch size, memory mapping) are the server's own settings and are ignored; an option that
would change the answer and is not implemented (mirostat, min_p, a repeat penalty other than 1) is
a 400 naming it."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from appliance.pipeline.errors import invalid
from appliance.wire.decode import from_validation
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest


class CallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class Call(msgspec.Struct, kw_only=True):
    function: CallFunction
    id: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Call] | None = None
    tool_name: str | None = None  # a tool turn: the function it answers
    tool_call_id: str | None = None
    thinking: str | None = None  # an earlier answer's reasoning: not read back


class Options(msgspec.Struct, kw_only=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    num_predict: int | None = None  # -1: until the context is full, as -2
    num_ctx: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # Would change the answer and are not implemented: refused unless at their neutral value.
    repeat_penalty: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    tfs_z: float | None = None


_NEUTRAL = {"repeat_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0}

KeepAlive = str | float | int | None


class ChatBody(msgspec.Struct, kw_only=True):
    model: str
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None  # false: a reasoning model answers without thinking; true or a level: it thinks


class GenerateBody(msgspec.Struct, kw_only=True):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None


class EmbedBody(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    """The older /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str
    options: Options | None = None
    keep_alive: KeepAlive = None


class ShowBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older name of the field
    verbose: bool = False


class PullBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older name of the field
    stream: bool = True
    insecure: bool = False


class DeleteBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None


class CopyBody(msgspec.Struct, kw_only=True):
    source: str
    destination: str


_HUB_NAME = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([^/\s:]+/[^/\s:]+):(.+\.gguf)$")


def hub_file(name: str) -> tuple[str, str]:
    """(repo, file) from `hf.co/<owner>/<repo>:<file>.gguf`, the one pull name served: Ollama's
    library names need Ollama's registry, and a quantization tag a listing of the repo."""
    match = _HUB_NAME.match(name.strip())
    if match is None:
        raise invalid(f"model: {name!r} is not a hub file; pull one as hf.co/<owner>/<repo>:<file>.gguf (Ollama's library "
                      "names are not served here).", "model")
    return match.group(1), match.group(2)


def model_name(name: str) -> str:
    """Ollama names carry a tag; `:latest` is the one every model here has."""
    return name.removesuffix(":latest")


_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")


FOREVER_S = 10 * 365 * 86400.0  # a negative keep_alive: kept, yet still unloaded to make room for another model


def keep_alive_s(value: KeepAlive) -> float | None:
    """Seconds from Ollama's keep_alive ("5m", "1h", 300, "0"; negative: FOREVER_S); None when not given."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(value.strip())
        if match is None:
            raise invalid(f"keep_alive: {value!r} is not a duration (such as \"5m\", \"30s\", 0 or -1).", "keep_alive")
        seconds = float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
    return FOREVER_S if seconds < 0 else seconds


def _sampling(options: Options | None) -> dict[str, Any]:
    if options is None:
        return {}
    for name, neutral in _NEUTRAL.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise invalid(f"options.{name}: {value} is not supported by this server; only {neutral} is.", f"options.{name}")
    if options.num_ctx is not None and options.num_ctx < 1:
        raise invalid("options.num_ctx: it must be at least 1.", "options.num_ctx")
    num_predict = options.num_predict
    return {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k, "seed": options.seed,
            "stop": options.stop, "frequency_penalty": options.frequency_penalty, "presence_penalty": options.presence_penalty,
            # -1 (until the end) and -2 (until the context is full): the room the context leaves
            "max_tokens": num_predict if num_predict is not None and num_predict >= 0 else None}


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise invalid(f"format: {fmt!r} is not 'json' or a JSON Schema.", "format")


def _convert(chat: dict[str, Any], kind: type[Any]) -> Any:
    try:
        return msgspec.convert({k: v for k, v in chat.items() if v is not None}, kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None


def _effort(think: bool | str | None) -> str | None:
    """Ollama's `think` as chat's reasoning_effort: false turns a reasoning model's thinking off, true
    or a level leaves it on (a model that does not reason answers as it would)."""
    if think is None or think is True:
        return None
    if think is False:
        return "none"
    if think in ("low", "medium", "high"):
        return think
    raise invalid("think: true, false, or one of low, medium, high.", "think")


def chat_request(body: ChatBody) -> ChatCompletionRequest:
    """The chat request that answers an /api/chat request."""
    messages: list[dict[str, Any]] = []
    calls: list[tuple[str, str]] = []  # (id, function name) of each earlier call not yet answered
    for i, m in enumerate(body.messages):
        if m.images:
            raise invalid(f"messages.{i}.images: images are not supported; the served models read text.", f"messages.{i}.images")
        if m.role == "assistant" and m.tool_calls:
            wired = []
            for j, c in enumerate(m.tool_calls):
                call_id = c.id or f"call_{i}_{j}"
                calls.append((call_id, c.function.name))
                wired.append({"id": call_id, "type": "function",
                              "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}})
            messages.append({"role": "assistant", "content": m.content or None, "tool_calls": wired})
        elif m.role == "tool":
            messages.append({"role": "tool", "content": m.content, "tool_call_id": _answered(calls, m, i)})
        else:
            messages.append({"role": m.role, "content": m.content})
    chat = {"model": model_name(body.model), "messages": messages, "stream": body.stream, "tools": body.tools or None,
            "response_format": _format(body.format), "reasoning_effort": _effort(body.think), **_sampling(body.options)}
    return _convert(chat, ChatCompletionRequest)


def _answered(calls: list[tuple[str, str]], m: Message, i: int) -> str:
    """The call a tool turn answers: by its id, else the latest call of its function, else the earliest unanswered."""
    match = next((c for c in calls if c[0] == m.tool_call_id), None) if m.tool_call_id else None
    if match is None and m.tool_name:
        match = next((c for c in reversed(calls) if c[1] == m.tool_name), None)
    if match is None and not m.tool_name and calls:
        match = calls[0]
    if match is None:
        raise invalid(f"messages.{i}: this tool turn answers no earlier tool call.", f"messages.{i}")
    calls.remove(match)
    return match[0]


def generate_request(body: GenerateBody) -> ChatCompletionRequest | CompletionRequest:
    """/api/generate: the prompt as a user turn under the model's chat template (with `system`),
    or, with `raw` or a `suffix`, the text itself as a completion's prompt."""
    effort = _effort(body.think)
    if body.images:
        raise invalid("images: images are not supported; the served models read text.", "images")
    if body.template:
        raise invalid("template: a request's own template is not supported; the model's chat template is used.", "template")
    if body.context:
        raise invalid("context: an earlier answer's context is not supported; send the conversation to /api/chat.", "context")
    sampling = {"model": model_name(body.model), "stream": body.stream, **_sampling(body.options)}
    if body.raw or body.suffix is not None:
        if body.format:
            raise invalid("format: not supported with a raw prompt or a suffix.", "format")
        return _convert({**sampling, "prompt": body.prompt, "suffix": body.suffix}, CompletionRequest)
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [{"role": "user", "content": body.prompt}]
    return _convert({**sampling, "messages": messages, "response_format": _format(body.format), "reasoning_effort": effort},
                    ChatCompletionRequest)
