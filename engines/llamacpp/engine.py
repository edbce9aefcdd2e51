"""The llama.cpp engine: the slot loop on the model thread of engines/core.py.

Each step: admit waiting requests into free slots (reusing a cached prefix from a slot or host
RAM), build one batch (every generating slot's decode token first, then prompt chunks under a
token budget), decode, sample each slot with its own sampler (verifying drafts where it
speculates), hand each token to the core, which streams it out; release finished slots.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.core import AdapterKey, Job, LocalEngine
from engines.embedding import check_lengths, pack, resolve_pooling
from engines.interface import Capabilities, EngineError, EngineEvent, FinishReason, GenerationRequest
from engines.llamacpp.drafting import Drafter, DraftModelDrafter, DraftState, PromptLookupDrafter, measure_step_cost
from engines.llamacpp.runtime import Adapter, Context, ContextParams, KvFull, Model, Sampler
from engines.llamacpp.vocabulary import LlamaVocabulary
from engines.logprobs import log_softmax
from engines.scheduler import Admission, BatchItem, SlotView, Source, plan_admission, plan_batch
from engines.speculation import Acceptance, StepCost, draft_length
from engines.vocabulary import SpeaksVocabulary

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
    prefills_per_step: int = 1  # prompts a step may leave unfinished (0: as many as the token budget holds)
    batch_invariant: bool = False
    kv_type: str = "f16"  # K; V too unless kv_type_v says otherwise
    kv_tokens: int = 0  # KV cells the slots share (unified layout only); 0: slots x context_length
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
    gpu_layers: int = 0  # llama.cpp's n_gpu_layers (appliance/fleet/memory.py plans it)



def context_layout(batch_invariant: bool, kv_type: str, pooled: bool = False) -> tuple[bool, bool]:
    """(kv_unified, flash_attn) for a model. Invariance needs one KV stream per sequence, and flash
    attention only where ggml's CPU kernel cannot switch paths by batch shape: its split-KV and tiled
    paths take f16/f32 KV only, so a q8_0 cache always runs the sequential one (docs/architecture.md).
    Otherwise flash attention, and one stream per sequence unless the slots share a smaller pool
    (`pooled`): in one unified stream each token attends over every sequence's cells, masked, which
    made eight 1.1k-token prompts take 30% longer (docs/performance.md)."""
    if not batch_invariant:
        return pooled, True
    return False, kv_type not in ("f16", "bf16")


class _SlotJob(Job):
    """A request in a slot: where its sequence stands, and its speculation."""

    def __init__(self, request: GenerationRequest, sampler: Sampler | None, emit: Callable[[EngineEvent], None]) -> None:
        super().__init__(request, sampler, emit)
        self.slot = -1
        self.admitted_seq = 0
        self.n_past = 0
        self.pending_token: int | None = None
        self.decoded: list[int] = []  # generated tokens whose KV is in the slot
        self.parked: tuple[Source, _SlotJob] | None = None  # waiting for another slot's prefill
        self.draft_state: DraftState | None = None
        self.acceptance = Acceptance()
        # Prompt lookup's draft for a step that did not speculate, scored against what the slot
        # then samples, so the acceptance estimate stays current at no cost: (draft, matched).
        self.shadow: tuple[tuple[int, ...], int] | None = None
        self.steps_without_drafts = 0
        # The sequence's KV, saved to host RAM while a shared KV pool has no room for it; the
        # slot stays the job's, so it resumes where it stopped.
        self.swapped: bytes | None = None

    def view(self, drafted: int = 0) -> SlotView:
        return SlotView(self.slot, self.admitted_seq, len(self.request.prompt_tokens), self.n_past, self.pending_token is not None, drafted)


class LlamaCppEngine(SpeaksVocabulary, LocalEngine):
    name = "llamacpp"

    def __init__(self, config: LlamaCppConfig) -> None:
        super().__init__(slots=config.slots, max_queue=config.max_queue, host_cache_bytes=config.prefix_host_bytes,
                         thread_name=f"llamacpp:{config.path.name}")
        self.config = config
        self.capabilities(embeddings=config.embeddings).apply(self)
        self.model = Model(config.path, use_extra_buffers=not config.batch_invariant, gpu_layers=config.gpu_layers)
        self.vocabulary = LlamaVocabulary(self.model)  # the engine closes its model (_free_model)
        try:
            # Embeddings: `slots` sequences share a forward pass, which holds every token of each.
            self.pooling = resolve_pooling(config.pooling, self.model.pooling()) if config.embeddings else None
            pooled = 0 < config.kv_tokens < config.slots * config.context_length
            kv_unified, flash_attn = context_layout(config.batch_invariant, config.kv_type, pooled)
            # With a KV stream per sequence llama.cpp splits a pass into equal shares of each
            # sequence, and pools a sequence over its last share only: one stream keeps a pass whole.
            kv_unified = kv_unified or config.embeddings
            shape = ContextParams(
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
                kv_tokens=config.kv_tokens if kv_unified and not config.embeddings else 0,
            )
            self.ctx = Context(self.model, shape)
        except Exception:
            self.model.close()
            raise
        self._active: dict[int, _SlotJob] = {}  # by slot; an active slot is in the prefix index with its whole prompt
        self._admissions = itertools.count()
        self._acceptance = Acceptance()  # across requests: a new request's starting estimate
        self._drafter: Drafter | None = None
        self._step_cost = StepCost(())
        self._room_freed = False  # a job ended since the last swap-out: swapped jobs may fit again
        try:
            self._install_adapters(config.adapters)
            self._start_speculation()
        except Exception:
            self._drop_adapters()
            self.ctx.close()
            self.model.close()
            raise
        self._start_thread()

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

    # ---- the model's own surface ------------------------------------------------------------------

    @classmethod
    def capabilities(cls, *, embeddings: bool) -> Capabilities:
        """What a model of this config serves (a model loaded on demand shows it unloaded)."""
        return Capabilities.of(cls, supports_embeddings=embeddings)

    @property
    def context_length(self) -> int:
        return self.ctx.n_ctx_per_seq

    # ---- the core's hooks -------------------------------------------------------------------------

    def _new_job(self, request: GenerationRequest, sampler: Any, emit: Callable[[EngineEvent], None]) -> Job:
        return _SlotJob(request, sampler, emit)

    def _make_sampler(self, request: GenerationRequest) -> Sampler:
        s = request.sampling
        return Sampler(self.model, temperature=s.temperature, top_p=s.top_p, seed=s.seed, grammar=s.grammar, top_k=s.top_k)

    def _on_thread_start(self) -> None:
        # Signals go to the main thread only. A signal landing on this thread or on the OpenMP
        # workers it starts (they inherit this mask) stalls llama_decode for seconds.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        self._measure_speculation()

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

    def _piece(self, token: int, special: bool) -> bytes:
        return self.model.piece(token, special=special)

    def _is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def _attach_adapter(self, name: str, prepared: Path) -> Adapter:
        return Adapter(self.model, prepared)

    def _detach_adapter(self, name: str, handle: Adapter) -> None:
        handle.close()

    def _apply_adapters(self, key: AdapterKey) -> None:
        self.ctx.set_adapters([(self._adapters[name].handle, scale) for name, scale in key])

    def _forget_holder(self, holder: Hashable) -> None:
        self.ctx.clear_sequence(holder[1])  # type: ignore[index]

    def _embed_groups(self, inputs: list[list[int]]) -> list[list[int]]:
        # A pass holds an input whole; absolute positions (BERT) end at the trained length.
        check_lengths(inputs, min(self.context_length, self.config.batch_tokens, self.model.n_ctx_train))
        return pack([len(t) for t in inputs], max_tokens=self.config.batch_tokens, max_rows=self.config.slots, padded=False)

    def _embed_pass(self, inputs: list[list[int]]) -> np.ndarray:
        """One decode, input j as sequence j, pooled by llama.cpp."""
        rows = np.empty((len(inputs), self.model.n_embd), dtype=np.float32)
        for seq in range(len(inputs)):
            self.ctx.clear_sequence(seq)
        self.ctx.decode([(t, pos, seq, True) for seq, tokens in enumerate(inputs) for pos, t in enumerate(tokens)])
        for seq in range(len(inputs)):
            rows[seq] = self.ctx.sequence_embedding(seq)
            self.ctx.clear_sequence(seq)
        return rows

    def _free_model(self) -> None:
        if self._drafter is not None:
            if self._step_cost.samples:
                log.info("speculation: verify steps of 1..%d tokens took %s ms while serving", len(self._step_cost.seconds),
                         " ".join(f"{t * 1e3:.0f}" for t in self._step_cost.seconds))
            self._drafter.close()
        self.ctx.close()
        self._drop_adapters()
        self.model.close()

    @property
    def _speculating(self) -> bool:
        return self._drafter is not None

    def _kv_capacity_tokens(self) -> int:
        return self.ctx.shape.kv_tokens or self.config.slots * self.context_length

    def _slot_states(self) -> tuple[tuple[str, int], ...]:
        """Read from other threads: a snapshot that may be a step old, never torn."""
        active = dict(self._active)
        out = []
        for slot in range(self.config.slots):
            job = active.get(slot)
            if job is None:
                holder = ("slot", slot)
                out.append(("idle", len(self._index.tokens(holder)) if holder in self._index else 0))
            elif job.swapped is not None:
                out.append(("waiting", 0))  # its KV is in host RAM
            elif job.parked is not None:
                out.append(("waiting", job.n_past))
            else:
                out.append(("decode" if job.pending_token is not None else "prefill", job.n_past))
        return tuple(out)

    # ---- admission and the prefix cache ----------------------------------------------------------

    def _admit(self, waiting: deque[Job]) -> None:
        # Slots whose stream another slot copies at the next decode: nothing may overwrite them
        # before then (llama.cpp copies whole streams when the step begins).
        copying_from: set[int] = set()
        self._unpark(copying_from)
        if not self._swap_in():
            return  # the oldest requests resume first; new ones would take their room
        while waiting and len(self._active) < self.config.slots:
            job = waiting[0]
            assert isinstance(job, _SlotJob)
            admission = self._plan(job)
            if admission.slot in copying_from:
                break  # admit it next step, once the copy has happened
            waiting.popleft()
            self._started(job)
            job.slot = admission.slot
            job.admitted_seq = next(self._admissions)
            restoring = admission.source.holder[1] if admission.source and admission.source.holder[0] == "host" else None
            self._evict(admission.slot, admission.reuse, restoring)
            job.n_past = job.reused = admission.reuse
            self.prefix_stats.prompt_tokens += len(job.request.prompt_tokens)
            self.prefix_stats.reused_in_slot += admission.reuse
            if self.config.prefix_cache:
                self._index.insert(job.prefix_key, ("slot", job.slot), job.request.prompt_tokens)
            if self._drafter is not None:
                job.draft_state = self._drafter.start(job.slot, job.request.prompt_tokens, admission.reuse)
                job.acceptance = self._acceptance.prior()  # what this model's drafts scored lately, lightly held
            self._active[job.slot] = job
            if admission.source is not None:
                self._follow(job, admission, copying_from)

    def _plan(self, job: _SlotJob) -> Admission:
        free = [s for s in range(self.config.slots) if s not in self._active]
        if not self.config.prefix_cache:
            return Admission(min(free), 0)
        shared = self._index.match(job.prefix_key, job.request.prompt_tokens)
        return self._plan_reuse(job, shared, {s: shared.get(("slot", s), 0) for s in free})

    def _plan_reuse(self, job: _SlotJob, shared: dict, candidates: dict[int, int]) -> Admission:
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

    def _follow(self, job: _SlotJob, admission: Admission, copying_from: set[int]) -> None:
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
                self.ctx.restore_sequence(job.slot, self._host.get(ident))
                self.ctx.trim_sequence(job.slot, length)
                self.prefix_stats.reused_from_host += length
        except EngineError as exc:
            log.warning("could not reuse a cached prefix (%s); computing it", exc)
            if kind == "host":
                self._host.drop(ident)
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
            if self._active.get(source.holder[1]) is source_job and source_job.swapped is None:
                if source_job.n_past >= source.length:
                    self._follow(job, Admission(job.slot, job.n_past, Source(source.holder, source.length, source.length)), copying_from)
                continue
            shared = self._index.match(job.prefix_key, job.request.prompt_tokens)
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
        self._host.put(key, tokens, data, len(data), protect)

    # ---- a shared KV pool that runs out -------------------------------------------------------

    def _make_room(self) -> None:
        """The batch found no room in the KV pool: idle slots give up the prefixes they hold (to
        host RAM where worth it); failing that, the newest request moves its KV to host RAM and
        waits, keeping its slot, until a request ends. The step is then planned again."""
        idle = self._idle_holders()
        if idle:
            for slot in idle:
                self._evict(slot, 0)
            return
        held = [j for j in self._active.values() if j.swapped is None]
        if len(held) <= 1:
            # kv_tokens >= context_length, so one request alone always fits: this is a bug
            for job in held:
                self._end(job, "error", error="the KV cache has no room for this request")
            return
        victim = max(held, key=lambda j: j.admitted_seq)
        try:
            data = self.ctx.save_sequence(victim.slot)
        except EngineError as exc:
            self._end(victim, "error", error=f"the KV cache is full and the request could not be set aside: {exc}")
            return
        self.ctx.clear_sequence(victim.slot)
        self._index.remove(("slot", victim.slot))  # nobody may copy a prefix from it meanwhile
        victim.swapped, victim.parked = data, None
        self._room_freed = False
        self.prefix_stats.swapped_out += 1
        log.info("KV pool full: slot %d (%d tokens) waits in host RAM", victim.slot, victim.n_past)

    def _idle_holders(self) -> list[int]:
        """Free slots whose KV still holds a cached prefix."""
        return [s for s in range(self.config.slots) if s not in self._active and ("slot", s) in self._index]

    def _swap_in(self) -> bool:
        """Brings set-aside requests back, oldest first, once a request has ended and the pool
        has room for them; True when none is left waiting."""
        swapped = sorted((j for j in self._active.values() if j.swapped is not None), key=lambda j: j.admitted_seq)
        if not swapped:
            return True
        if not self._room_freed:
            return False
        capacity = self._kv_capacity_tokens()
        for job in swapped:
            # what requests hold, counted without sharing (an upper bound), plus a step's growth
            held = sum(j.n_past + 1 for j in self._active.values() if j.swapped is None)
            idle = self._idle_holders()
            cached = sum(len(self._index.tokens(("slot", s))) for s in idle)
            if held + job.n_past + 1 > capacity:
                self._room_freed = False
                return False
            if held + cached + job.n_past + 1 > capacity:
                for slot in idle:
                    self._evict(slot, 0)
            try:
                self.ctx.restore_sequence(job.slot, job.swapped)  # type: ignore[arg-type]
            except EngineError:  # no room in one piece: wait for the next request to end
                self._room_freed = False
                return False
            job.swapped = None
            if self.config.prefix_cache:
                self._index.insert(job.prefix_key, ("slot", job.slot), job.request.prompt_tokens)
        return True

    def _step(self) -> None:
        runnable = [j for j in self._active.values() if j.parked is None and j.swapped is None]
        if not runnable:
            return
        # llama.cpp applies adapters to a whole context: a step serves one adapter set
        runnable = self._take_turn(runnable)  # type: ignore[arg-type,assignment]
        if not runnable:
            return
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
        except KvFull:
            self._make_room()
            return
        except EngineError as exc:
            for item in plan:
                self._end(self._active[item.slot], "error", error=str(exc))
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

    def _drafts(self, generating: list[_SlotJob]) -> dict[int, tuple[int, ...]]:
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

    def _draft_length(self, job: _SlotJob, acceptance: float, decoding: int) -> int:
        """What pays for this slot at this acceptance; a draft model must first catch up on every
        token it has not seen."""
        assert self._drafter is not None
        c = self.config
        return draft_length(acceptance, self._step_cost, decoding, c.speculation_max_tokens, self._drafter.cost_per_token,
                            setup_s=self._drafter.behind(job.slot, job.n_past + 1) * self._drafter.catch_up_cost,
                            tokens_left=job.request.max_tokens - job.generated)

    def _verify(self, job: _SlotJob, first_row: int, drafts: tuple[int, ...]) -> None:
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

    def _observe(self, job: _SlotJob, token: int) -> None:
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

    def _sample(self, job: _SlotJob, row: int) -> int | None:
        """Samples the slot's next token and streams it; the token, or None once the job ended."""
        if job.adjuster is None:
            token = job.sampler.sample(self.ctx, row)
        else:
            try:
                token = job.sampler.pick(job.adjuster(self.ctx.logits(row)))
            except EngineError as exc:
                self._end(job, "error", error=str(exc))
                return None
            job.adjuster.accept(token)
        self._observe(job, token)
        reason = self._deliver(job, token, lambda: log_softmax(self.ctx.logits(row)))
        if reason is not None:
            self._end(job, reason)
            return None
        job.pending_token = token
        return token

    def _release(self, job: Job, reason: FinishReason) -> None:
        assert isinstance(job, _SlotJob)
        self._active.pop(job.slot, None)
        self._room_freed = True
        holder = ("slot", job.slot)
        if reason == "error" or not self.config.prefix_cache or job.swapped is not None:
            job.swapped = None
            self.ctx.clear_sequence(job.slot)
            self._index.remove(holder)
        else:
            self.ctx.trim_sequence(job.slot, job.n_past)
            self._index.insert(job.prefix_key, holder, (job.request.prompt_tokens + tuple(job.decoded))[: job.n_past])
