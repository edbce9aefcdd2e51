"""From a decoded OpenAI body to an engine's GenerationRequest: every check that can fail names
the parameter at fault."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from llama_cpp.llama_grammar import JSON_GBNF

from appliance.config.settings import Defaults
from appliance.fleet.registry import LoadedModel
from appliance.pipeline.errors import APIError, invalid
from appliance.pipeline.tool_request import generic_messages, tool_plan, tool_turns
from appliance.prompt import tool_calls
from appliance.prompt.chat import control_text
from appliance.prompt.reasoning import CLOSE, OPEN, Phase, ReasoningFormat, ReasoningSplit, starting_phase, with_calls
from appliance.prompt.schema_bounds import schema_grammar, schema_problem
from appliance.prompt.template import TemplateBoundError, TemplateError
from appliance.prompt.tool_calls import ToolPlan
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest, ImagePart, ResponseFormat
from engines.interface import GenerationRequest, SamplingParams, context_problem
from engines.upstream.wire import estimate_tokens

T = TypeVar("T")
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
# Choices per request: each is a full completion (a slot, its tokens in the budget), so a few only.
MAX_CHOICES = 8
MAX_TOP_K = 1_000_000  # past any vocabulary (Gemma's is 262,144); llama.cpp takes an int32
# OpenAI's limits on `metadata` (chat completions and responses).
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# OpenAI's reasoning_effort values; "none" turns a reasoning model's thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high")
# An upstream's reasoning as its engine hands it on; whether it can be turned off is the upstream's to say.
UPSTREAM_REASONING = ReasoningFormat(OPEN, CLOSE, switchable=True)


@dataclass(frozen=True)
class Reasoning:
    """Where a reasoning model's generation starts (appliance/prompt/reasoning.py)."""

    format: ReasoningFormat
    phase: Phase


@dataclass(frozen=True)
class Prepared:
    request: GenerationRequest
    prompt_text: str
    echo: bool = False  # completions: the prompt text leads the completion text
    messages: tuple[dict[str, Any], ...] = ()  # a chat request's turns, as the template saw them
    tools: ToolPlan | None = None  # tools offered: the answer is read for calls
    choices: int = 1  # `n`: completions of this prompt, one engine request each (choices.py)
    reasoning: Reasoning | None = None  # a reasoning model's chat: where its reasoning is split from the answer

    def splitter(self) -> ReasoningSplit | None:
        """A new split of one choice's generated text into reasoning and answer, or None."""
        return ReasoningSplit(self.reasoning.format, self.reasoning.phase) if self.reasoning is not None else None

    def model_name(self, alias: str) -> str:
        """The model that answers: the alias, with the adapters on it (an adapter answers differently)."""
        return alias + "".join(f":{adapter}@{scale:g}" for adapter, scale in self.request.adapter_key)

    @property
    def replay(self) -> str:
        """What a refresh sweep re-asks: a chat's turns as JSON (templated again, safely), else the prompt text."""
        return json.dumps(list(self.messages)) if self.messages else self.prompt_text


