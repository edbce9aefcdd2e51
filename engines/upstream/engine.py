"""An engine whose model runs elsewhere: an OpenAI-compatible server (vLLM, llama.cpp's server,
Ollama, another appliance, a hosted API). The appliance stays the policy layer in front of it.

Everything here runs on the server's event loop: one task per request and one health task, all
owned by the engine and cancelled by `close()`. The decisions (breakers, balancing, retries) are
pure functions in `engines.upstream.policy`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NoReturn

import httpx

from engines.interface import (
    SHUTDOWN_RETRY_AFTER_S,
    SHUTTING_DOWN,
    AdapterInfo,
    EngineClosed,
    EngineError,
    EngineStats,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    UpstreamStats,
    UpstreamUnavailable,
    Usage,
)
from engines.stream import EventStream
from engines.upstream import policy
from engines.upstream.policy import Breaker, BreakerPolicy, Candidate, FailureKind, RetryPolicy
from engines.upstream.wire import CallText, ChunkError, DataLines, Piece, ThinkText, error_message, parse_chunk, request_body

log = logging.getLogger("appliance.upstream")


@dataclass(frozen=True)
class Upstream:
    name: str  # shown in errors, metrics and the admin API: the configured name or host:port
    base_url: str  # up to and including /v1
    model: str  # the model's name on that server
    api_key: str | None = None  # read from the environment variable the config names


@dataclass(frozen=True)
class UpstreamConfig:
    alias: str
    upstreams: tuple[Upstream, ...]
    context_length: int
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # the longest silence: before the first token or between two
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    health_interval_s: float = 15.0  # 0: no background health checks


class _Failure(Exception):
    def __init__(self, kind: FailureKind, message: str, status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.status, self.retry_after_s = kind, status, retry_after_s


# How the API answers each kind of failure: (status, code). A caller's bad request keeps the
# upstream's status; the others are the gateway's.
_ANSWER: dict[FailureKind, tuple[int, str]] = {
    "connect": (502, "upstream_unreachable"),
    "timeout": (504, "upstream_timeout"),
    "overloaded": (503, "upstream_overloaded"),
    "server": (502, "upstream_error"),
    "client": (400, "upstream_rejected"),
    "broken_stream": (502, "upstream_stream_broken"),
}


@dataclass
class _Upstream:
    """An upstream's state in this process."""

    spec: Upstream
    breaker: Breaker = field(default_factory=Breaker)
    healthy: bool = True
    outstanding: int = 0
    requests: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    refused: int = 0


