"""The model thread every local engine (llama.cpp, MLX) runs on: one copy of what they share.

One thread owns the model. Requests are checked and queued on the event loop; the thread loops:
take what arrived (requests, calls such as adapter loads and embeddings, aborts), end cancelled
requests, let the engine admit waiting ones, let the engine run one step. The core streams each
sampled token out (stop strings, UTF-8, logprobs), ends requests with their finish reason, usage
and timings, keeps the adapters and the order in which adapter sets take their turns, the host-RAM
prefix tier, and the counts a model's owner needs to load and unload it: `busy`, `idle_since`,
`drain`, `close`.

An engine subclasses `LocalEngine` and supplies only what its library does differently (the
hooks below "What an engine supplies"): admission into its batch and one step of it (llama.cpp
schedules slots itself, MLX hands a BatchGenerator its prompts), freeing a request's KV, token
bytes, adapters, embeddings, and the model's own loading and freeing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from engines.embedding import embed_in_passes
from engines.interface import (
    SHUTDOWN_RETRY_AFTER_S,
    SHUTTING_DOWN,
    AdapterInfo,
    AdapterInUse,
    EngineClosed,
    EngineError,
    EngineEvent,
    EngineStats,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefixStats,
    SpeculationStats,
    TokenEvent,
    UnknownAdapter,
    Usage,
    check_context,
    refuse_unsupported,
)
from engines.logprobs import token_logprob
from engines.occupancy import Occupancy
from engines.prefix import HostCache, PrefixIndex
from engines.sampling import LogitAdjuster
from engines.stream import EventStream, Outbox
from engines.text import StopMatcher, Utf8Stream

log = logging.getLogger("appliance.engines")

AdapterKey = tuple[tuple[str, float], ...]


class Job:
    """A generation request in flight. Mutated only by the model thread, except `cancelled`;
    an engine subclasses it for where the request sits in its batch."""

    def __init__(self, request: GenerationRequest, sampler: Any, emit: Callable[[EngineEvent], None]) -> None:
        self.request = request
        self.key: AdapterKey = request.adapter_key  # the adapter set its steps compute under
        # What its KV is listed under in the prefix index: the adapter set and the request's prefix
        # scope, so no holder (slot, copy, host RAM) ever serves one scope's prefix to another.
        self.prefix_key = request.prefix_key
        self.sampler = sampler  # the library's sampler chain, closed when the job ends; or None
        # logit_bias and penalties: the logits adjusted in a copy before the sampler draws
        self.adjuster = LogitAdjuster(request.sampling) if request.sampling.adjusts_logits else None
        self.emit = emit
        self.cancelled = False
        self.admitted = False
        self.generated = 0
        self.reused = 0  # prompt tokens served from KV computed earlier
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(request.stop)
        self.submitted_at = time.perf_counter()
        self.first_step_at: float | None = None  # set by the engine when a step first serves it
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.token_gaps: list[float] = []


@dataclass(frozen=True)
class LoadedAdapter:
    handle: Any  # the engine's: a llama.cpp adapter, MLX's LoRA weights
    path: Path
    scale: float  # a request naming the adapter without a scale gets this one


class _Call:
    """A function to run on the model thread between steps (only that thread touches the model),
    its result handed back to the event loop as a future's. `on_done` runs first, on the model
    thread, however the call ends: an embedding's last pass counts it out before its caller wakes."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any],
                 on_done: Callable[[], None] | None = None) -> None:
        self.fn, self.loop, self.future, self.on_done = fn, loop, future, on_done

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:
            self.fail(exc)
        else:
            self._resolve(lambda: self.future.done() or self.future.set_result(result))

    def fail(self, exc: Exception) -> None:
        self._resolve(lambda: self.future.done() or self.future.set_exception(exc))

    def _resolve(self, fn: Callable[[], Any]) -> None:
        if self.on_done is not None:
            self.on_done()
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is gone; nobody is waiting
            pass


@dataclass(frozen=True)
class _Abort:
    message: str


_WAKE = object()  # an inbox item that only wakes the thread (a cancellation)


