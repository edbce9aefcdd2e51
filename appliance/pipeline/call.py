"""One model call, whatever wire format asked for it: admit (rate limits), reserve the budget and
start the engine, run to the end or stream, settle what was used, record and trace it.

Chat completions, completions, the Responses API and each routed attempt go through here; how
an answer looks on the wire is a `Wire`'s business (appliance/wire/openai.py for chat and completions,
wire/responses.py for the Responses API). A call answers with the `n` choices its request asked
for (choices.py): one engine request each, one reservation and one settlement for them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry.trace import Span

from appliance.fleet.manager import ModelUnavailable
from appliance.fleet.registry import LoadedModel
from appliance.pipeline.gate import Admission
from appliance.pipeline.choices import ChoiceStreams, Collected, choice_request, total_finish, with_reasoning_tokens
from appliance.pipeline.context import Answer, CallContext, Receive, Remember, Wire
from appliance.pipeline.errors import APIError, invalid
from appliance.pipeline.prepare import Prepared
from appliance.prompt.reasoning import ReasoningSplit
from appliance.prompt.tool_calls import StreamParser, ToolCall, ToolPlan
from appliance.server.services import price_of
from appliance.server.tracing import annotate
from appliance.store.request_log import RequestRecord
from engines.interface import (
    ContextLengthExceeded,
    EngineClosed,
    EngineError,
    EngineOverloaded,
    FinishEvent,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
    UnknownAdapter,
    UpstreamUnavailable,
)
from engines.stream import EventStream

T = TypeVar("T")
# A stream that has sent nothing for this long says so (Claude Code ends one idle for 300 s; an
# 18,000-token prompt takes longer than that to read on two cores).
KEEPALIVE_S = 10.0


def failure_error(finish: FinishEvent) -> APIError:
    """The API error for a generation that ended in an error: an upstream's names its status."""
    if finish.error_status is None:
        return APIError(500, f"The model failed while generating: {finish.error}", type="server_error")
    kind = "invalid_request_error" if finish.error_status < 500 else "server_error"
    return APIError(finish.error_status, finish.error or "The upstream failed.", type=kind, code=finish.error_code,
                    retry_after_s=finish.retry_after_s)


def _engine_start(model: LoadedModel, request: GenerationRequest) -> EventStream:
    try:
        return model.engine.generate(request)
    except EngineError as exc:
        raise engine_refusal(exc, "messages") from None


def engine_refusal(exc: EngineError, prompt_param: str) -> APIError:
    """The API error for an engine's refusal to run a request; `prompt_param` names the field
    that was too long."""
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, EngineOverloaded):
        return APIError(503, f"The server is overloaded: {exc}. Retry shortly.", type="server_error", code="overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), type="server_error", code="unavailable", retry_after_s=5)
    if isinstance(exc, UnknownAdapter):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ModelUnavailable):  # not loaded in time, or can never fit the memory budget
        return APIError(exc.status, str(exc), type="server_error", code=exc.code, retry_after_s=exc.retry_after_s)
    if isinstance(exc, UpstreamUnavailable):
        return APIError(503, str(exc), type="server_error", code="upstream_unavailable", retry_after_s=exc.retry_after_s)
    return invalid(str(exc))


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it if the client goes away first (which frees its slot)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # our caller gave up (a timeout): the work, and the generation it reads, stop too
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "The client closed the request.", code="client_closed")
    return task.result()