class UpstreamEngine:
    name = "openai"
    supports_grammar = False  # a GBNF grammar cannot be sent; response_format is passed through
    supports_logprobs = True
    supports_embeddings = False
    supports_adapters = False
    takes_messages = True

    def __init__(self, config: UpstreamConfig, rng: random.Random | None = None) -> None:
        if not config.upstreams:
            raise ValueError("an upstream model needs at least one upstream")
        self.config = config
        self._upstreams = [_Upstream(u) for u in config.upstreams]
        self._rng = rng or random.Random()
        self._turn = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._aborting: str | None = None  # why every request in flight was ended (the server stopping)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health: asyncio.Task[None] | None = None
        self._closed = False

    # -- the Engine interface ------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        raise EngineError(f"The model '{self.config.alias}' runs upstream; its tokenizer is not available here.")

    def detokenize(self, tokens: list[int]) -> str:
        raise EngineError(f"The model '{self.config.alias}' runs upstream; its tokenizer is not available here.")

    def vocab_size(self) -> int:
        return 0

    def add_bos(self) -> bool:
        return False

    def chat_template(self) -> str | None:
        return None  # the upstream applies its own

    def special_tokens(self) -> dict[str, str]:
        return {}

    def control_tokens(self) -> dict[str, int]:
        return {}

    def adapters(self) -> list[AdapterInfo]:
        return []

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        raise EngineError(f"The model '{self.config.alias}' runs upstream and does not serve embeddings here.")

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        timeout = httpx.Timeout(connect=self.config.connect_timeout_s, read=self.config.read_timeout_s,
                                write=self.config.read_timeout_s, pool=self.config.connect_timeout_s)
        # Connections are kept alive per upstream; no proxy from the environment: these are
        # servers the operator named, usually on the local network.
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, limits=httpx.Limits(max_keepalive_connections=32))
        if self.config.health_interval_s > 0:
            self._health = asyncio.create_task(self._check_health_forever(), name=f"upstream-health-{self.config.alias}")

    def generate(self, request: GenerationRequest) -> EventStream:
        if self._closed:
            raise EngineClosed(f"The model '{self.config.alias}' is shutting down.")
        if self._client is None:
            raise EngineClosed(f"The model '{self.config.alias}' has not started.")
        if not request.messages:
            raise EngineError(f"The model '{self.config.alias}' runs upstream and serves chat completions only.")
        if request.sampling.grammar is not None:
            raise EngineError(f"The model '{self.config.alias}' runs upstream and cannot be constrained by a grammar.")
        if request.adapters:
            raise EngineError(f"The model '{self.config.alias}' runs upstream and has no adapters here.")
        now = time.monotonic()
        if not any(policy.may_pass(u.breaker, self.config.breaker, now) for u in self._upstreams):
            for u in self._upstreams:
                u.refused += 1
            wait = min(u.breaker.reopens_at(self.config.breaker) for u in self._upstreams) - now
            names = ", ".join(f"'{u.spec.name}'" for u in self._upstreams)
            raise UpstreamUnavailable(f"The upstream {names} of model '{self.config.alias}' is failing; the circuit is open for "
                                      f"{max(0.0, wait):.0f} s more.", retry_after_s=max(1, math.ceil(wait)))
        stream = EventStream(asyncio.get_running_loop())
        task = asyncio.create_task(self._serve(request, stream), name=f"upstream-{request.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        stream.on_close = task.cancel
        return stream

    @property
    def busy(self) -> int:
        """Requests in flight (their streams included): a replaced model is closed only once this is 0."""
        return len(self._tasks)

    def stats(self) -> EngineStats:
        busy = sum(u.outstanding for u in self._upstreams)
        return EngineStats(slots_total=0, slots_busy=busy, queue_depth=0, upstreams=tuple(
            UpstreamStats(u.spec.name, u.spec.base_url, u.breaker.state, u.healthy, u.outstanding, u.requests,
                          tuple(sorted(u.failures.items())), u.retries, u.refused)
            for u in self._upstreams))

    def close(self) -> None:
        """From any thread: cancels every request in flight and the health checks."""
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        done = asyncio.run_coroutine_threadsafe(self._shutdown(), loop) if not _on_loop(loop) else None
        if done is not None:
            try:
                done.result(timeout=5)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
                log.warning("upstream engine %s: shutdown did not finish in 5 s", self.config.alias)
        else:
            loop.create_task(self._shutdown())

    async def _shutdown(self) -> None:
        tasks = [t for t in (*self._tasks, self._health) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    # -- one request ---------------------------------------------------------------------------

    def abort_all(self, message: str) -> None:
        """Ends every request in flight with a 503 (the server is stopping). On the event loop."""
        self._aborting = message
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, request: GenerationRequest, stream: EventStream) -> None:
        started = time.monotonic()
        counted = _Counted()
        try:
            await self._attempts(request, stream, counted, started)
        except asyncio.CancelledError:
            if self._aborting is not None:
                usage = counted.usage(request) if counted.streamed or counted.reported else Usage(0, 0)
                stream.push(FinishEvent("error", usage, time_to_first_token_s=counted.first_token_s, total_time_s=time.monotonic() - started,
                                        error=self._aborting, error_status=503, error_code=SHUTTING_DOWN,
                                        retry_after_s=SHUTDOWN_RETRY_AFTER_S))
            raise

    async def _attempts(self, request: GenerationRequest, stream: EventStream, counted: _Counted, started: float) -> None:
        tried: set[int] = set()
        attempt = 0
        while True:
            attempt += 1
            index = self._choose(tried)
            if index is None:
                stream.push(self._error_finish(counted, request, started, "overloaded",
                                               f"Every upstream of model '{self.config.alias}' is failing (circuit open).", 503))
                return
            upstream = self._upstreams[index]
            upstream.outstanding += 1
            upstream.requests += 1
            try:
                finish = await self._stream_once(upstream.spec, request, counted, stream, started)
                stream.push(dataclasses.replace(finish, upstream=upstream.spec.name, upstream_attempts=attempt))
            except _Failure as failure:
                self._record_failure(upstream, failure.kind)
                if policy.may_retry(failure.kind, attempt, counted.streamed, self.config.retry):
                    upstream.retries += 1
                    tried.add(index)
                    delay = policy.backoff(attempt, self.config.retry, self._rng, failure.retry_after_s)
                    log.info("upstream %s of %s failed (%s: %s); retry %d in %.2f s", upstream.spec.name, self.config.alias,
                             failure.kind, failure, attempt, delay)
                    await asyncio.sleep(delay)
                    continue
                finish = self._error_finish(counted, request, started, failure.kind,
                                            f"The upstream '{upstream.spec.name}' of model '{self.config.alias}' failed: {failure}",
                                            failure.status, failure.retry_after_s)
                stream.push(dataclasses.replace(finish, upstream=upstream.spec.name, upstream_attempts=attempt))
                return
            except asyncio.CancelledError:
                upstream.breaker = policy.released(upstream.breaker)  # no verdict on a probe the caller abandoned
                raise
            else:
                upstream.breaker = policy.succeeded(upstream.breaker)
                return
            finally:
                upstream.outstanding -= 1

    def _choose(self, tried: set[int]) -> int | None:
        now = time.monotonic()
        candidates = [Candidate(u.outstanding, policy.may_pass(u.breaker, self.config.breaker, now), u.healthy) for u in self._upstreams]
        index = policy.pick(candidates, frozenset(tried), self._turn)
        if index is None:
            return None
        self._turn += 1
        admitted = policy.admit(self._upstreams[index].breaker, self.config.breaker, now)
        assert admitted is not None  # pick only offers upstreams whose breakers pass, and nothing ran in between
        self._upstreams[index].breaker = admitted
        return index

    def _record_failure(self, upstream: _Upstream, kind: FailureKind) -> None:
        upstream.failures[kind] += 1
        if policy.counts_against_upstream(kind):
            upstream.breaker = policy.failed(upstream.breaker, self.config.breaker, time.monotonic())
        else:
            upstream.breaker = policy.released(upstream.breaker)

    def _error_finish(self, counted: _Counted, request: GenerationRequest, started: float, kind: FailureKind, message: str,
                      status: int | None = None, retry_after_s: float | None = None) -> FinishEvent:
        answer_status, code = _ANSWER[kind]
        if kind == "client" and status is not None:
            # The caller's request, refused upstream: its status, but an upstream that refuses our
            # credentials is the operator's problem, not the caller's.
            answer_status, code = (502, "upstream_auth") if status in (401, 403) else (status if status != 422 else 400, code)
        # Nothing streamed and no count reported: as far as anyone can tell, nothing was used.
        usage = counted.usage(request) if counted.streamed or counted.reported else Usage(0, 0)
        return FinishEvent("error", usage, time_to_first_token_s=counted.first_token_s,
                           total_time_s=time.monotonic() - started, error=message, error_status=answer_status, error_code=code,
                           retry_after_s=math.ceil(retry_after_s) if retry_after_s else None)

    async def _stream_once(self, upstream: Upstream, request: GenerationRequest, counted: _Counted, stream: EventStream,
                           started: float) -> FinishEvent:
        """One attempt: relays its tokens into `stream` and returns its finish, or raises _Failure."""
        assert self._client is not None
        headers = {"Accept": "text/event-stream"}
        if upstream.api_key:
            headers["Authorization"] = f"Bearer {upstream.api_key}"
        body = request_body(request, upstream.model)
        try:
            async with self._client.stream("POST", f"{upstream.base_url}/chat/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    await _refused(response)
                finish = await self._relay(response, request, stream, counted, started)
        except httpx.ConnectError as exc:
            raise _Failure("connect", f"cannot connect to {upstream.base_url} ({exc})") from None
        except httpx.TimeoutException as exc:
            what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "waiting for tokens"
            kind: FailureKind = "connect" if isinstance(exc, httpx.ConnectTimeout) else ("broken_stream" if counted.streamed else "timeout")
            raise _Failure(kind, f"timed out {what} ({type(exc).__name__})") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            kind = "broken_stream" if counted.streamed else "server"
            raise _Failure(kind, f"the connection broke ({type(exc).__name__}: {exc})") from None
        return finish

    async def _relay(self, response: httpx.Response, request: GenerationRequest, stream: EventStream, counted: _Counted,
                     started: float) -> FinishEvent:
        """Passes each chunk on as it arrives; returns the finish event."""
        reason: FinishReason | None = None
        lines = DataLines()
        done = False
        async for block in response.aiter_bytes():
            for data in lines.feed(block):
                done = data == b"[DONE]"
                if done:
                    break
                reason = self._take(data, stream, counted, started) or reason
            if done:
                break
        if not done:  # a last line without its newline
            for data in lines.end():
                if data != b"[DONE]":
                    reason = self._take(data, stream, counted, started) or reason
        if reason is None:
            raise _Failure("broken_stream" if counted.streamed else "server", "the stream ended without a finish reason")
        tail = counted.thought.close() + counted.calls.close()  # reasoning or a tool call still open ends with the stream
        if tail:
            stream.push(TokenEvent(tail, -1))
        return FinishEvent(reason, counted.usage(request), time_to_first_token_s=counted.first_token_s,
                           total_time_s=time.monotonic() - started)

    def _take(self, data: bytes, stream: EventStream, counted: _Counted, started: float) -> FinishReason | None:
        """One chunk: its tokens go out at once; returns its finish reason, if it has one."""
        try:
            piece = parse_chunk(data)
        except ChunkError as exc:
            raise _Failure("broken_stream" if counted.streamed else "server", str(exc)) from None
        if piece.error is not None:
            raise _Failure("broken_stream" if counted.streamed else "server", f"error in the stream: {piece.error}")
        for event in counted.events(piece, started):
            stream.push(event)
        if piece.usage is not None:
            counted.reported = piece.usage
        return piece.finish_reason

    # -- health --------------------------------------------------------------------------------

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._check_health(u) for u in self._upstreams))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check_health(self, upstream: _Upstream) -> None:
        """GET /models: any answer below 500 is a live server. A health check speaks for the
        breaker as a request would, so a dead upstream is skipped before a caller pays for
        finding out, and one that came back is trusted again after its cooldown."""
        assert self._client is not None
        headers = {"Authorization": f"Bearer {upstream.spec.api_key}"} if upstream.spec.api_key else {}
        try:
            response = await self._client.get(f"{upstream.spec.base_url}/models", headers=headers,
                                              timeout=self.config.connect_timeout_s)
            alive = response.status_code < 500
        except httpx.HTTPError:
            alive = False
        if alive != upstream.healthy:
            log.warning("upstream %s of %s is %s", upstream.spec.name, self.config.alias, "back" if alive else "not answering")
        upstream.healthy = alive
        now = time.monotonic()
        if alive and upstream.breaker.state != "closed" and policy.may_pass(upstream.breaker, self.config.breaker, now):
            upstream.breaker = policy.succeeded(upstream.breaker)
        elif not alive and upstream.breaker.state != "half_open":
            upstream.breaker = policy.failed(upstream.breaker, self.config.breaker, now)


