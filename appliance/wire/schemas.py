"""OpenAI request bodies as msgspec structs: decoded and type-checked in one pass.

Unknown fields are accepted and ignored, as OpenAI's own API does; a known field with a wrong
type is a 400 that names it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec


# A seed is any signed 64-bit value (llama.cpp keeps its low 32 bits); a larger number means nothing.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: Any


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallMessage(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: FunctionCall | None = None  # the legacy form of one assistant call


class FunctionSpec(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    function: FunctionSpec
    type: str = "function"


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: FunctionName
    type: str = "function"


class AdapterChoice(msgspec.Struct, kw_only=True):
    name: str
    scale: float | None = None  # the adapter's configured scale when left out


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaSpec(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension, as llama-server and vLLM take it: only the k likeliest tokens are drawn from
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # token id (as a string, as JSON keys are) -> bias in [-100, 100]; checked against the vocabulary in pipeline/prepare.py
    logit_bias: dict[str, float] | None = None
    # LoRA adapters on the model (an extension; `model: "<alias>:<adapter>"` also picks one)
    adapters: list[AdapterChoice] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The legacy forms, read as tools and tool_choice.
    functions: list[FunctionSpec] | None = None
    function_call: str | FunctionName | None = None
    # OpenAI's tags on a request; `family` names its task family where distillation keeps answers.
    metadata: dict[str, str] | None = None
    # OpenAI's fields this server does not serve and that would change the answer: declared so that
    # prepare.unsupported_chat can refuse them by name instead of ignoring them.
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    # msgspec takes one array type in a union; pipeline/prepare.py checks the items are all one kind
    prompt: str | list[str | int]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # An extension: read control-token text in the prompt (`<|im_start|>`) as control tokens, for
    # callers who write a model's turn format themselves. Off: such text is plain text.
    parse_special: bool = False


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class ResponsesTextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponsesText(msgspec.Struct, kw_only=True):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None  # a hint; it does not change what this server generates


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. Input items stay loose here: responses_input.py checks each and
    names the item at fault."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    text: ResponsesText | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    # Echoed, and without effect on the answer here.
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    frequency_penalty: float | None = None  # applied as for chat (each in [-2, 2]), and echoed
    presence_penalty: float | None = None
    # Refused when set (responses_input._check): each would change the answer.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