@dataclass
class Call:
    """A generation admitted, reserved and running; `settle` (or `finish`) closes its books once.
    Its context names the model and the request as the engine runs it (max_tokens lowered when
    the budget covers less)."""

    ctx: CallContext
    admission: Admission
    events: ChoiceStreams  # one per choice
    started: float

    async def collect(self) -> list[Collected]:
        """Reads every choice to its end (cancelled if the client goes first)."""
        return await until_disconnect(self.ctx.receive, self.events.collect(self.ctx.chosen()[1].splitter))

    def total(self, ended: Mapping[int, FinishEvent]) -> FinishEvent | None:
        """The whole call's finish, given the choices that have ended (choices.total_finish)."""
        return total_finish(ended, len(self.events), self.events.tokens_pushed)

    def settle(self, finish: FinishEvent | None) -> tuple[int, int, str]:
        """Settle and record the generation, however it ended, and note it on its engine span: a
        finish event carries the engine's usage; without one (a client gone, a timeout) the
        request pays for the tokens generated so far. Returns (prompt, completion, outcome)."""
        ctx, admission, traced = self.ctx, self.admission, self.ctx.trace
        if finish is not None:
            prompt, completion, outcome = finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.reason
            record(ctx, self.started, finish, None)
        else:
            prompt, completion = admission.progress() if admission.progress else (0, 0)
            outcome = "cancelled"
            record(ctx, self.started, None, "cancelled", completion)
        ctx.services.gate.settle(admission, prompt, completion, outcome)
        with traced.child("budget.settle", outcome=outcome, prompt_tokens=prompt, completion_tokens=completion, reserved=admission.reserved):
            pass  # the write itself is queued to the store thread; this marks what was settled, and when
        if traced.engine is not None:
            annotate(traced.engine, prompt_tokens=prompt, completion_tokens=completion, finish_reason=outcome,
                     cached_prompt_tokens=finish.usage.cached_prompt_tokens if finish else None,
                     time_to_first_token_s=finish.time_to_first_token_s if finish else None)
            if finish is not None and finish.upstream is not None:
                annotate(traced.engine, upstream__name=finish.upstream, upstream__attempts=finish.upstream_attempts)
        return prompt, completion, outcome

    def finish(self, ended: Mapping[int, FinishEvent]) -> FinishEvent | None:
        """Settle, and end the request's trace: this call was the whole request. `ended`: the
        choices that reached their finish event, by index. Returns the whole call's finish."""
        total = self.total(ended)
        prompt, completion, outcome = self.settle(total)
        model, prepared = self.ctx.chosen()
        # Why each choice ended; one cut short by another's failure or a client gone was cancelled.
        reasons = [ended[i].reason if i in ended else "cancelled" for i in range(len(self.events))]
        self.ctx.trace.answered(prepared.request.id, model.settings.alias, reasons, prompt, completion)
        self.ctx.trace.end(cost__nanousd=price_of(model).cost(prompt, completion) if self.admission.reserved else None)
        return total


async def start(ctx: CallContext, attempt: Span | None = None) -> Call:
    """Rate limits, then the engine and the budget reservation together: the prompt's prefill
    overlaps the ledger's write, and no token is read before the reservation stands. A refusal
    cancels the queued generation; a lowered max_tokens restarts it (the slot keeps the prompt's KV).
    Every choice is reserved for (max_tokens each) and started at once. The request reuses only
    prefixes its caller's tenant computed (the model's prefix_sharing says otherwise)."""
    model, prepared = ctx.chosen()
    principal, traced = ctx.principal, ctx.trace
    prepared = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, prefix_scope=model.prefix_scope(principal.tenant)))
    gate = ctx.services.gate
    pending = gate.begin(principal, prepared.request.id, model.settings.alias, price_of(model),
                         prepared.request.prompt_length, prepared.request.max_tokens, prepared.choices)
    try:
        events = _engine_starts(model, prepared)
    except BaseException:
        gate.abandon(pending)
        raise
    traced.start_engine(attempt, model=model.settings.alias, prompt_tokens=prepared.request.prompt_length,
                        max_tokens=prepared.request.max_tokens, choices=prepared.choices if prepared.choices != 1 else None,
                        adapters=",".join(f"{name}:{scale:g}" for name, scale in prepared.request.adapters) or None)
    try:
        with traced.child("budget.reserve") as span:
            admission = await gate.admitted(pending)
            annotate(span, reserved=admission.reserved, max_tokens=admission.max_tokens)
    except BaseException:
        events.close()
        raise
    if admission.max_tokens != prepared.request.max_tokens:
        events.close()
        prepared = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, max_tokens=admission.max_tokens))
        try:
            events = _engine_starts(model, prepared)
        except BaseException:
            gate.settle(admission, 0, 0, "refused")
            raise
    prompt_len = prepared.request.prompt_length
    admission.progress = lambda: (prompt_len, events.tokens_pushed)
    return Call(dataclasses.replace(ctx, prepared=prepared), admission, events, time.time())