class _Counted:
    """What one request has received so far, across its attempts: the usage counts locally when
    the upstream reports none (a streamed token per chunk, or per log-probability when present)."""

    def __init__(self) -> None:
        self.streamed = False  # a token went out to the caller: from here on no retry
        self.tokens = 0
        self.first_token_s: float | None = None
        self.reported: tuple[int, int, int, int] | None = None
        self.calls = CallText()
        self.thought = ThinkText()

    def events(self, piece: Piece, started: float) -> list[TokenEvent]:
        if piece.tool_calls or piece.text or piece.reasoning:
            # Reasoning goes first, between markers the API splits off again (wire.ThinkText); content
            # after a call closes it; the calls go on as text the API reads back (wire.CallText).
            thought = self.thought.feed(piece.reasoning)
            if piece.text or piece.tool_calls:
                thought += self.thought.close()
            text = thought + (self.calls.close() if piece.text else "") + piece.text + self.calls.feed(piece.tool_calls)
            piece = dataclasses.replace(piece, text=text)
        if not piece.text and not piece.logprobs:
            return []
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - started
        self.streamed = True
        if not piece.logprobs:
            self.tokens += 1
            return [TokenEvent(piece.text, -1)]
        self.tokens += len(piece.logprobs)
        # One event per token for its log-probability; the chunk's text rides on the first.
        return [TokenEvent(piece.text if i == 0 else "", -1, lp) for i, lp in enumerate(piece.logprobs)]

    def usage(self, request: GenerationRequest) -> Usage:
        if self.reported is not None:
            prompt, completion, cached, reasoning = self.reported
            # The upstream's prefix cache serves every caller this server sends it: its count would
            # tell a scoped request what another scope sent, so only an unscoped request sees it.
            return Usage(prompt, completion, 0 if request.prefix_scope else cached, reasoning)
        return Usage(request.prompt_length, self.tokens)


async def _refused(response: httpx.Response) -> NoReturn:
    body = await response.aread()
    status = response.status_code
    retry_after = response.headers.get("retry-after")
    seconds = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    raise _Failure(policy.classify_status(status), f"HTTP {status}: {error_message(body)}", status, seconds)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
