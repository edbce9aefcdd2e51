"""The engine interface and the values that cross it.

An engine knows nothing about tenants, budgets or caches: it loads a model, takes generation
requests, streams events back, and cancels on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

from engines.vocabulary import Vocabulary

if TYPE_CHECKING:
    import numpy as np

    from engines.stream import EventStream


# The markers a reasoning model writes around its reasoning before the answer (Qwen3, DeepSeek-R1's
# distills); an engine that takes messages writes an upstream's reasoning between them too.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ModelKey:
    """What a KV cache or slot is valid for: the same model with another adapter is another key."""

    model: str
    adapters: tuple[tuple[str, float], ...] = ()
    draft: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token stays a candidate
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # GBNF grammar text; constrains every sampled token.
    grammar: str | None = None
    # OpenAI's logit adjustments, applied to the logits before the chain (engines/sampling.py):
    # (token id, bias) pairs, and penalties on tokens this completion already generated.
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # Control tokens whose text goes out as text (a template's `<tool_call>`), where other control
    # tokens are silent: the API reads tool calls from that text.
    preserved_tokens: frozenset[int] = frozenset()
    # LoRA adapters by name with their scales; requests with different sets never share a step.
    adapters: tuple[tuple[str, float], ...] = ()
    # For engines that take messages (`takes_messages`: an upstream server applies its own template
    # and tokenizer): the chat as (role, content), the caller's response_format as JSON, and the
    # prompt's size as estimated here (prompt_tokens is then empty).
    messages: tuple[tuple[str, str], ...] = ()
    response_format: str | None = None
    estimated_prompt_tokens: int = 0
    # For such engines too: the chat in OpenAI's wire form (JSON) when it carries tool calls or
    # results, which (role, content) cannot; and tools, tool_choice, parallel_tool_calls as JSON.
    messages_json: str | None = None
    tools_json: str | None = None
    reasoning_effort: str | None = None  # the caller's, passed on as it was given ("none": no reasoning)
    # Whose earlier prompts' KV this request may reuse: only KV computed under the same scope. Opaque
    # here (like vLLM's cache_salt); the server sets it per tenant, or "" where everyone may share.
    prefix_scope: str = ""

    @property
    def prompt_length(self) -> int:
        """Prompt tokens as counted here: exact for local engines, estimated for upstreams."""
        return len(self.prompt_tokens) if self.prompt_tokens else self.estimated_prompt_tokens

    @property
    def adapter_key(self) -> tuple[tuple[str, float], ...]:
        """What the KV this request computes is valid for; a zero scale is no adapter at all."""
        return tuple(sorted((name, scale) for name, scale in self.adapters if scale != 0.0))

    @property
    def prefix_key(self) -> PrefixKey:
        """What the KV this request computes may be reused for: its adapter set, within its scope."""
        return PrefixKey(self.adapter_key, self.prefix_scope)


class PrefixKey(NamedTuple):
    """The key every holder of a prefix's KV is listed under (engines/prefix.py): a request
    reuses only KV of its own adapter set and its own prefix scope."""

    adapters: tuple[tuple[str, float], ...]
    scope: str


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token. `text` may be empty while bytes of a UTF-8 character or a possible
    stop string are held back; it is released in a later event."""

    text: str
    token_id: int
    logprob: TokenLogprob | None = None


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # served from KV the slot already held
    reasoning_tokens: int = 0  # of the completion's, inside a reasoning model's reasoning: an upstream's own count, else the pipeline's

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    usage: Usage
    text: str = ""  # held-back text released at the end
    time_to_first_token_s: float | None = None
    total_time_s: float = 0.0
    error: str | None = None
    # How the API answers an error that came before any token: an upstream's refusal is the
    # caller's 400, its outage a 502/503/504; None is the engine's own failure (500).
    error_status: int | None = None
    error_code: str | None = None
    retry_after_s: int | None = None
    # An upstream engine's: which server answered (or failed last), after how many attempts.
    upstream: str | None = None
    upstream_attempts: int = 0
    stop_sequence: str | None = None  # the caller's stop string that ended the answer (reason "stop"), when one did
    # Measured where the engine knows (the local engines; None upstream): the wait before the request's first
    # step, and the gap before each sampled token after the first, for vLLM's histograms of the same.
    queue_time_s: float | None = None
    inter_token_s: tuple[float, ...] | None = None


EngineEvent = TokenEvent | FinishEvent


# The error code and Retry-After of a request an engine ended because the server is stopping.
SHUTTING_DOWN = "server_shutting_down"
SHUTDOWN_RETRY_AFTER_S = 5


class EngineError(Exception):
    """A failure the API maps onto an OpenAI error."""


class EngineOverloaded(EngineError):
    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ContextLengthExceeded(EngineError):
    pass


class EngineClosed(EngineError):
    pass


def context_problem(prompt_tokens: int, max_tokens: int, context_length: int) -> str | None:
    """Why a prompt plus max_tokens cannot fit the context, in OpenAI's words; None when it fits."""
    needed = prompt_tokens + max_tokens
    if needed <= context_length:
        return None
    return (f"This model's maximum context length is {context_length} tokens. However, you requested {needed} tokens "
            f"({prompt_tokens} in the prompt, {max_tokens} for the completion). Please reduce the prompt or the completion length.")