def _engine_starts(model: LoadedModel, prepared: Prepared) -> ChoiceStreams:
    """One engine request per choice, all or none: a refused one cancels those queued before it."""
    streams: list[EventStream] = []
    try:
        for index in range(prepared.choices):
            streams.append(_engine_start(model, choice_request(prepared.request, index)))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return ChoiceStreams(streams)


async def respond(ctx: CallContext, headers: dict[str, str] | None = None,
                  remember_for: Callable[[CallContext], Remember | None] | None = None) -> Answer:
    """The whole request is one model call: run it and answer in the wire's format, whole or
    streamed. `remember_for` gives what to do with a finished answer (the semantic cache's store),
    given the call as it ran."""
    model, prepared = ctx.chosen()
    created = int(time.time())
    asked = prepared.request.max_tokens
    # A model not loaded yet: the stream's headers wait for its first event too (a load that times out is a 503).
    cold = getattr(model.engine, "loaded", True) is False
    call = await start(ctx)
    _, running = call.ctx.chosen()
    headers = dict(headers or {})
    if call.admission.max_tokens != asked:
        # The budget could not cover the asked max_tokens; the response says what it allowed.
        headers["x-budget-max-tokens"] = str(call.admission.max_tokens)
    wire = ctx.wire_for(running, model.settings.alias, created)
    # The cache keeps one answer to a question: n > 1 bypasses it (policy/answer_cache.py), so only one choice is remembered.
    remember = remember_for(call.ctx) if remember_for is not None and running.choices == 1 else None
    if ctx.stream:
        # A grammar compiles off the loop after `generate` returns: one llama.cpp refuses is an HTTP error too.
        if model.engine.takes_messages or cold or running.request.sampling.grammar is not None:
            await _first_event_or_error(call)
        return Answer(_sse(call, wire, remember), headers, wire.media_type)
    collected: list[Collected] = []
    try:
        collected = await call.collect()
        if remember is not None:
            remember(collected[0].text, collected[0].finish)
    finally:
        total = call.finish(dict(enumerate(c.finish for c in collected)))
    assert total is not None
    if total.reason == "error":
        raise failure_error(total)
    return Answer(wire.full(collected, total), headers)


async def _first_event_or_error(call: Call) -> None:
    """For an upstream, the stream's headers wait for its first event: a refusal or an outage
    before any token is then an HTTP error with the upstream's status, not a 200 with an error
    inside (retries happen in that wait too)."""
    try:
        index, first = await until_disconnect(call.ctx.receive, call.events.peek())
    except BaseException:
        call.events.close()
        call.finish({})
        raise
    if isinstance(first, FinishEvent) and first.reason == "error":
        call.events.close()
        call.finish({index: first})
        raise failure_error(first)


