"""One request on its way through the pipeline, as one value.

The HTTP layer's prologue (appliance/http/prologue.py) makes a CallContext once it knows who is
calling; the handler says how the answer is written (its wire format, streamed or whole), and the
pipeline's steps (flow.py, routed.py, cached.py, call.py) pass it down, adding the model and the
request prepared for it once they are chosen. It is frozen: a step that chooses something makes a
new context (`serving`), so what a caller handed down never changes under it.

What comes back is an Answer (a JSON body or a stream of SSE frames, and its headers), which the
HTTP layer turns into a response; the pipeline imports nothing of HTTP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.fleet.registry import LoadedModel
from appliance.pipeline.choices import Collected
from appliance.pipeline.errors import APIError
from appliance.pipeline.prepare import Prepared
from appliance.prompt.tool_calls import ToolCall
from appliance.server.services import Services
from appliance.server.tracing import RequestTrace
from engines.interface import FinishEvent, TokenLogprob
from policy.identity import Principal


class Wire(Protocol):
    """One answer in one wire format: whole, or as the stream's pieces (each a list of SSE frames).
    An answer has one choice or several (`n`); a streamed piece names its choice by index, and
    `total` is the whole answer's finish (usage counting the prompt once)."""

    media_type: str  # a stream's: SSE (text/event-stream), or Ollama's NDJSON

    def full(self, choices: Sequence[Collected], total: FinishEvent) -> bytes: ...
    def opening(self, choices: int) -> list[bytes]: ...
    def delta(self, index: int, text: str, logprob: TokenLogprob | None) -> list[bytes]: ...
    def reasoning(self, index: int, text: str) -> list[bytes]: ...  # a reasoning model's reasoning, before its answer
    def tool_call(self, index: int, call: ToolCall, position: int) -> list[bytes]: ...  # choice `index`'s call number `position`
    def closing(self, index: int, finish: FinishEvent) -> list[bytes]: ...  # choice `index` ended
    def ending(self, total: FinishEvent) -> list[bytes]: ...  # every choice has ended
    def failed(self, error: APIError, total: FinishEvent) -> list[bytes]: ...
    def keepalive(self) -> list[bytes]: ...  # said while nothing else comes (a long prefill), so a client's idle timer waits


# The wire for an answer: (the request as answered, the model name to show, created at).
WireFor = Callable[[Prepared, str, int], Wire]
# What to do with a finished answer's text (the semantic cache's store, distillation's keeper).
Remember = Callable[[str, FinishEvent], None]
# The client's side of the connection (ASGI `receive`): a disconnect cancels what it waits on.
Receive = Callable[[], Awaitable[Any]]


@dataclass(frozen=True)
class Answer:
    """What the pipeline answers with: one JSON body, or the SSE frames of a stream, and headers."""

    body: bytes | AsyncIterator[bytes]
    headers: dict[str, str]
    media_type: str = "text/event-stream"  # a stream's; a whole body is JSON


@dataclass(frozen=True)
class CallContext:
    services: Services
    principal: Principal
    request_id: str  # the call's id (`chatcmpl-…`): the body's `id`, the ledger's and the trace's
    trace: RequestTrace
    endpoint: str  # what the request log and the model policy call it: chat, completion, embeddings
    receive: Receive
    cache_control: str | None = None  # the caller's Cache-Control header (no-cache, no-store)
    wire: WireFor | None = None  # how the answer is written; the handler says, once the body is read
    stream: bool = False
    model: LoadedModel | None = None  # the model that serves it, once chosen
    prepared: Prepared | None = None  # the engine's request for that model
    # What the access log tells of this call (model, tokens, cache and route outcome): one dict the
    # HTTP layer also holds, filled as the steps learn it; never prompt text.
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def answering(self, wire: WireFor, stream: bool) -> CallContext:
        return dataclasses.replace(self, wire=wire, stream=stream)

    def serving(self, model: LoadedModel, prepared: Prepared) -> CallContext:
        return dataclasses.replace(self, model=model, prepared=prepared)

    def chosen(self) -> tuple[LoadedModel, Prepared]:
        """The model and its request, for the steps that run after they are chosen."""
        assert self.model is not None and self.prepared is not None, "a model is chosen before it is called"
        return self.model, self.prepared

    def wire_for(self, prepared: Prepared, model_name: str, created: int) -> Wire:
        assert self.wire is not None, "the handler names the wire format before the pipeline answers"
        return self.wire(prepared, model_name, created)