class LocalEngine:
    """The Engine protocol's half that every local engine shares, around one model thread."""

    supports_grammar = True
    supports_logprobs = True
    supports_embeddings = False
    supports_adapters = True
    takes_messages = False

    def __init__(self, *, slots: int, max_queue: int, host_cache_bytes: int, thread_name: str) -> None:
        self._occupancy = Occupancy(slots, max_queue)
        self.prefix_stats = PrefixStats()
        self.speculation_stats = SpeculationStats()
        # Which slot or host-RAM copy holds which tokens, under which adapter set and prefix scope: a
        # prompt that shares a prefix with an earlier one of its scope (a system prompt) reuses its KV.
        self._index = PrefixIndex()
        self._host: HostCache[Any] = HostCache(self._index, host_cache_bytes, self.prefix_stats)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outbox = Outbox()  # the model thread's events, handed to the loop once a step
        self._waiting: deque[Job] = deque()
        self._running: dict[Job, None] = {}  # admitted into the engine's batch (the model thread's; ordered)
        self._adapters: dict[str, LoadedAdapter] = {}  # the model thread changes it, under _lock
        self._applied: AdapterKey = ()  # the adapter set the model applies now
        self._served: AdapterKey | None = None  # the set the last step served (turns)
        self._lock = threading.Lock()
        self._stopping = False  # the thread was asked to stop (read on the thread)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        # Samplers with a grammar are built here, off the loop: llama.cpp compiles the grammar then.
        self._grammars = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{thread_name}-grammar")

    def _start_thread(self) -> None:
        """Called by the engine once its model is loaded: from here on only the thread touches it."""
        self._thread.start()

    # ---- what an engine supplies ---------------------------------------------------------------
    # Called on the event loop:

    def _new_job(self, request: GenerationRequest, sampler: Any, emit: Callable[[EngineEvent], None]) -> Job:
        """The engine's job for a request; its sampler may be set later (see `_make_sampler`)."""
        raise NotImplementedError

    # Called on the event loop, or for a request with a grammar on a worker thread (compiling one
    # takes up to a tenth of a second within appliance/prompt/schema_bounds.py's limits):

    def _make_sampler(self, request: GenerationRequest) -> Any:
        """The library's sampler chain for a request, or None (a grammar that does not parse raises here)."""
        raise NotImplementedError

    # Called on the model thread:

    def _on_thread_start(self) -> None:
        """First thing on the model thread (measurements that must run there)."""

    def _admit(self, waiting: deque[Job]) -> None:
        """Takes jobs from the left of `waiting` into the batch, calling `_started` for each; every loop."""
        raise NotImplementedError

    def _step(self) -> None:
        """One step of the batch: computes, samples, calls `_deliver` per token and `_end` per finished job."""
        raise NotImplementedError

    def _release(self, job: Job, reason: FinishReason) -> None:
        """Frees what the batch holds for an admitted job that ends (its KV kept for reuse or not)."""
        raise NotImplementedError

    def _piece(self, token: int, special: bool) -> bytes:
        """The token's bytes; `special`: a control token's text rather than nothing."""
        raise NotImplementedError

    def _is_eog(self, token: int) -> bool:
        raise NotImplementedError

    def _attach_adapter(self, name: str, prepared: Any) -> Any:
        """Makes an adapter usable under `name` (replacing one of that name); returns its handle."""
        raise EngineError("this engine has no adapters")

    def _detach_adapter(self, name: str, handle: Any) -> None:
        """Frees an adapter no request uses any more (it is no longer applied)."""

    def _apply_adapters(self, key: AdapterKey) -> None:
        """Makes the following steps compute under this adapter set."""

    def _forget_holder(self, holder: Hashable) -> None:
        """Drops the KV a non-host prefix holder (a slot) keeps, computed under an adapter now gone."""

    def _embed_groups(self, inputs: list[list[int]]) -> list[list[int]]:
        """The inputs' indexes grouped into forward passes (engines/embedding.py `pack`); refuses an
        input the model cannot take whole. Called on the event loop, before anything runs."""
        raise EngineError("this model is not configured for embeddings")

    def _embed_pass(self, inputs: list[list[int]]) -> Any:
        """One forward pass: a pooled, unnormalised row per input."""
        raise EngineError("this model is not configured for embeddings")

    def _on_thread_end(self) -> None:
        """Last thing on the model thread, after every request has ended."""

    # Called off the model thread:

    def _read_adapter(self, path: Path) -> Any:
        """Reads an adapter's files (on a worker thread at runtime); what `_attach_adapter` takes."""
        return path

    def _free_model(self) -> None:
        """Frees the model once the thread has stopped."""

    def _slot_states(self) -> tuple[tuple[str, int], ...]:
        return ()

    def _kv_capacity_tokens(self) -> int:
        return 0

    @property
    def _speculating(self) -> bool:
        return False

    @property
    def context_length(self) -> int:
        raise NotImplementedError

    # ---- the Engine protocol, on the event loop ---------------------------------------------------

    def generate(self, request: GenerationRequest) -> EventStream:
        """Validates and queues the request; raises at once on a request that cannot run."""
        self._occupancy.refuse_if_closed()
        refuse_unsupported(self, request)  # by its flags, as a model loaded on demand refuses it unloaded
        check_context(request, self.context_length)
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty")
        with self._lock:
            missing = [name for name, _ in request.adapters if name not in self._adapters]
        if missing:
            raise UnknownAdapter(f"no adapter named {missing[0]!r} is loaded on this model")
        self._occupancy.take()
        try:
            stream = EventStream(asyncio.get_running_loop())
            grammar = request.sampling.grammar is not None
            job = self._new_job(request, None if grammar else self._make_sampler(request), self._outbox.emitter(stream))
            if grammar:
                self._grammars.submit(self._compile_then_queue, job)
        except BaseException:
            self._occupancy.settle(queued=True)
            raise
        stream.on_close = lambda: self._cancel(job)
        if not grammar:
            self._inbox.put(job)
        return stream

    def _compile_then_queue(self, job: Job) -> None:
        """On a grammar worker: the job's sampler, then the job to the model thread (which ends it
        there if it was cancelled meanwhile). A grammar llama.cpp refuses ends the request as a 400."""
        try:
            job.sampler = self._make_sampler(job.request)
        except Exception as exc:
            self._occupancy.settle(queued=True)
            job.emit(FinishEvent("error", Usage(0, 0, 0), error=str(exc),  # nothing computed, nothing charged
                                 error_status=400 if isinstance(exc, EngineError) else None))
            return
        self._inbox.put(job)

    async def embed(self, inputs: list[list[int]]) -> Any:
        """An embedding request counts as a request (queued, then running; the queue bounds them)
        and runs on the model thread one pass per call, so requests take turns pass by pass and a
        cancelled one (its client gone) stops at its next pass."""
        if not self.supports_embeddings:
            raise EngineError("this model is not configured for embeddings")
        self._occupancy.refuse_if_closed()
        groups = self._embed_groups(inputs)
        self._occupancy.take()
        started = settled = False  # the model thread's to change
        left = len(groups)

        def settle() -> None:
            nonlocal settled
            if not settled:
                settled = True
                self._occupancy.settle(queued=not started, running=started)

        def one(batch: list[list[int]]) -> Any:
            nonlocal started
            if not started:
                started = True
                self._occupancy.admit()
            return self._embed_pass(batch)

        def run(batch: list[list[int]]) -> Any:
            nonlocal left
            left -= 1
            return self._on_model_thread(lambda: one(batch), on_done=settle if left == 0 else None)

        try:
            return await embed_in_passes(inputs, groups, run)
        except BaseException:
            # Counted out on the model thread once its pass in flight, if any, is done (FIFO inbox).
            loop = asyncio.get_running_loop()
            self._inbox.put(_Call(lambda: None, loop, loop.create_future(), settle))
            raise

    def adapters(self) -> list[AdapterInfo]:
        with self._lock:
            loaded = {name: (str(a.path), a.scale) for name, a in self._adapters.items()}
        using = Counter(name for job in self._in_flight() for name, _ in job.request.adapters)
        return [AdapterInfo(name, path, scale, using[name]) for name, (path, scale) in sorted(loaded.items())]

    async def load_adapter(self, name: str, path: Path, scale: float = 1.0) -> AdapterInfo:
        """Loads (or replaces, when idle) a LoRA adapter without touching the base model."""
        prepared = await asyncio.to_thread(self._read_adapter, path)

        def load() -> AdapterInfo:
            if name in self._adapters and self._in_use(name):
                raise AdapterInUse(f"adapter {name!r} is serving requests; unload it when they finish")
            handle = self._attach_adapter(name, prepared)
            with self._lock:
                old = self._adapters.get(name)
                self._adapters[name] = LoadedAdapter(handle, path, scale)
            self._forget_adapter(name, old.handle if old is not None else None)
            return AdapterInfo(name, str(path), scale)

        return await self._on_model_thread(load)

    async def unload_adapter(self, name: str) -> None:
        def unload() -> None:
            if name not in self._adapters:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded on this model")
            if self._in_use(name):
                raise AdapterInUse(f"adapter {name!r} is serving requests; unload it when they finish")
            with self._lock:
                old = self._adapters.pop(name)
            self._forget_adapter(name, old.handle)

        await self._on_model_thread(unload)

    def stats(self) -> EngineStats:
        o = self._occupancy
        return EngineStats(o.slots, o.running, max(0, o.queued), replace(self.prefix_stats),
                           replace(self.speculation_stats) if self._speculating else None,
                           self._slot_states(), self._kv_capacity_tokens())

    def abort_all(self, message: str) -> None:
        """Ends every running and waiting request at the next step with a 503 (the server is
        stopping and its grace period is running out); later requests are still taken."""
        self._inbox.put(_Abort(message))

    async def start(self) -> None:
        pass  # the model thread started with the engine

    def close(self) -> None:
        """Stops the model thread (whatever is left ends with a 503) and frees the model."""
        if self._closed:
            return
        self._occupancy.closing = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("model thread %s did not stop in 30 s; leaving its memory to the OS", self._thread.name)
            return
        self._grammars.shutdown(wait=True)  # grammars still compiling queue their jobs: failed just below
        self._closed = True
        self._fail_all("the model is shutting down", status=503)  # what raced in after the thread's last look
        self._free_model()

    # ---- for a model's owner (loading on demand, unloading when idle) ---------------------------------

    @property
    def busy(self) -> int:
        """Requests (embeddings included) running or queued."""
        return self._occupancy.unfinished

    @property
    def idle_since(self) -> float | None:
        """When the last request finished (or the model started), `time.monotonic()`; None while busy."""
        return self._occupancy.idle_since

    @property
    def accepting(self) -> bool:
        return self._occupancy.accepting and not self._occupancy.closing

    async def drain(self, timeout: float | None = None) -> bool:
        """Stops taking new requests (they get EngineClosed) and waits for those already taken, queued
        ones included, to finish: True once none is left, False at `timeout`. `resume` takes requests again."""
        return await self._occupancy.drain(timeout)

    def resume(self) -> None:
        self._occupancy.accepting = True

    # ---- bookkeeping shared by both threads -----------------------------------------------------

    def _cancel(self, job: Job) -> None:
        job.cancelled = True
        self._inbox.put(_WAKE)

    def _in_flight(self) -> list[Job]:
        """Read from other threads too: a snapshot that may be a step old."""
        return list(self._running) + list(self._waiting)

    def _in_use(self, name: str) -> bool:
        return any(name == n for job in self._in_flight() for n, _ in job.request.adapters)

    async def _on_model_thread(self, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> Any:
        if self._occupancy.closing:
            raise EngineClosed("the model is shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Call(fn, loop, future, on_done))
        return await future

    # ---- the model thread -------------------------------------------------------------------------

    def _run(self) -> None:
        self._outbox.bind()
        try:
            self._on_thread_start()
            while self._take_inbox(block=not self._running and not self._waiting):
                self._reap_cancelled()
                self._admit(self._waiting)
                if self._running:
                    self._step()
                self._outbox.flush()
        except Exception as exc:  # a crash here must not leave clients waiting forever
            log.exception("model thread %s crashed", self._thread.name)
            self._fail_all(f"engine failure: {exc}")
        finally:
            self._occupancy.closing = True
            self._fail_all("the model is shutting down", status=503)
            self._outbox.flush()
            self._on_thread_end()

    def _take_inbox(self, *, block: bool) -> bool:
        """Moves submitted jobs to the waiting queue and runs calls; False once asked to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stopping
        while True:
            if item is None:
                self._stopping = True
            elif isinstance(item, Job):
                self._waiting.append(item)
            elif isinstance(item, _Call):
                item.run()
            elif isinstance(item, _Abort):
                self._fail_all(item.message, status=503)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return not self._stopping

    def _reap_cancelled(self) -> None:
        if any(j.cancelled for j in self._waiting):
            for job in [j for j in self._waiting if j.cancelled]:
                self._waiting.remove(job)
                self._finish(job, "cancelled")
        for job in [j for j in self._running if j.cancelled]:
            self._end(job, "cancelled")

    def _started(self, job: Job) -> None:
        """The engine took the job into its batch."""
        self._occupancy.admit()
        self._running[job] = None
        job.admitted = True

    def _take_turn(self, jobs: list[Job]) -> list[Job]:
        """The jobs of the adapter set whose turn it is, with its adapters applied. A step computes
        under one set (adapters apply to the whole model); the sets with work take turns, one step
        each, so none starves. [] when the set could not be applied: its jobs end with the error."""
        if not jobs:
            return []
        keys = sorted({j.key for j in jobs})
        key = keys[0] if self._served is None else next((k for k in keys if k > self._served), keys[0])
        self._served = key
        turn = [j for j in jobs if j.key == key]
        try:
            self._use_adapters(key)
        except (EngineError, KeyError) as exc:
            for job in turn:
                self._end(job, "error", error=f"adapters {key}: {exc}")
            return []
        return turn

    def _use_adapters(self, key: AdapterKey) -> None:
        if key != self._applied:
            self._apply_adapters(key)
            self._applied = key

    def _forget_adapter(self, name: str, handle: Any) -> None:
        """After an adapter was loaded, replaced or unloaded: nothing stays applied, every prefix
        computed with it goes (a reload may change its weights), and the old handle is freed."""
        if self._applied:
            self._apply_adapters(())
            self._applied = ()
        for holder in self._index.holders():
            if any(n == name for n, _ in self._index.key(holder).adapters):  # type: ignore[attr-defined]
                kind, ident = holder  # type: ignore[misc]
                if kind == "host":
                    self._host.drop(ident)
                else:
                    self._index.remove(holder)
                    self._forget_holder(holder)
        if handle is not None:
            self._detach_adapter(name, handle)

    def _install_adapters(self, adapters: tuple[tuple[str, Path, float], ...]) -> None:
        """The adapters a model starts with, before its thread does: (name, path, default scale)."""
        for name, path, scale in adapters:
            self._adapters[name] = LoadedAdapter(self._attach_adapter(name, self._read_adapter(path)), path, scale)

    def _drop_adapters(self) -> None:
        for name, adapter in list(self._adapters.items()):
            self._detach_adapter(name, adapter.handle)
        self._adapters.clear()

    def _deliver(self, job: Job, token: int, logprobs: Callable[[], np.ndarray]) -> FinishReason | None:
        """Counts a sampled token and streams its text; the reason the job ends with it, or None
        while it goes on. `logprobs`: the row's log-probabilities, asked for only when wanted."""
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        else:
            job.token_gaps.append(now - job.last_token_at)
        job.last_token_at = now
        job.generated += 1
        if self._is_eog(token):
            return "stop"
        sampling = job.request.sampling
        logprob = token_logprob(logprobs(), token, sampling.top_logprobs, lambda t: self._piece(t, False)) if sampling.logprobs else None
        text = job.stops.feed(job.utf8.feed(self._piece(token, token in job.request.preserved_tokens)))
        job.emit(TokenEvent(text, token, logprob))
        if job.stops.stopped:
            return "stop"
        if job.generated >= job.request.max_tokens:
            return "length"
        return None

    def _end(self, job: Job, reason: FinishReason, error: str | None = None, status: int | None = None) -> None:
        """Ends a job: the engine frees what its batch holds for it, then the finish event goes out."""
        if job in self._running:
            self._release(job, reason)
        self._finish(job, reason, error, status)

    def _finish(self, job: Job, reason: FinishReason, error: str | None = None, status: int | None = None) -> None:
        tail = job.stops.feed(job.utf8.flush()) + job.stops.flush() if reason in ("stop", "length") else ""
        if job.sampler is not None:
            job.sampler.close()
        self._running.pop(job, None)
        self._occupancy.settle(queued=not job.admitted, running=job.admitted)
        end = time.perf_counter()
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted_at
        queued = None if job.first_step_at is None else job.first_step_at - job.submitted_at
        usage = Usage(len(job.request.prompt_tokens), job.generated, job.reused)
        job.emit(FinishEvent(reason, usage, tail, ttft, end - job.submitted_at, error, error_status=status,
                             error_code=SHUTTING_DOWN if status else None, retry_after_s=SHUTDOWN_RETRY_AFTER_S if status else None,
                             queue_time_s=queued, inter_token_s=tuple(job.token_gaps),
                             stop_sequence=job.stops.matched if reason == "stop" else None))

    def _fail_all(self, message: str, status: int | None = None) -> None:
        """Ends every request with an error: the engine's own failure (500), or with `status` the
        server stopping (503 and Retry-After, the stream ended as a client can parse)."""
        for job in list(self._running):
            try:
                self._release(job, "error")
            except Exception:  # after a crash the batch may be broken: the finish event still goes out
                log.exception("could not free a request's state")
            self._finish(job, "error", error=message, status=status)
        while self._waiting:
            self._finish(self._waiting.popleft(), "error", error=message, status=status)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._stopping = True
            elif isinstance(item, Job):
                self._finish(item, "error", error=message, status=status)
            elif isinstance(item, _Call):
                item.fail(EngineClosed(message))