def check_context(request: GenerationRequest, context_length: int) -> None:
    """A prompt plus max_tokens beyond the context is refused, never truncated."""
    problem = context_problem(len(request.prompt_tokens), request.max_tokens, context_length)
    if problem is not None:
        raise ContextLengthExceeded(problem)


@dataclass(frozen=True)
class Capabilities:
    """An engine's name and flags (the Engine protocol's), known from its config before its weights
    load: a model loaded on demand shows them while it is not loaded."""

    name: str
    supports_grammar: bool
    supports_logprobs: bool
    supports_embeddings: bool
    supports_adapters: bool

    @classmethod
    def of(cls, engine: object, **config: bool) -> Capabilities:
        """An engine class's flags, with those its config decides."""
        return replace(cls(**{f.name: getattr(engine, f.name) for f in fields(cls)}), **config)

    def apply(self, engine: object) -> None:
        for f in fields(self):
            setattr(engine, f.name, getattr(self, f.name))


def refuse_unsupported(engine: Engine, request: GenerationRequest) -> None:
    """What a local engine refuses of a generation request for what it is, before the common checks."""
    if engine.supports_embeddings:
        raise EngineError("this model serves embeddings only")
    if request.sampling.grammar is not None and not engine.supports_grammar:
        raise EngineError("this model has no grammar vocabulary (an MLX folder not converted from a GGUF here); "
                          "response_format needs a model converted by the appliance or a llama.cpp model")


class UnknownAdapter(EngineError):
    pass


class AdapterInUse(EngineError):
    """An adapter to replace or unload is serving requests: try again once they finish."""


class UpstreamUnavailable(EngineError):
    """Every upstream of a model is refusing (open circuit breakers): fail fast, retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    scale: float  # the default when a request names the adapter without a scale
    active_requests: int = 0


@runtime_checkable
class Engine(Vocabulary, Protocol):  # the vocabulary's calls (engines/vocabulary.py), and these
    """Capabilities are attributes; the methods are few."""

    name: str
    supports_grammar: bool
    supports_logprobs: bool
    supports_embeddings: bool
    supports_adapters: bool  # LoRA adapters loaded and picked per request
    # Requests carry messages, not token ids: the engine (an upstream server) templates and
    # tokenizes them itself.
    takes_messages: bool

    @property
    def context_length(self) -> int: ...


    def generate(self, request: GenerationRequest) -> EventStream:
        """Validates and queues at once (raising EngineError subclasses); the stream yields events,
        and closing it early cancels the request and frees its slot at the next step."""
        ...

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One forward pass per group of inputs that fits (not one per input): pooled vectors, one
        float32 row per input, before any normalisation. Raises ContextLengthExceeded."""
        ...

    def adapters(self) -> list[AdapterInfo]:
        """The loaded adapters (none where adapters are not supported)."""
        ...

    def abort_all(self, message: str) -> None:
        """Ends every request in flight or waiting with an error event carrying 503 (the server is
        stopping): each stream still ends as a client can parse. Called on the event loop."""
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None:
        """Called once on the server's event loop before the first request (background tasks)."""
        ...

    def close(self) -> None: ...


@dataclass
class PrefixStats:
    """Counters since the model was loaded, read by /metrics."""

    prompt_tokens: int = 0
    reused_in_slot: int = 0  # the slot already held them
    reused_by_copy: int = 0  # copied from another slot's sequence
    reused_from_host: int = 0  # restored from host RAM
    host_saves: int = 0
    host_evictions: int = 0
    host_bytes: int = 0
    host_entries: int = 0
    swapped_out: int = 0  # requests set aside in host RAM because a shared KV pool ran out

    @property
    def reused(self) -> int:
        return self.reused_in_slot + self.reused_by_copy + self.reused_from_host

    @property
    def hit_ratio(self) -> float:
        return self.reused / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class SpeculationStats:
    drafted: int = 0  # drafted tokens sent for verification
    accepted: int = 0  # of those, kept
    verify_steps: int = 0  # slot-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True)
class EngineStats:
    slots_total: int
    slots_busy: int
    queue_depth: int
    prefix: PrefixStats | None = None
    speculation: SpeculationStats | None = None
    # Per slot: "idle", "prefill", "decode" or "waiting" (for another slot's prefix), and the
    # tokens its KV holds; free slots keep a cached prefix.
    slot_states: tuple[tuple[str, int], ...] = ()
    kv_capacity_tokens: int = 0
    upstreams: tuple[UpstreamStats, ...] = ()
    loaded: bool = True  # False: a model loaded on demand, not in memory now (its first request loads it)

    @property
    def kv_usage(self) -> float | None:
        """Fraction of KV cells held by requests in flight; None where the engine reports no KV (upstream, MLX).
        An idle slot's cached prefix counts as free: the next request may evict it."""
        if not self.kv_capacity_tokens:
            return None
        return sum(tokens for state, tokens in self.slot_states if state != "idle") / self.kv_capacity_tokens


@dataclass(frozen=True)
class UpstreamStats:
    """One upstream server of a model, as /metrics and the admin API show it."""

    name: str
    url: str
    breaker: str  # closed, open, half_open
    healthy: bool
    outstanding: int
    requests: int  # attempts sent there
    failures: tuple[tuple[str, int], ...]  # by kind (connect, timeout, overloaded, server, client, broken_stream)
    retries: int
    refused: int  # requests failed fast by the open breaker
