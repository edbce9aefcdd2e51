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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import (
    AdapterInfo,
    SHUTDOWN_RETRY_AFTER_S,
    SHUTTING_DOWN,
    EngineClosed,
    EngineError,
    EngineEvent,
    EngineOverloaded,
    EngineStats,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PrefixStats,
    SpeculationStats,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    UnknownAdapter,
    Usage,
    check_context,
)
from engines.calls import ModelThreadCall
from engines.embedding import check_lengths, pack, resolve_pooling
from engines.llamacpp.drafting import Drafter, DraftModelDrafter, DraftState, PromptLookupDrafter, measure_step_cost
from engines.llamacpp.runtime import Adapter, Context, ContextShape, Model, Sampler
from engines.prefix import PrefixIndex
from engines.sampling import LogitAdjuster
from engines.scheduler import Admission, BatchItem, SlotView, Source, plan_admission, plan_batch
from engines.speculation import Acceptance, StepCost, draft_length
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
    prefills_per_step: int = 1  # prompts one step advances (0: as many as the token budget holds)
    batch_invariant: bool = True
    kv_type: str = "q8_0"  # K; V too unless kv_type_v says otherwise
    embeddings: bool = False
    pooling: str = "auto"  # with embeddings: mean, cls, last, or auto (what the file declares)
    kv_type_v: str | None = None
    prefix_cache: bool = True
    # Host-RAM tier for prefixes evicted from the KV cache; 0 turns it off.
    prefix_host_bytes: int = 256 << 20
    # Save an evicted sequence only if it holds this many tokens no other holder has.
    prefix_host_min_tokens: int = 256
    # Copying KV between sequences must save at least this many tokens of prefill.
    prefix_copy_min_tokens: int = 64
    # "off", "prompt_lookup" or "draft" (with draft_path): see engines/speculation.py.
    speculation: str = "off"
    draft_path: Path | None = None
    speculation_max_tokens: int = 8
    # Draft exactly this many tokens whenever a draft exists; 0 sizes drafts by what pays.
    speculation_fixed_tokens: int = 0
    # LoRA adapters loaded at start: (name, GGUF path, default scale)
    adapters: tuple[tuple[str, Path, float], ...] = ()



def context_layout(batch_invariant: bool, kv_type: str) -> tuple[bool, bool]:
    """(kv_unified, flash_attn) for a model. Invariance needs one KV stream per sequence, and flash
    attention only where ggml's CPU kernel cannot switch paths by batch shape: its split-KV and tiled
    paths take f16/f32 KV only, so a q8_0 cache always runs the sequential one (docs/architecture.md)."""
    if not batch_invariant:
        return True, True
    return False, kv_type not in ("f16", "bf16")


class _Job:
    """A request in flight. Mutated only by the model thread, except `cancelled`."""

    def __init__(self, request: GenerationRequest, sampler: Sampler, emit: Callable[[EngineEvent], None]) -> None:
        self.request = request
        self.key = request.adapter_key  # the KV it computes is valid for this adapter set only
        self.sampler = sampler
        # logit_bias and penalties: the slot's logits adjusted in a copy, then drawn by the same chain
        self.adjuster = LogitAdjuster(request.sampling) if request.sampling.adjusts_logits else None
        self.emit = emit
        self.cancelled = False
        self.slot = -1
        self.admitted_seq = 0
        self.n_past = 0
        self.pending_token: int | None = None
        self.generated = 0
        self.decoded: list[int] = []  # generated tokens whose KV is in the slot
        self.reused = 0  # prompt tokens served from KV computed earlier
        self.parked: tuple[Source, _Job] | None = None  # waiting for another slot's prefill
        self.draft_state: DraftState | None = None
        self.acceptance = Acceptance()
        # Prompt lookup's draft for a step that did not speculate, scored against what the slot
        # then samples, so the acceptance estimate stays current at no cost: (draft, matched).
        self.shadow: tuple[tuple[int, ...], int] | None = None
        self.steps_without_drafts = 0
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(request.stop)
        self.submitted_at = time.perf_counter()
        self.first_step_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.token_gaps: list[float] = []

    def view(self, drafted: int = 0) -> SlotView:
        return SlotView(self.slot, self.admitted_seq, len(self.request.prompt_tokens), self.n_past, self.pending_token is not None, drafted)


