"""The llama.cpp engine: one thread owns the model and runs the slot loop.

Each step: admit waiting requests into free slots, build one batch (every generating slot's
decode token first, then prompt chunks under a token budget), decode, sample each slot with its
own sampler, stream tokens out, release finished slots.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.base import (
    ContextLengthExceeded,
    EngineClosed,
    EngineError,
    EngineEvent,
    EngineOverloaded,
    EngineStats,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engines.llamacpp.runtime import Context, ContextShape, Model, Sampler
from engines.scheduler import BatchItem, SlotView, place, plan_batch
from engines.stream import EventStream
from engines.text import StopMatcher, Utf8Stream

log = logging.getLogger("appliance.llamacpp")

_ASYNC_SIGNALS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE") if hasattr(signal, name)}


@dataclass(frozen=True)
class LlamaCppConfig:
    path: Path
    slots: int
    context_length: int  # per slot
    batch_tokens: int
    threads: int
    max_queue: int
    batch_invariant: bool = True
    kv_type: str = "q8_0"
    embeddings: bool = False


def context_layout(batch_invariant: bool, kv_type: str) -> tuple[bool, bool]:
    """(kv_unified, flash_attn) for a model. Invariance needs one KV stream per sequence, and flash
    attention only where ggml's CPU kernel cannot switch paths by batch shape: its split-KV and tiled
    paths take f16/f32 KV only, so a q8_0 cache always runs the sequential one (docs/architecture.md)."""
    if not batch_invariant:
        return True, True
    return False, kv_type != "f16"


class _Job:
    """A request in flight. Mutated only by the model thread, except `cancelled`."""

    def __init__(self, request: GenerationRequest, sampler: Sampler, emit: Callable[[EngineEvent], None]) -> None:
        self.request = request
        self.sampler = sampler
        self.emit = emit
        self.cancelled = False
        self.slot = -1
        self.admitted_seq = 0
        self.n_past = 0
        self.pending_token: int | None = None
        self.generated = 0
        self.decoded: list[int] = []  # generated tokens whose KV is in the slot
        self.reused = 0  # prompt tokens served from the slot's KV
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(request.stop)
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None

    def view(self) -> SlotView:
        return SlotView(self.slot, self.admitted_seq, len(self.request.prompt_tokens), self.n_past, self.pending_token is not None)


class LlamaCppEngine:
    name = "llamacpp"
    supports_grammar = True
    supports_logprobs = True

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        self.supports_embeddings = config.embeddings
        self.model = Model(config.path, use_extra_buffers=not config.batch_invariant)
        try:
            kv_unified, flash_attn = context_layout(config.batch_invariant, config.kv_type)
            shape = ContextShape(
                n_seq=config.slots,
                n_ctx_per_seq=config.context_length,
                n_batch=config.batch_tokens,
                threads=config.threads,
                kv_unified=kv_unified,
                flash_attn=flash_attn,
                kv_type=config.kv_type,
                embeddings=config.embeddings,
            )
            self.ctx = Context(self.model, shape)
        except Exception:
            self.model.close()
            raise
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}
        # What each slot's KV sequence holds, kept after a request ends so the next prompt that
        # shares its prefix (a system prompt, a chat template's preamble) skips recomputing it.
        self._slot_tokens: dict[int, tuple[int, ...]] = {s: () for s in range(config.slots)}
        self._admissions = itertools.count()
        self._closing = False
        self._queued = 0  # submitted but not yet admitted; read by other threads for stats
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"llamacpp:{config.path.name}", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.ctx.n_ctx_per_seq

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def chat_template(self) -> str | None:
        return self.model.meta("tokenizer.chat_template")

    def special_tokens(self) -> dict[str, str]:
        return self.model.special_tokens()

    def add_bos(self) -> bool:
        return self.model.add_bos

    def vocab_size(self) -> int:
        return self.model.n_vocab

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.model.piece(t, special=True) for t in tokens).decode("utf-8", errors="replace")

    def generate(self, request: GenerationRequest) -> EventStream:
        """Validates and queues the request; raises at once on a request that cannot run."""
        if self._closing:
            raise EngineClosed("the model is shutting down")
        if self.config.embeddings:
            raise EngineError("this model is configured for embeddings only")
        needed = len(request.prompt_tokens) + request.max_tokens
        if needed > self.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{needed} tokens ({len(request.prompt_tokens)} in the prompt, {request.max_tokens} for the "
                f"completion). Please reduce the prompt or the completion length."
            )
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty")
        with self._lock:
            if self._queued >= self.config.max_queue + max(0, self.config.slots - len(self._active)):
                raise EngineOverloaded(f"the queue for this model is full ({self.config.max_queue} waiting)")
            self._queued += 1
        s = request.sampling
        try:
            sampler = Sampler(self.model, temperature=s.temperature, top_p=s.top_p, seed=s.seed, grammar=s.grammar)
        except Exception:
            with self._lock:
                self._queued -= 1
            raise
        stream = EventStream(asyncio.get_running_loop())
        job = _Job(request, sampler, stream.push)
        stream.on_close = lambda: self._cancel(job)
        self._inbox.put(job)
        return stream

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        if not self.config.embeddings:
            raise EngineError("this model is not configured for embeddings")
        for tokens in inputs:
            if len(tokens) > min(self.context_length, self.config.batch_tokens):
                raise ContextLengthExceeded(
                    f"an input has {len(tokens)} tokens; this embedding model takes at most "
                    f"{min(self.context_length, self.config.batch_tokens)}"
                )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[list[float]]] = loop.create_future()
        self._inbox.put(_EmbedJob(inputs, loop, future))  # type: ignore[arg-type]
        return await future

    def stats(self) -> EngineStats:
        return EngineStats(self.config.slots, len(self._active), max(0, self._queued))

    def close(self) -> None:
        self._closing = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("model thread did not stop in 30 s; leaving its memory to the OS")
            return
        self.ctx.close()
        self.model.close()

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True
        self._inbox.put(_WAKE)  # type: ignore[arg-type]

    # ---- the model thread -------------------------------------------------------------------

    def _run(self) -> None:
        # Signals go to the main thread only. A signal landing on this thread or on the OpenMP
        # workers it starts (they inherit this mask) stalls llama_decode for seconds.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        try:
            while True:
                idle = not self._active and not self._waiting
                if not self._drain_inbox(block=idle):
                    break
                self._reap_cancelled()
                self._admit()
                if self._active:
                    self._step()
        except Exception as exc:  # a crash here must not leave clients waiting forever
            log.exception("model thread crashed")
            self._fail_all(f"engine failure: {exc}")
        finally:
            self._closing = True
            self._fail_all("the model is shutting down")

    def _drain_inbox(self, *, block: bool) -> bool:
        """Moves submitted jobs to the waiting queue; False once asked to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, _EmbedJob):
                self._run_embeddings(item)
            elif isinstance(item, _Job):
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _reap_cancelled(self) -> None:
        if any(j.cancelled for j in self._waiting):
            for job in [j for j in self._waiting if j.cancelled]:
                self._waiting.remove(job)
                with self._lock:
                    self._queued -= 1
                self._finish(job, "cancelled")
        for job in [j for j in self._active.values() if j.cancelled]:
            self._release(job, "cancelled")

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.config.slots:
            job = self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            free = {s: self._slot_tokens[s] for s in range(self.config.slots) if s not in self._active}
            placement = place(free, job.request.prompt_tokens)
            job.slot = placement.slot
            job.admitted_seq = next(self._admissions)
            job.n_past = job.reused = placement.reuse
            self.ctx.trim_sequence(job.slot, placement.reuse)
            self._slot_tokens[job.slot] = ()  # being rewritten; known again at release
            self._active[job.slot] = job

    def _step(self) -> None:
        plan = plan_batch(tuple(j.view() for j in self._active.values()), self.config.batch_tokens)
        # Batch order by slot keeps each ubatch to consecutive sequences, which llama.cpp
        # needs to group sequences when each has its own KV stream.
        plan = tuple(sorted(plan, key=lambda item: item.slot))
        entries: list[tuple[int, int, int, bool]] = []
        logit_rows: list[tuple[BatchItem, int]] = []
        for item in plan:
            job = self._active[item.slot]
            if item.is_decode:
                assert job.pending_token is not None
                tokens: tuple[int, ...] = (job.pending_token,)
            else:
                tokens = job.request.prompt_tokens[item.start : item.start + item.count]
            for offset, token in enumerate(tokens):
                last = offset == len(tokens) - 1
                entries.append((token, item.start + offset, item.slot, last and item.wants_logits))
            if item.wants_logits:
                logit_rows.append((item, len(entries) - 1))
        try:
            self.ctx.decode(entries)
        except EngineError as exc:
            for item in plan:
                self._release(self._active[item.slot], "error", error=str(exc))
            return
        for item in plan:
            job = self._active[item.slot]
            job.n_past += item.count
            if item.is_decode:
                job.decoded.append(job.pending_token)  # type: ignore[arg-type]
        for item, row in logit_rows:
            job = self._active[item.slot]
            self._sample(job, row)

    def _sample(self, job: _Job, row: int) -> None:
        token = job.sampler.sample(self.ctx, row)
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        job.generated += 1
        if self.model.is_eog(token):
            job.pending_token = None
            self._release(job, "stop")
            return
        logprob = self._logprob(job, row, token) if job.request.sampling.logprobs else None
        text = job.stops.feed(job.utf8.feed(self.model.piece(token)))
        job.emit(TokenEvent(text, token, logprob))
        if job.stops.stopped:
            self._release(job, "stop")
        elif job.generated >= job.request.max_tokens:
            self._release(job, "length")
        else:
            job.pending_token = token

    def _logprob(self, job: _Job, row: int, token: int) -> TokenLogprob:
        logits = self.ctx.logits(row).astype(np.float64)
        top = logits.max()
        logsum = top + np.log(np.exp(logits - top).sum())
        k = job.request.sampling.top_logprobs
        tops: tuple[TopLogprob, ...] = ()
        if k > 0:
            best = np.argpartition(-logits, k)[:k]
            best = best[np.argsort(-logits[best], kind="stable")]
            tops = tuple(self._top(int(t), float(logits[t] - logsum)) for t in best)
        piece = self.model.piece(token)
        return TokenLogprob(piece.decode("utf-8", errors="replace"), piece, float(logits[token] - logsum), tops)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        piece = self.model.piece(token)
        return TopLogprob(piece.decode("utf-8", errors="replace"), piece, logprob)

    def _release(self, job: _Job, reason: FinishReason, error: str | None = None) -> None:
        self._active.pop(job.slot, None)
        if reason == "error":
            self.ctx.clear_sequence(job.slot)
            self._slot_tokens[job.slot] = ()
        else:
            self._slot_tokens[job.slot] = (job.request.prompt_tokens + tuple(job.decoded))[: job.n_past]
            self.ctx.trim_sequence(job.slot, job.n_past)
        self._finish(job, reason, error)

    def _finish(self, job: _Job, reason: FinishReason, error: str | None = None) -> None:
        tail = ""
        if reason in ("stop", "length"):
            tail = job.stops.feed(job.utf8.flush()) + job.stops.flush()
        job.sampler.close()
        end = time.perf_counter()
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted_at
        usage = Usage(len(job.request.prompt_tokens), job.generated, job.reused)
        job.emit(FinishEvent(reason, usage, tail, ttft, end - job.submitted_at, error))

    def _fail_all(self, message: str) -> None:
        for job in list(self._active.values()):
            self._release(job, "error", error=message)
        while self._waiting:
            self._finish(self._waiting.popleft(), "error", error=message)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Job):
                self._finish(item, "error", error=message)
            elif isinstance(item, _EmbedJob):
                item.fail(EngineClosed(message))

    # ---- embeddings -----------------------------------------------------------------------------

    def _run_embeddings(self, job: _EmbedJob) -> None:
        try:
            vectors = []
            for tokens in job.inputs:
                self.ctx.clear_sequence(0)
                self.ctx.decode([(t, i, 0, True) for i, t in enumerate(tokens)])
                vectors.append(self.ctx.sequence_embedding(0).tolist())
                self.ctx.clear_sequence(0)
            job.succeed(vectors)
        except Exception as exc:
            job.fail(exc)


class _EmbedJob:
    def __init__(self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop, future: asyncio.Future[list[list[float]]]) -> None:
        self.inputs, self.loop, self.future = inputs, loop, future

    def succeed(self, vectors: list[list[float]]) -> None:
        self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_result(vectors))

    def fail(self, exc: Exception) -> None:
        self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_exception(exc))


_WAKE = object()