class Outgoing:
    """Generated text on its way to a wire: a reasoning model's reasoning apart, then content as
    deltas, or, with tools offered, calls as they complete (text that may open a call is held
    until it is known to be one or not)."""

    def __init__(self, wire: Wire, tools: ToolPlan | None, index: int, split: ReasoningSplit | None = None) -> None:
        self.wire, self.index = wire, index  # one per choice: its own parser, its calls numbered from 0
        self.parser = StreamParser(tools) if tools is not None else None
        self.split = split
        self.calls = 0
        self.reasoning_tokens = 0
        self.content: list[str] = []  # the answer as sent (what the cache keeps)

    def token(self, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        """A generated token's text (a finish event's held-back text is `text`)."""
        if self.split is None:
            return self.text(text, logprob)
        reasoning, content, inside = self.split.feed_token(text)
        self.reasoning_tokens += inside
        # A reasoning token's logprob is not the answer's: only the answer's are sent.
        return self._reasoning(reasoning) + self.text(content, None if inside else logprob)

    def text(self, text: str, logprob: TokenLogprob | None) -> list[bytes]:
        self.content.append(text)
        if self.parser is None:
            return self.wire.delta(self.index, text, logprob) if text or logprob is not None else []
        return self._frames(self.parser.feed(text))

    def finished(self, event: FinishEvent) -> tuple[list[bytes], FinishEvent]:
        """The frames of the finish event's own text and whatever was held, and the event with its
        reasoning tokens counted."""
        if self.split is None:
            return self.text(event.text, None) + self.end(), event
        reasoning, content = self.split.feed(event.text)  # held-back text, no token of its own
        frames = self._reasoning(reasoning) + self.text(content, None)
        reasoning, content = self.split.end()
        frames += self._reasoning(reasoning) + self.text(content, None) + self.end()
        return frames, with_reasoning_tokens(event, self.reasoning_tokens)

    def end(self) -> list[bytes]:
        """What the parser still held when the answer ended."""
        return self._frames(self.parser.end()) if self.parser is not None else []

    def _reasoning(self, text: str) -> list[bytes]:
        return self.wire.reasoning(self.index, text) if text else []

    def _frames(self, outs: list[str | ToolCall]) -> list[bytes]:
        frames: list[bytes] = []
        for out in outs:
            if isinstance(out, str):
                frames += self.wire.delta(self.index, out, None) if out else []
            else:
                frames += self.wire.tool_call(self.index, out, self.calls)
                self.calls += 1
        return frames


async def _sse(call: Call, wire: Wire, remember: Remember | None) -> AsyncIterator[bytes]:
    """The choices' events as they come, each piece naming its choice; the answer ends when every
    choice has, or at the first failure (which stops the others)."""
    ended: dict[int, FinishEvent] = {}
    events = call.events
    prepared = call.ctx.chosen()[1]
    outs: dict[int, Outgoing] = {}

    def outgoing(index: int) -> Outgoing:
        if index not in outs:
            outs[index] = Outgoing(wire, prepared.tools, index, prepared.splitter())
        return outs[index]

    try:
        for frame in wire.opening(len(events)):
            yield frame
        async for item in _with_keepalive(events.events(), KEEPALIVE_S):
            if item is None:
                for frame in wire.keepalive():
                    yield frame
                continue
            index, event = item
            if isinstance(event, TokenEvent):
                for frame in outgoing(index).token(event.text, event.logprob):
                    yield frame
                continue
            if event.reason == "error":
                ended[index] = event
                events.close()  # the other choices stop too, charged for what they made
                total = call.total(ended)
                assert total is not None
                # Ended as a client can parse: the error in the wire's form, then its close.
                for frame in wire.failed(failure_error(event), total):
                    yield frame
                break
            frames, event = outgoing(index).finished(event)
            ended[index] = event
            frames += wire.closing(index, event)
            total = call.total(ended)
            if total is not None:
                frames += wire.ending(total)
                if remember is not None:  # one choice only, its answer without the reasoning
                    remember("".join(outgoing(0).content), total)
            for frame in frames:
                yield frame
    finally:
        events.close()  # a client gone mid-stream lands here: the slots are freed at the next step
        call.finish(ended)


async def _with_keepalive(items: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """The items, with a None after every `every` seconds in which none came. The next item is
    awaited in a task of its own, so a keepalive never cancels the wait for it."""
    iterator = aiter(items)
    waiting: asyncio.Future[T] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({waiting}, timeout=every)
            if not done:
                yield None
                continue
            ready, waiting = waiting, None
            try:
                item = ready.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if waiting is not None:
            waiting.cancel()


def _pieces(text: str) -> list[str]:
    """A known answer streamed in word-sized chunks, as a model would have."""
    return re.findall(r"\s*\S+\s*|\s+", text) or [text]


async def replay(wire: Wire, text: str, finish: FinishEvent, tools: ToolPlan | None, reasoning: str = "") -> AsyncIterator[bytes]:
    """A known answer (a cache hit, a routed answer validated before it is sent: one choice) as
    the stream a model would have sent: its reasoning, if any, first."""
    out = Outgoing(wire, tools, 0)
    for frame in wire.opening(1):
        yield frame
    for piece in _pieces(reasoning) if reasoning else []:
        for frame in wire.reasoning(0, piece):
            yield frame
    for piece in _pieces(text):
        for frame in out.text(piece, None):
            yield frame
    for frame in [*out.end(), *wire.closing(0, finish), *wire.ending(finish)]:
        yield frame


def known_answer(ctx: CallContext, model_name: str, text: str, logprobs: list[TokenLogprob], finish: FinishEvent, started: float,
                 headers: dict[str, str], reasoning: str = "") -> Answer:
    """An answer already in hand (a cache hit, a routed answer validated before it is sent), whole
    or replayed as a stream, for the request `ctx` prepared; a routed answer keeps its model's reasoning."""
    _, prepared = ctx.chosen()
    wire = ctx.wire_for(prepared, model_name, int(started))
    if not ctx.stream:
        return Answer(wire.full([Collected(text, logprobs, finish, reasoning)], finish), headers)
    return Answer(replay(wire, text, finish, prepared.tools, reasoning), headers, wire.media_type)


def record(ctx: CallContext, started: float, finish: FinishEvent | None, status: str | None, completion_tokens: int | None = None,
           cost_nanos: int | None = None) -> None:
    """Metrics and the request log for one finished (or abandoned) generation."""
    model, prepared = ctx.chosen()
    principal = ctx.principal
    alias = model.settings.alias
    now = time.time()
    if finish is not None:
        status = status or ("ok" if finish.reason in ("stop", "length") else finish.reason)
    status = status or "error"
    m = ctx.services.metrics
    m.requests.labels(alias, ctx.endpoint, status).inc()
    prompt_tokens = finish.usage.prompt_tokens if finish is not None else prepared.request.prompt_length
    if completion_tokens is None:
        completion_tokens = finish.usage.completion_tokens if finish else 0
    # A cache hit replays a stored answer: no model computed a first token or generated a token.
    hit = status == "cache_hit"
    ttft = finish.time_to_first_token_s if finish is not None and not hit else None
    m.prompt_tokens.labels(alias).inc(prompt_tokens)
    if not hit:
        m.completion_tokens.labels(alias).inc(completion_tokens)
    if finish is not None:
        m.cached_prompt_tokens.labels(alias).inc(finish.usage.cached_prompt_tokens)
        if ttft is not None:
            m.ttft.labels(alias).observe(ttft)
            decode_time = finish.total_time_s - ttft
            if completion_tokens > 1 and decode_time > 0:
                m.tokens_per_second.labels(alias).observe((completion_tokens - 1) / decode_time)
        if finish.queue_time_s is not None:
            m.queue_seconds.labels(alias).observe(finish.queue_time_s)
        if finish.inter_token_s:
            gaps = m.inter_token_seconds.labels(alias)
            for gap in finish.inter_token_s:
                gaps.observe(gap)
    m.request_seconds.labels(alias).observe(now - started)
    if status != "cache_hit":  # a hit replays a stored answer: the engine ended nothing
        m.finish_reasons.labels(alias, finish.reason if finish is not None else "cancelled").inc()
    # A routed call records each tier it asked: the line shows the last, and every tier's tokens.
    notes = ctx.notes
    notes.update(model=alias, status=status, tiers=notes.get("tiers", 0) + 1,
                 prompt_tokens=notes.get("prompt_tokens", 0) + prompt_tokens,
                 completion_tokens=notes.get("completion_tokens", 0) + (0 if hit else completion_tokens))
    ctx.services.request_log.record(
        RequestRecord(
            id=prepared.request.id,
            created_at=started,
            endpoint=ctx.endpoint,
            model=alias,
            status=status,
            finish_reason=finish.reason if finish else None,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            total_ms=(now - started) * 1000,
            error=finish.error if finish else None,
            tenant=principal.tenant,
            app=principal.app,
            user=principal.user,
            key_id=principal.key_id,
            cost_nanos=price_of(model).cost(prompt_tokens, completion_tokens) if cost_nanos is None else cost_nanos,
        )
    )