class LlamaCppEngine:
    name = "llamacpp"
    supports_grammar = True
    supports_logprobs = True
    supports_adapters = True
    takes_messages = False

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        self.supports_embeddings = config.embeddings
        self.model = Model(config.path, use_extra_buffers=not config.batch_invariant)
        try:
            # Embeddings: `slots` sequences share a forward pass, which holds every token of each.
            self.pooling = resolve_pooling(config.pooling, self.model.pooling()) if config.embeddings else None
            kv_unified, flash_attn = context_layout(config.batch_invariant, config.kv_type)
            # With a KV stream per sequence llama.cpp splits a pass into equal shares of each
            # sequence, and pools a sequence over its last share only: one stream keeps a pass whole.
            kv_unified = kv_unified or config.embeddings
            shape = ContextShape(
                n_seq=config.slots,
                n_ctx_per_seq=config.context_length,
                n_batch=config.batch_tokens,
                threads=config.threads,
                kv_unified=kv_unified,
                flash_attn=flash_attn,
                kv_type=config.kv_type,
                kv_type_v=config.kv_type_v,
                embeddings=config.embeddings,
                pooling=self.pooling or "mean",
            )
            self.ctx = Context(self.model, shape)
        except Exception:
            self.model.close()
            raise
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}
        # Which slot (or host-RAM copy) holds which tokens, kept after a request ends so the next
        # prompt that shares a prefix (a system prompt, a chat template's preamble) skips
        # recomputing it. An active slot is listed with its whole prompt from admission on.
        self._index = PrefixIndex()
        # Saved sequences' state by id, LRU first; their tokens and model key are in the index.
        self._host: OrderedDict[int, bytes] = OrderedDict()
        self._host_ids = itertools.count()
        self.prefix_stats = PrefixStats()
        self.speculation_stats = SpeculationStats()
        self._acceptance = Acceptance()  # across requests: a new request's starting estimate
        self._drafter: Drafter | None = None
        self._step_cost = StepCost(())
        self._adapters: dict[str, tuple[Adapter, float]] = {}  # the model thread changes it, under _lock
        self._applied: tuple = ()  # the adapter set the context applies now
        self._served: tuple | None = None  # the adapter set the last step served (round robin)
        try:
            for name, path, scale in config.adapters:
                self._adapters[name] = (Adapter(self.model, path), scale)
            self._start_speculation()
        except Exception:
            for adapter, _ in self._adapters.values():
                adapter.close()
            self.ctx.close()
            self.model.close()
            raise
        self._admissions = itertools.count()
        self._closing = False
        self._queued = 0  # submitted but not yet admitted; read by other threads for stats
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"llamacpp:{config.path.name}", daemon=True)
        self._thread.start()

    def _start_speculation(self) -> None:
        c = self.config
        if c.speculation == "off" or c.embeddings:
            return
        if c.speculation == "draft":
            if c.draft_path is None:
                raise EngineError("speculation = \"draft\" needs a draft model")
            self._drafter = DraftModelDrafter(
                c.draft_path, self.model, slots=c.slots, context_length=c.context_length, batch_tokens=c.batch_tokens, threads=c.threads,
            )
        elif c.speculation == "prompt_lookup":
            self._drafter = PromptLookupDrafter()
        else:
            raise EngineError(f"unknown speculation {c.speculation!r}")

    def _measure_speculation(self) -> None:
        """Times verify steps (and the draft model's decode) on the model thread itself: OpenMP
        keeps a team of worker threads per calling thread, and a second team, started by a decode
        on another thread, slowed every later decode by a quarter here."""
        c = self.config
        if self._drafter is None or c.speculation_fixed_tokens:
            return
        self._drafter.calibrate()
        self._step_cost = measure_step_cost(self.ctx, c.speculation_max_tokens)
        log.info("speculation: %s; a verify step of 1..%d tokens takes %s ms", c.speculation, len(self._step_cost.seconds),
                 " ".join(f"{t * 1e3:.0f}" for t in self._step_cost.seconds))

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

    def control_tokens(self) -> dict[str, int]:
        return self.model.control_tokens()

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
        check_context(request, self.context_length)
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty")
        with self._lock:
            missing = [name for name, _ in request.adapters if name not in self._adapters]
        if missing:
            raise UnknownAdapter(f"no adapter named {missing[0]!r} is loaded on this model")
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

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled, unnormalised vectors, one row per input."""
        if not self.config.embeddings:
            raise EngineError("this model is not configured for embeddings")
        if not inputs:
            raise EngineError("no inputs to embed")
        # A pass holds an input whole; absolute positions (BERT) end at the trained length.
        check_lengths(inputs, min(self.context_length, self.config.batch_tokens, self.model.n_ctx_train))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._inbox.put(_EmbedJob(inputs, loop, future))  # type: ignore[arg-type]
        return await future

    def adapters(self) -> list[AdapterInfo]:
        with self._lock:
            loaded = {name: (str(a.path), scale) for name, (a, scale) in self._adapters.items()}
        using: dict[str, int] = {}
        for job in list(self._active.values()) + list(self._waiting):
            for name, _ in job.request.adapters:
                using[name] = using.get(name, 0) + 1
        return [AdapterInfo(name, path, scale, using.get(name, 0)) for name, (path, scale) in sorted(loaded.items())]

    async def load_adapter(self, name: str, path: Path, scale: float = 1.0) -> AdapterInfo:
        """Loads (or replaces, when idle) a LoRA adapter without touching the base model."""

        def load() -> AdapterInfo:
            if name in self._adapters and self._in_use(name):
                raise EngineError(f"adapter {name!r} is serving requests; unload it when they finish")
            adapter = Adapter(self.model, path)
            with self._lock:
                old = self._adapters.get(name)
                self._adapters[name] = (adapter, scale)
            if old is not None:
                self._forget_adapter(name, old[0])
            return AdapterInfo(name, str(path), scale)

        return await self._on_model_thread(load)

    async def unload_adapter(self, name: str) -> None:
        def unload() -> None:
            if name not in self._adapters:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded on this model")
            if self._in_use(name):
                raise EngineError(f"adapter {name!r} is serving requests; unload it when they finish")
            with self._lock:
                adapter, _ = self._adapters.pop(name)
            self._forget_adapter(name, adapter)

        await self._on_model_thread(unload)

    def _in_use(self, name: str) -> bool:
        jobs = list(self._active.values()) + list(self._waiting)
        return any(name == n for job in jobs for n, _ in job.request.adapters)

    def _forget_adapter(self, name: str, adapter: Adapter) -> None:
        """Drops the adapter and every KV prefix computed with it (a reload may change weights)."""
        if any(n == name for n, _ in self._applied):
            self.ctx.set_adapters([])
            self._applied = ()
        for holder in self._index.holders():
            if any(n == name for n, _ in self._index.key(holder)):  # type: ignore[attr-defined]
                kind, ident = holder
                if kind == "host":
                    self._drop_host(ident)
                else:
                    self._index.remove(holder)
                    self.ctx.clear_sequence(ident)
        adapter.close()

    async def _on_model_thread(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(ModelThreadCall(fn, loop, future))  # type: ignore[arg-type]
        return await future

    def stats(self) -> EngineStats:
        speculation = replace(self.speculation_stats) if self._drafter else None
        return EngineStats(self.config.slots, len(self._active), max(0, self._queued), replace(self.prefix_stats), speculation,
                           self._slot_states(), self.config.slots * self.context_length)

    def _slot_states(self) -> tuple[tuple[str, int], ...]:
        """Read from other threads: a snapshot that may be a step old, never torn."""
        active = dict(self._active)
        out = []
        for slot in range(self.config.slots):
            job = active.get(slot)
            if job is None:
                holder = ("slot", slot)
                out.append(("idle", len(self._index.tokens(holder)) if holder in self._index else 0))
            elif job.parked is not None:
                out.append(("waiting", job.n_past))
            else:
                out.append(("decode" if job.pending_token is not None else "prefill", job.n_past))
        return tuple(out)

    async def start(self) -> None:
        pass  # the model thread started with the engine

    def close(self) -> None:
        self._closing = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.error("model thread did not stop in 30 s; leaving its memory to the OS")
            return
        if self._drafter is not None:
            if self._step_cost.samples:
                log.info("speculation: verify steps of 1..%d tokens took %s ms while serving", len(self._step_cost.seconds),
                         " ".join(f"{t * 1e3:.0f}" for t in self._step_cost.seconds))
            self._drafter.close()
        self.ctx.close()
        for adapter, _ in self._adapters.values():
            adapter.close()
        self.model.close()

    def abort_all(self, message: str) -> None:
        """Ends every running and waiting request at the next step with a 503 (the server is
        stopping and its grace period is running out); later requests are still taken."""
        self._inbox.put(_Abort(message))  # type: ignore[arg-type]

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True
        self._inbox.put(_WAKE)  # type: ignore[arg-type]

    # ---- the model thread -------------------------------------------------------------------

    def _run(self) -> None:
        # Signals go to the main thread only. A signal landing on this thread or on the OpenMP
        # workers it starts (they inherit this mask) stalls llama_decode for seconds.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        try:
            self._measure_speculation()
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
            self._fail_all("the model is shutting down", status=503)

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
            elif isinstance(item, ModelThreadCall):
                item.run()
            elif isinstance(item, _Abort):
                self._fail_all(item.message, status=503)
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

    # ---- admission and the prefix cache ----------------------------------------------------------

    def _admit(self) -> None:
        # Slots whose stream another slot copies at the next decode: nothing may overwrite them
        # before then (llama.cpp copies whole streams when the step begins).
        copying_from: set[int] = set()
        self._unpark(copying_from)
        while self._waiting and len(self._active) < self.config.slots:
            job = self._waiting[0]
            admission = self._plan(job)
            if admission.slot in copying_from:
                break  # admit it next step, once the copy has happened
            self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            job.slot = admission.slot
            job.admitted_seq = next(self._admissions)
            restoring = admission.source.holder[1] if admission.source and admission.source.holder[0] == "host" else None
            self._evict(admission.slot, admission.reuse, restoring)
            job.n_past = job.reused = admission.reuse
            self.prefix_stats.prompt_tokens += len(job.request.prompt_tokens)
            self.prefix_stats.reused_in_slot += admission.reuse
            if self.config.prefix_cache:
                self._index.insert(job.key, ("slot", job.slot), job.request.prompt_tokens)
            if self._drafter is not None:
                job.draft_state = self._drafter.start(job.slot, job.request.prompt_tokens)
                job.acceptance = self._acceptance.prior()  # what this model's drafts scored lately, lightly held
            self._active[job.slot] = job
            if admission.source is not None:
                self._follow(job, admission, copying_from)

    def _plan(self, job: _Job) -> Admission:
        free = [s for s in range(self.config.slots) if s not in self._active]
        if not self.config.prefix_cache:
            return Admission(min(free), 0)
        shared = self._index.match(job.key, job.request.prompt_tokens)
        return self._plan_reuse(job, shared, {s: shared.get(("slot", s), 0) for s in free})

    def _plan_reuse(self, job: _Job, shared: dict, candidates: dict[int, int]) -> Admission:
        """Where `job` goes among `candidates` (slot: tokens it already holds) and which other
        holder of its prefix, if any, it copies from; a candidate slot is never its own source."""
        sources = [src for src in self._sources(shared) if src.holder[0] != "slot" or src.holder[1] not in candidates]
        return plan_admission(candidates, sources, len(job.request.prompt_tokens), copy_min=self.config.prefix_copy_min_tokens)

    def _sources(self, shared: dict) -> list[Source]:
        """Every holder of a shared prefix, slots first (a copy between slots beats a restore)."""
        out = []
        for holder, length in sorted(shared.items(), key=lambda kv: kv[0][0] != "slot"):
            if length == 0:
                continue
            kind, ident = holder
            if kind == "slot":
                other = self._active.get(ident)
                out.append(Source(holder, length, length if other is None else other.n_past))
            else:
                out.append(Source(holder, length, length))
        return out

    def _follow(self, job: _Job, admission: Admission, copying_from: set[int]) -> None:
        """Copies the planned prefix into the job's slot now, or parks the job until it exists."""
        assert admission.source is not None
        kind, ident = admission.source.holder
        if admission.wait:
            job.parked = (admission.source, self._active[ident])
            return
        job.parked = None
        length = admission.source.length
        try:
            if kind == "slot":
                self.ctx.copy_prefix(ident, job.slot, length)
                copying_from.add(ident)
                self.prefix_stats.reused_by_copy += length
            else:
                self._host.move_to_end(ident)
                self.ctx.restore_sequence(job.slot, self._host[ident])
                self.ctx.trim_sequence(job.slot, length)
                self.prefix_stats.reused_from_host += length
        except EngineError as exc:
            log.warning("could not reuse a cached prefix (%s); computing it", exc)
            if kind == "host":
                self._drop_host(ident)
            self.ctx.clear_sequence(job.slot)
            self.prefix_stats.reused_in_slot -= job.reused
            job.n_past = job.reused = 0
            return
        self.prefix_stats.reused_in_slot -= job.reused  # the copy replaced what the slot held
        job.n_past = job.reused = length

    def _unpark(self, copying_from: set[int]) -> None:
        """A parked job takes its prefix once the slot it waits on has computed it; if that slot
        finished or failed first, it plans again from what exists now."""
        for job in [j for j in self._active.values() if j.parked is not None]:
            if job.slot in copying_from:
                continue  # another slot copies this one's stream at the next decode
            source, source_job = job.parked  # type: ignore[misc]
            if self._active.get(source.holder[1]) is source_job:
                if source_job.n_past >= source.length:
                    self._follow(job, Admission(job.slot, job.n_past, Source(source.holder, source.length, source.length)), copying_from)
                continue
            shared = self._index.match(job.key, job.request.prompt_tokens)
            admission = self._plan_reuse(job, shared, {job.slot: job.n_past})
            if admission.source is not None:
                self._follow(job, admission, copying_from)
            else:
                job.parked = None

    def _evict(self, slot: int, keep: int, restoring: int | None = None) -> None:
        """Trims a free slot to the prefix its next request reuses, first saving what would be
        lost to host RAM when no one else holds it and it is long enough to be worth keeping.
        `restoring`: the host entry the slot's next request restores, which room must not be made by dropping."""
        holder = ("slot", slot)
        if holder in self._index:
            tokens, key = self._index.tokens(holder), self._index.key(holder)
            if self.config.prefix_host_bytes > 0 and len(tokens) - keep >= self.config.prefix_host_min_tokens:
                others = self._index.match(key, tokens)
                others.pop(holder, None)
                if len(tokens) - max(others.values(), default=0) >= self.config.prefix_host_min_tokens:
                    self._save_host(slot, key, tokens, restoring)
            self._index.remove(holder)
        self.ctx.trim_sequence(slot, keep)

    def _save_host(self, slot: int, key: Any, tokens: tuple[int, ...], protect: int | None = None) -> None:
        try:
            data = self.ctx.save_sequence(slot)
        except EngineError as exc:
            log.warning("could not save a prefix to host RAM: %s", exc)
            return
        if len(data) > self.config.prefix_host_bytes:
            return
        ident = next(self._host_ids)
        self._host[ident] = data
        self._index.insert(key, ("host", ident), tokens)
        stats = self.prefix_stats
        stats.host_saves += 1
        stats.host_bytes += len(data)
        while stats.host_bytes > self.config.prefix_host_bytes:
            # least recently used first (the new entry is last), but never the one about to be restored
            victim = next((i for i in self._host if i != protect), None)
            if victim is None:
                break
            self._drop_host(victim)
            stats.host_evictions += 1
        stats.host_entries = len(self._host)

    def _drop_host(self, ident: int) -> None:
        data = self._host.pop(ident, None)
        if data is not None:
            self._index.remove(("host", ident))
            self.prefix_stats.host_bytes -= len(data)
            self.prefix_stats.host_entries = len(self._host)

    def _step(self) -> None:
        runnable = [j for j in self._active.values() if j.parked is None]
        if not runnable:
            return
        # llama.cpp applies adapters to a whole context, so a step serves one adapter set; the
        # sets with work take turns, one step each, so none starves.
        keys = sorted({j.key for j in runnable})
        key = keys[0] if self._served is None else next((k for k in keys if k > self._served), keys[0])
        runnable = [j for j in runnable if j.key == key]
        self._served = key
        if key != self._applied:
            try:
                self.ctx.set_adapters([(self._adapters[name][0], scale) for name, scale in key])
            except (EngineError, KeyError) as exc:
                for job in runnable:
                    self._release(job, "error", error=f"adapters {key}: {exc}")
                return
            self._applied = key
        drafts = self._drafts([j for j in runnable if j.pending_token is not None])
        plan = plan_batch(tuple(j.view(len(drafts.get(j.slot, ()))) for j in runnable), self.config.batch_tokens,
                          self.config.prefills_per_step)
        if not plan:
            return
        # Batch order by slot keeps each ubatch to consecutive sequences, which llama.cpp
        # needs to group sequences when each has its own KV stream.
        plan = tuple(sorted(plan, key=lambda item: item.slot))
        entries: list[tuple[int, int, int, bool]] = []
        logit_rows: list[tuple[BatchItem, int]] = []  # the item's first row with logits
        for item in plan:
            job = self._active[item.slot]
            if item.is_decode:
                assert job.pending_token is not None
                tokens: tuple[int, ...] = (job.pending_token, *drafts.get(item.slot, ()))
            else:
                tokens = job.request.prompt_tokens[item.start : item.start + item.count]
            first = len(entries)
            for offset, token in enumerate(tokens):
                last = offset == len(tokens) - 1
                entries.append((token, item.start + offset, item.slot, item.is_decode or (last and item.wants_logits)))
            if item.wants_logits:
                logit_rows.append((item, first if item.is_decode else len(entries) - 1))
        started = time.perf_counter()
        try:
            self.ctx.decode(entries)
        except EngineError as exc:
            for item in plan:
                self._release(self._active[item.slot], "error", error=str(exc))
            return
        if self._drafter is not None and all(item.is_decode for item in plan):
            # every row has logits, as in the table: keep the verify costs true to this machine now
            self._step_cost = self._step_cost.observe(len(entries), time.perf_counter() - started)
        for item in plan:
            job = self._active[item.slot]
            if job.first_step_at is None:
                job.first_step_at = started
            if item.is_decode:
                job.n_past += 1
                job.decoded.append(job.pending_token)  # type: ignore[arg-type]
            else:
                job.n_past += item.count
        for item, row in logit_rows:
            job = self._active[item.slot]
            if item.drafted:
                self._verify(job, row, drafts[item.slot])
            else:
                self._sample(job, row)

    # ---- speculative decoding -----------------------------------------------------------------

    def _drafts(self, generating: list[_Job]) -> dict[int, tuple[int, ...]]:
        """Drafts for the slots where speculating pays (or all, with a fixed draft length)."""
        if self._drafter is None or not generating:
            return {}
        c = self.config
        room = c.batch_tokens - len(generating)
        wants = []
        for job in generating:
            if c.speculation_fixed_tokens:
                k = c.speculation_fixed_tokens
            else:
                k = self._draft_length(job, job.acceptance.cautious, len(generating))
                if k == 0 and self._drafter.kind == "draft" and job.steps_without_drafts >= 16 and self._draft_length(job, 0.95, len(generating)) > 0:
                    k = 1  # probe now and then, so the acceptance estimate can recover, where drafting could pay
            # never past max_tokens, the slot's context, or the step's budget
            k = min(k, job.request.max_tokens - job.generated - 1, c.context_length - job.n_past - 1, room)
            if k <= 0:
                job.steps_without_drafts += 1
                if self._drafter.kind == "prompt_lookup" and job.shadow is None and job.draft_state is not None:
                    shadow = job.draft_state.lookup.draft(c.speculation_max_tokens)  # type: ignore[union-attr]
                    job.shadow = (shadow, 0) if shadow else None
                continue
            room -= k
            tokens = list(job.request.prompt_tokens) + job.decoded + [job.pending_token] if self._drafter.kind == "draft" else []
            wants.append((job.slot, job.draft_state, tokens, k))
        drafts = {slot: d for slot, d in self._drafter.draft(wants).items() if d} if wants else {}
        for job in generating:
            if job.slot in drafts:
                job.steps_without_drafts = 0
        return drafts

    def _draft_length(self, job: _Job, acceptance: float, decoding: int) -> int:
        """What pays for this slot at this acceptance; a draft model must first catch up on every
        token it has not seen."""
        assert self._drafter is not None
        c = self.config
        return draft_length(acceptance, self._step_cost, decoding, c.speculation_max_tokens, self._drafter.cost_per_token,
                            setup_s=self._drafter.behind(job.slot, job.n_past + 1) * self._drafter.catch_up_cost,
                            tokens_left=job.request.max_tokens - job.generated)

    def _verify(self, job: _Job, first_row: int, drafts: tuple[int, ...]) -> None:
        """Samples position by position; a drafted token that matches what was sampled is kept
        (its KV is already in place) and sampling goes on from the next position."""
        kept = 0
        for i in range(len(drafts) + 1):
            token = self._sample(job, first_row + i)
            if token is None or i == len(drafts) or token != drafts[i]:
                break
            job.pending_token = None
            job.decoded.append(token)
            job.n_past += 1
            kept += 1
        job.acceptance = job.acceptance.update(len(drafts), kept)
        self._acceptance = self._acceptance.update(len(drafts), kept, decay=0.98)
        stats = self.speculation_stats
        stats.drafted += len(drafts)
        stats.accepted += kept
        stats.verify_steps += 1
        if self._active.get(job.slot) is job:
            self.ctx.trim_sequence(job.slot, job.n_past)  # the rejected drafts' KV
        if self._drafter is not None:
            self._drafter.settle(job.slot, job.n_past)

    def _observe(self, job: _Job, token: int) -> None:
        if self._drafter is None or job.draft_state is None:
            return
        self._drafter.observe(job.draft_state, token)
        if job.shadow is not None:
            draft, matched = job.shadow
            if draft[matched] == token and matched + 1 < len(draft):
                job.shadow = (draft, matched + 1)
            else:
                kept = matched + (draft[matched] == token)
                job.acceptance = job.acceptance.update(len(draft), kept)
                self._acceptance = self._acceptance.update(len(draft), kept, decay=0.98)
                job.shadow = None

    def _sample(self, job: _Job, row: int) -> int | None:
        """Samples the slot's next token and streams it; the token, or None once the job ended."""
        if job.adjuster is None:
            token = job.sampler.sample(self.ctx, row)
        else:
            try:
                token = job.sampler.pick(job.adjuster(self.ctx.logits(row)))
            except EngineError as exc:
                self._release(job, "error", error=str(exc))
                return None
            job.adjuster.accept(token)
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        else:
            job.token_gaps.append(now - job.last_token_at)
        job.last_token_at = now
        job.generated += 1
        self._observe(job, token)
        if self.model.is_eog(token):
            job.pending_token = None
            self._release(job, "stop")
            return None
        logprob = self._logprob(job, row, token) if job.request.sampling.logprobs else None
        text = job.stops.feed(job.utf8.feed(self.model.piece(token, special=token in job.request.preserved_tokens)))
        job.emit(TokenEvent(text, token, logprob))
        if job.stops.stopped:
            self._release(job, "stop")
        elif job.generated >= job.request.max_tokens:
            self._release(job, "length")
        else:
            job.pending_token = token
            return token
        return None

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

    def _release(self, job: _Job, reason: FinishReason, error: str | None = None, status: int | None = None) -> None:
        self._active.pop(job.slot, None)
        holder = ("slot", job.slot)
        if reason == "error" or not self.config.prefix_cache:
            self.ctx.clear_sequence(job.slot)
            self._index.remove(holder)
        else:
            self.ctx.trim_sequence(job.slot, job.n_past)
            self._index.insert(job.key, holder, (job.request.prompt_tokens + tuple(job.decoded))[: job.n_past])
        self._finish(job, reason, error, status)

    def _finish(self, job: _Job, reason: FinishReason, error: str | None = None, status: int | None = None) -> None:
        tail = ""
        if reason in ("stop", "length"):
            tail = job.stops.feed(job.utf8.flush()) + job.stops.flush()
        job.sampler.close()
        end = time.perf_counter()
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted_at
        queued = None if job.first_step_at is None else job.first_step_at - job.submitted_at
        usage = Usage(len(job.request.prompt_tokens), job.generated, job.reused)
        job.emit(FinishEvent(reason, usage, tail, ttft, end - job.submitted_at, error, error_status=status,
                             error_code=SHUTTING_DOWN if status else None, retry_after_s=SHUTDOWN_RETRY_AFTER_S if status else None,
                             queue_time_s=queued, inter_token_s=tuple(job.token_gaps)))

    def _fail_all(self, message: str, status: int | None = None) -> None:
        """Ends every request with an error: the engine's own failure (500), or with `status` the
        server stopping (503 and Retry-After, the stream ended as a client can parse)."""
        for job in list(self._active.values()):
            self._release(job, "error", error=message, status=status)
        while self._waiting:
            self._finish(self._waiting.popleft(), "error", error=message, status=status)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Job):
                self._finish(item, "error", error=message, status=status)
            elif isinstance(item, _Abort):
                continue
            elif isinstance(item, (_EmbedJob, ModelThreadCall)):
                item.fail(EngineClosed(message))

    # ---- embeddings -----------------------------------------------------------------------------

    def _run_embeddings(self, job: _EmbedJob) -> None:
        """Each group of inputs in one decode, input j as sequence j, pooled by llama.cpp."""
        try:
            vectors = np.empty((len(job.inputs), self.model.n_embd), dtype=np.float32)
            lengths = [len(t) for t in job.inputs]
            for group in pack(lengths, max_tokens=self.config.batch_tokens, max_rows=self.config.slots, padded=False):
                for seq in range(len(group)):
                    self.ctx.clear_sequence(seq)
                self.ctx.decode([(t, pos, seq, True) for seq, i in enumerate(group) for pos, t in enumerate(job.inputs[i])])
                for seq, i in enumerate(group):
                    vectors[i] = self.ctx.sequence_embedding(seq)
                    self.ctx.clear_sequence(seq)
            job.succeed(vectors)
        except Exception as exc:
            job.fail(exc)


class _EmbedJob:
    def __init__(self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop, future: asyncio.Future[np.ndarray]) -> None:
        self.inputs, self.loop, self.future = inputs, loop, future

    def succeed(self, vectors: np.ndarray) -> None:
        self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_result(vectors))

    def fail(self, exc: Exception) -> None:
        self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_exception(exc))


_WAKE = object()


@dataclass(frozen=True)
class _Abort:
    message: str