def unsupported_chat(body: ChatCompletionRequest) -> None:
    """A field that would change the answer and that no served model implements is a 400 naming
    it (docs/api.md); one that cannot change the answer is ignored."""
    if body.audio is not None:
        raise invalid("Audio output is not supported: no served model speaks.", "audio")
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid("Only the text modality is supported.", "modalities")
    if body.web_search_options is not None:
        raise invalid("Web search is not supported: the server answers offline.", "web_search_options")
    if body.reasoning_effort is not None and body.reasoning_effort not in EFFORTS:
        raise invalid(f"reasoning_effort must be one of {', '.join(EFFORTS)}.", "reasoning_effort")


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_KEYS:
        raise invalid(f"'metadata' may have at most {METADATA_KEYS} keys.", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise invalid(f"metadata keys may have at most {METADATA_KEY_CHARS} characters and values {METADATA_VALUE_CHARS}.",
                          f"metadata.{key[:METADATA_KEY_CHARS]}")


def _check_common(body: ChatCompletionRequest | CompletionRequest, model: LoadedModel) -> None:
    if not 1 <= body.n <= MAX_CHOICES:
        raise invalid(f"{body.n} is not a valid n: it must be between 1 and {MAX_CHOICES}.", "n")
    if body.temperature is not None and not 0.0 <= body.temperature <= 2.0:
        raise invalid(f"{body.temperature} is not a valid temperature: it must be between 0 and 2.", "temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise invalid(f"{body.top_p} is not a valid top_p: it must be greater than 0 and at most 1.", "top_p")
    if body.top_k is not None and not 0 <= body.top_k <= MAX_TOP_K:
        raise invalid(f"{body.top_k} is not a valid top_k: it must be between 0 (off) and {MAX_TOP_K}.", "top_k")
    for param in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, param)
        if value is not None and not -2.0 <= value <= 2.0:
            raise invalid(f"{value} is not a valid {param}: it must be between -2 and 2.", param)
    _logit_bias(body.logit_bias, model.engine.vocab_size())
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true.", "stream_options")


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON key, so a string) to a bias in [-100, 100], as sorted pairs.
    `vocab` 0 (an upstream, whose vocabulary is not known here) checks the ids' form only."""
    out = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1  # int() of 5000 digits raises
        if token < 0 or (vocab and token >= vocab):
            where = f"between 0 and {vocab - 1}" if vocab else "a non-negative integer"
            raise invalid(f"logit_bias keys must be token ids {where}; got {key!r}.", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise invalid(f"The bias for token {key} is {value}; a bias must be between -100 and 100.", "logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP:
        raise invalid(f"At most {MAX_STOP} stop sequences are allowed; got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise invalid("A stop sequence must not be empty.", "stop")
    return tuple(stops)


def _max_tokens(requested: int | None, param: str, prompt_len: int, model: LoadedModel, defaults: Defaults) -> int:
    context = model.engine.context_length
    if requested is not None:
        if requested < 1:
            raise invalid(f"{requested} is less than the minimum of 1.", param)
        # Refused here, before any rate limit or budget is touched, never truncated.
        problem = context_problem(prompt_len, requested, context)
        if problem is not None:
            raise APIError(400, problem, param=param, code="context_length_exceeded")
        return requested
    room = context - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, your prompt has {prompt_len} tokens, "
            "leaving no room for the completion. Please reduce the length of the prompt.",
            param="messages",
            code="context_length_exceeded",
        )
    return min(defaults.max_tokens, room)


def check_token_ids(tokens: list[int], vocab: int, param: str) -> None:
    """Token ids a caller sends must name tokens of the model's vocabulary."""
    if any(not 0 <= t < vocab for t in tokens):
        raise invalid(f"Token ids in '{param}' must be between 0 and {vocab - 1}.", param)


def _format_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """A json_schema format's schema, judged by the bounds and validity a tool's parameters are
    judged by (schema_bounds), before any grammar is built or the format is sent upstream."""
    if fmt is None or fmt.type != "json_schema":
        return None
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise invalid("response_format json_schema needs a 'schema' object.", "response_format.json_schema.schema")
    problem = schema_problem(fmt.json_schema.schema)
    if problem is not None:
        raise invalid(f"The JSON schema cannot be enforced: {problem}.", "response_format.json_schema.schema")
    return fmt.json_schema.schema


def _grammar(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_GBNF
    schema = _format_schema(fmt)
    try:
        return schema_grammar(schema or {})
    except Exception as exc:
        raise invalid(f"The JSON schema cannot be enforced: {exc}", "response_format.json_schema.schema") from None


def _sampling(body: ChatCompletionRequest | CompletionRequest, defaults: Defaults, logprobs: bool, top: int, grammar: str | None) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        logprobs=logprobs,
        top_logprobs=top,
        grammar=grammar,
        logit_bias=_logit_bias(body.logit_bias, 0),  # checked against the vocabulary in _check_common
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
    )


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: roles mapped, text parts joined."""
    return _messages(body)


def _messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    calls_seen: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            if any(isinstance(part, ImagePart) for part in content):
                raise invalid("This model does not accept images.", f"messages[{i}].content")
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        if message.role in ("assistant", "tool", "function"):
            out.append(tool_turns(message, i, content or "", calls_seen))
            continue
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or ""})
    return out


def _tool_grammar(plan: ToolPlan | None, fmt: ResponseFormat | None) -> str | None:
    """A required or named call is forced by a grammar built from the tools' schemas, so its
    arguments always parse and validate. With "auto" the output is free and read afterwards: a
    grammar allowing text or a call would put every free-text token through grammar sampling
    (slow on these CPUs) for no gain, since a call that does not parse stays text."""
    if plan is None or plan.mode != "required":
        return _grammar(fmt)
    if fmt is not None and fmt.type != "text":
        raise invalid("response_format cannot be combined with a required tool call.", "response_format")
    try:
        return tool_calls.grammar(plan)
    except Exception as exc:
        raise invalid(f"The tools' parameter schemas cannot be enforced: {exc}", _failing_tool(plan)) from None


def _failing_tool(plan: ToolPlan) -> str:
    """The param of the first offered tool whose parameters alone cannot become a grammar, else
    the tools as a whole (together they are too large). Only on the way to a refusal."""
    for i, tool in enumerate(plan.tools):
        if tool in plan.offered:
            try:
                schema_grammar(tool.parameters)
            except Exception:
                return f"tools[{i}].function.parameters"
    return "tools"


def _template_chat(body: ChatCompletionRequest, model: LoadedModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolPlan | None]:
    """The messages and tools the chat template gets, and the plan the answer is read by."""
    assert model.template is not None
    native, form = tool_calls.template_form(model.template.uses_tools, model.template.source)
    plan = tool_plan(body, form)
    if plan is not None and plan.mode == "required" and form == "harmony":
        # A grammar forces a call from the first token, where gpt-oss writes its reasoning first.
        raise invalid(f"The model '{model.settings.alias}' writes its calls after its reasoning, in gpt-oss's channels: "
                      "a call cannot be forced; send tool_choice \"auto\".", "tool_choice")
    messages = _messages(body)
    if not native:
        return generic_messages(messages, plan), None, plan
    tools = [t.wire() for t in plan.offered] if plan is not None and plan.offered else None
    controls = model.engine.control_tokens()
    found = control_text(tools or [], controls)
    if found is not None:
        raise invalid(f"A tool contains the control token {found!r}, which this model's template cannot keep as text.", "tools")
    for i, m in enumerate(messages):
        found = control_text(m.get("tool_calls") or [], controls)
        if found is not None:
            raise invalid(f"A tool call contains the control token {found!r}, which this model's template cannot keep as text.",
                          f"messages[{i}].tool_calls")
    return messages, tools, plan


def _planned_chat(body: ChatCompletionRequest, model: LoadedModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolPlan | None, str | None]:
    """The template's messages and tools, the tool plan, and the grammar the answer must follow."""
    messages, tools, plan = _template_chat(body, model)
    return messages, tools, plan, _tool_grammar(plan, body.response_format)


async def _schemas_off_loop(body: ChatCompletionRequest, fn: Callable[..., T], *args: Any) -> T:
    """Checking a request's schemas and writing their grammar costs up to about 0.2 s of CPU at
    the bounds (docs/api.md): on a worker thread when the request carries any."""
    fmt = body.response_format
    if body.tools or body.functions or (fmt is not None and fmt.type == "json_schema"):
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def with_adapters(prepared: Prepared, adapters: tuple[tuple[str, float], ...]) -> Prepared:
    return replace(prepared, request=replace(prepared.request, adapters=adapters)) if adapters else prepared


async def prepare_chat(body: ChatCompletionRequest, model: LoadedModel, defaults: Defaults, request_id: str) -> Prepared:
    _check_common(body, model)
    if body.logprobs and (body.tools or body.functions):
        raise invalid("logprobs cannot be combined with tools on this server.", "logprobs")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid("top_logprobs requires logprobs to be true.", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.", "top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("Give max_tokens or max_completion_tokens, not both.", "max_tokens")
    if model.engine.takes_messages:
        return await _schemas_off_loop(body, _prepare_upstream_chat, body, model, defaults, request_id)
    if model.template is None:
        raise invalid(f"The model '{model.settings.alias}' has no chat template; use /v1/completions.", "model")
    messages, tools, plan, grammar = await _schemas_off_loop(body, _planned_chat, body, model)
    # "none" turns a reasoning model's thinking off (its template's switch); a template that reads an effort gets the others.
    if body.reasoning_effort == "none" and model.template.reasoning is not None and not model.template.reasoning.switchable:
        raise invalid(f"The model '{model.settings.alias}' reasons, and its chat template cannot turn that off.", "reasoning_effort")
    try:
        # a template may take its time: off the loop
        prompt_text, tokens = await model.chat_prompt_async(messages, tools, effort=body.reasoning_effort)
    except TemplateBoundError as exc:
        raise APIError(400, f"The model's chat template went past its bounds on these messages: {exc}", param="messages",
                       code="chat_template_bound") from None
    except TemplateError as exc:
        raise invalid(f"The model's chat template rejected these messages: {exc}", "messages") from None
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = _max_tokens(requested, param, len(tokens), model, defaults)
    sampling = _sampling(body, defaults, body.logprobs, body.top_logprobs or 0, grammar)
    offered = plan if plan is not None and plan.mode != "none" else None
    controls = model.engine.control_tokens() if offered is not None else {}
    preserved = frozenset(controls[t] for t in tool_calls.marker_texts(offered.format) if t in controls) if offered else frozenset()
    fmt = model.template.reasoning
    # With tools offered, a harmony model's call ends its reasoning and goes to the tool parser.
    reasoning = None if fmt is None or grammar is not None else Reasoning(with_calls(fmt) if offered else fmt, starting_phase(fmt, prompt_text))
    return Prepared(GenerationRequest(request_id, tuple(tokens), max_tokens, sampling, _stops(body.stop), preserved_tokens=preserved),
                    prompt_text, messages=tuple(messages), tools=offered, choices=body.n, reasoning=reasoning)


def _prepare_upstream_chat(body: ChatCompletionRequest, model: LoadedModel, defaults: Defaults, request_id: str) -> Prepared:
    """For a model served by another server: the messages go as they are (it templates and
    tokenizes them), response_format is passed on, and the prompt's size is an estimate until the
    upstream reports its count."""
    plan = tool_plan(body, "hermes")  # the engine writes the upstream's calls in this form (wire.CallText)
    chat = _messages(body)
    messages = tuple((m["role"], m["content"]) for m in chat)
    messages_json = json.dumps([_wire_message(m) for m in chat]) if any(m["role"] == "tool" or m.get("tool_calls") for m in chat) else None
    tools_json = None
    if plan is not None:
        choice: Any = {"type": "function", "function": {"name": plan.forced}} if plan.forced else plan.mode
        tools_json = json.dumps({"tools": [t.wire() for t in plan.tools], "tool_choice": choice, "parallel_tool_calls": plan.parallel})
    estimate = estimate_tokens(messages) + (len(tools_json.encode()) // 3 if tools_json else 0)
    estimate += len(messages_json.encode()) // 3 if messages_json else 0
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is not None and requested < 1:
        raise invalid(f"{requested} is less than the minimum of 1.", param)
    if requested is not None and requested > model.engine.context_length:
        # No prompt fits beside it; refused before any rate limit or budget is touched.
        raise APIError(400, context_problem(0, requested, model.engine.context_length) or "", param=param, code="context_length_exceeded")
    # The estimate errs high, so it never refuses a prompt: the upstream judges its own context.
    max_tokens = requested if requested is not None else max(1, min(defaults.max_tokens, model.engine.context_length - estimate))
    response_format = None
    if body.response_format is not None and body.response_format.type != "text":
        _format_schema(body.response_format)  # an upstream builds a grammar from it too
        wire: dict = {"type": body.response_format.type}
        if body.response_format.json_schema is not None:
            wire["json_schema"] = {k: v for k, v in msgspec.structs.asdict(body.response_format.json_schema).items() if v is not None}
        response_format = json.dumps(wire)
    sampling = _sampling(body, defaults, body.logprobs, body.top_logprobs or 0, None)
    request = GenerationRequest(request_id, (), max_tokens, sampling, _stops(body.stop), messages=messages,
                                response_format=response_format, estimated_prompt_tokens=estimate,
                                messages_json=messages_json, tools_json=tools_json, reasoning_effort=body.reasoning_effort)
    # The engine writes an upstream's reasoning between the markers, before the answer (wire.ThinkText); an
    # upstream that leaves its model's markers in the text is split the same way.
    return Prepared(request, json.dumps([{"role": r, "content": c} for r, c in messages]),
                    tools=plan if plan is not None and plan.mode != "none" else None, choices=body.n,
                    reasoning=Reasoning(UPSTREAM_REASONING, Phase.BEFORE))


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A checked turn back in OpenAI's wire form: tool-call arguments as JSON text."""
    if not message.get("tool_calls"):
        return {k: v for k, v in message.items() if k != "name" or message["role"] != "tool"}
    calls = [{**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "content": message["content"] or None, "tool_calls": calls}


def prepare_completion(body: CompletionRequest, model: LoadedModel, defaults: Defaults, request_id: str) -> Prepared:
    _check_common(body, model)
    if model.engine.takes_messages:
        raise invalid(f"The model '{model.settings.alias}' runs upstream and serves /v1/chat/completions only.", "model")
    if body.suffix:
        raise invalid("suffix is not supported by this model.", "suffix")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise invalid("logprobs must be between 0 and 5 for completions.", "logprobs")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        tokens = [int(p) for p in prompt]
        check_token_ids(tokens, model.engine.vocab_size(), "prompt")
        text = model.engine.detokenize(tokens)
    else:
        if isinstance(prompt, list):
            if not all(isinstance(p, str) for p in prompt):
                raise invalid("'prompt' must be a string, a list of strings, or a list of token ids.", "prompt")
            if len(prompt) != 1:
                raise invalid("Only one prompt per request is supported.", "prompt")
            prompt = prompt[0]
        text = str(prompt)
        if not text:
            raise invalid("'prompt' must not be empty.", "prompt")
        # Control-token text in a prompt stays text unless the caller asks for it (an extension).
        tokens = model.engine.tokenize(text, add_special=model.engine.add_bos(), parse_special=body.parse_special)
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", len(tokens), model, defaults)
    top = body.logprobs or 0
    sampling = _sampling(body, defaults, body.logprobs is not None, top, None)
    return Prepared(GenerationRequest(request_id, tuple(tokens), max_tokens, sampling, _stops(body.stop)), text, echo=body.echo,
                    choices=body.n)
