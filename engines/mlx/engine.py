"""The MLX engine: mlx-lm's continuous batching (BatchGenerator) on a thread that owns the model.

New requests join the running batch at the next step; each request has its own sampler, stop
strings, UTF-8 streaming and cancellation, as in the llama.cpp engine. A prompt cache across
requests: every finished sequence's KV is kept (LRU by bytes) in a prefix index, and a new prompt
starts from the longest shared prefix. Grammars and seeded draws run llama.cpp's own sampler chain
over MLX's logits, through the vocabulary of the GGUF the folder was converted from. Not yet here:
speculative decoding and adapters (refused with a clear error).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engines.base import (
    SHUTDOWN_RETRY_AFTER_S,
    SHUTTING_DOWN,
    AdapterInfo,
    EngineClosed,
    EngineError,
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
from engines.mlx.lora import AdapterSet, read_adapter
from engines.prefix import PrefixIndex
from engines.sampling import LogitAdjuster
from engines.speculation import Acceptance, StepCost, draft_length
from engines.stream import EventStream
from engines.text import StopMatcher, Utf8Stream

log = logging.getLogger("appliance.mlx")


@dataclass(frozen=True)
class MlxConfig:
    path: Path  # an MLX model folder (see engines/mlx/convert.py for GGUF files)
    slots: int
    context_length: int
    max_queue: int
    prompt_cache_bytes: int = 256 << 20  # 0 turns the prompt cache off
    prompt_cache_min_tokens: int = 16  # shorter shared prefixes are recomputed
    # A GGUF with the same vocabulary (the file the folder was converted from): llama.cpp's sampler
    # chain then runs over MLX's logits, for grammars (response_format) and seeded draws.
    vocabulary: Path | None = None
    adapters: tuple[tuple[str, Path, float], ...] = ()  # LoRA adapters loaded at start: name, folder, scale
    draft: Path | None = None  # an MLX folder with the same vocabulary: speculative decoding
    draft_max_tokens: int = 8  # drafted per verification at most
    draft_fixed_tokens: int = 0  # 0: as many as the measured costs say pay (none when drafting cannot pay)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (printable stand-ins for every byte value)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, n = visible[:], 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, codes)}


class _Job:
    def __init__(self, request: GenerationRequest, stream: EventStream) -> None:
        self.request, self.stream = request, stream
        self.uid: int | None = None
        self.key = request.adapter_key  # the adapter set; its KV and its generator are this set's only
        self.generator: Any = None  # the BatchGenerator of its adapter set, once admitted
        self.reused = 0
        self.cancelled = False
        self.generated = 0
        self.utf8 = Utf8Stream()
        self.stops = StopMatcher(request.stop)
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.sampler: Any = None  # llama.cpp's chain over this job's logits (grammar, seed), closed when it ends
        # logit_bias and penalties (engines/sampling.py), applied before either sampler
        self.adjuster = LogitAdjuster(request.sampling) if request.sampling.adjusts_logits else None
        self.lane: Any = None  # mlx-lm's speculative generator, when the job decodes speculatively
        self.lane_k = 0  # its drafted tokens per verification
        self.lane_run = 0  # drafted tokens accepted since its last verification


class MlxEngine:
    name = "mlx"
    supports_grammar = False
    supports_logprobs = True
    supports_embeddings = False
    supports_adapters = True
    takes_messages = False

    def __init__(self, config: MlxConfig) -> None:
        import mlx_lm

        self.config = config
        self.model, self.tokenizer = mlx_lm.load(str(config.path))
        self._vocabulary = None
        if config.vocabulary is not None:
            from engines.llamacpp.runtime import Model

            self._vocabulary = Model(config.vocabulary, vocab_only=True)
        self.supports_grammar = self._vocabulary is not None
        hf = self.tokenizer._tokenizer  # the transformers tokenizer mlx-lm wraps
        self._hf = hf
        decoder = _byte_decoder()
        self._special = set(hf.all_special_ids)
        self._pieces: dict[int, bytes] = {}
        for token, ident in hf.get_vocab().items():
            if ident in self._special or token in hf.all_special_tokens:
                self._pieces[ident] = token.encode()
            else:
                self._pieces[ident] = bytes(decoder.get(ch, ord("?")) for ch in token)
        self._eos = set(self.tokenizer.eos_token_ids)
        self._index = PrefixIndex()  # prompt-cache entries by the tokens their KV holds
        self._caches: OrderedDict[int, tuple[list[Any], int]] = OrderedDict()  # id -> (per-layer KV, bytes), LRU first
        self._cache_ids = itertools.count()
        self.prefix_stats = PrefixStats()
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._jobs: dict[tuple[Any, int], _Job] = {}  # (adapter set, uid in its generator) -> job
        self._waiting: list[_Job] = []
        self._lora = AdapterSet(self.model)
        self._adapter_scales: dict[str, float] = {}  # name -> the scale a request gets by default
        self._draft = None
        self.speculation_stats = SpeculationStats()
        self._lane: _Job | None = None  # the request decoding speculatively, alone
        self._acceptance = Acceptance()
        self._step_cost, self._draft_cost = StepCost(()), 0.0
        if config.draft is not None:
            self._draft = self._load_draft(config.draft)
            if not config.draft_fixed_tokens:
                self._step_cost, self._draft_cost = self._measure_speculation(config.draft_max_tokens)
        for name, path, scale in config.adapters:  # before the model thread starts: this thread may touch the model
            self._lora.load(name, read_adapter(path))
            self._adapter_scales[name] = scale
        self._queued = 0
        self._closing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mlx:{config.path.name}", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        # transformers parses special tokens in text unless told to split them as plain text
        return list(self._hf.encode(text, add_special_tokens=add_special, split_special_tokens=not parse_special))

    def control_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._hf.added_tokens_decoder.items() if t.special and t.content}

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self._pieces.get(t, b"") for t in tokens).decode("utf-8", errors="replace")

    def vocab_size(self) -> int:
        return len(self._pieces)

    def add_bos(self) -> bool:
        return bool(getattr(self._hf, "add_bos_token", False))

    def chat_template(self) -> str | None:
        return self._hf.chat_template

    def special_tokens(self) -> dict[str, str]:
        return {k: v for k, v in (("bos_token", self._hf.bos_token), ("eos_token", self._hf.eos_token)) if v}

    def generate(self, request: GenerationRequest) -> EventStream:
        if self._closing:
            raise EngineClosed("the model is shutting down")
        if request.sampling.grammar is not None and self._vocabulary is None:
            raise EngineError("this MLX model was not converted from a GGUF here, so it has no grammar vocabulary; "
                              "response_format needs a model converted by the appliance or a llama.cpp model")
        unknown = [name for name, _ in request.adapters if name not in self._adapter_scales]
        if unknown:
            raise UnknownAdapter(f"no adapter named {unknown[0]!r} is loaded on this model")
        check_context(request, self.context_length)
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty")
        sampler = self._llama_sampler(request)  # a grammar that does not parse is refused here, not mid-stream
        with self._lock:
            if self._queued >= self.config.max_queue + self.config.slots:
                if sampler is not None:
                    sampler.close()
                raise EngineOverloaded(f"the queue for this model is full ({self.config.max_queue} waiting)")
            self._queued += 1
        stream = EventStream(asyncio.get_running_loop())
        job = _Job(request, stream)
        job.sampler = sampler
        stream.on_close = lambda: self._cancel(job)
        self._inbox.put(job)
        return stream

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        raise EngineError("this model is not configured for embeddings")

    def adapters(self) -> list[AdapterInfo]:
        using: dict[str, int] = {}
        for job in list(self._jobs.values()) + list(self._waiting):
            for name, _ in job.request.adapters:
                using[name] = using.get(name, 0) + 1
        return [AdapterInfo(name, str(self._lora.path(name)), scale, using.get(name, 0))
                for name, scale in sorted(self._adapter_scales.items())]

    async def load_adapter(self, name: str, path: Path, scale: float = 1.0) -> AdapterInfo:
        """Loads (or replaces, when idle) an mlx-lm LoRA adapter without reloading the base."""
        weights = await asyncio.to_thread(read_adapter, path)

        def load() -> AdapterInfo:
            if name in self._adapter_scales and self._in_use(name):
                raise EngineError(f"adapter {name!r} is serving requests; unload it when they finish")
            self._lora.load(name, weights)
            self._forget_prefixes(name)
            self._adapter_scales[name] = scale
            return AdapterInfo(name, str(path), scale)

        return await self._on_model_thread(load)

    async def unload_adapter(self, name: str) -> None:
        def unload() -> None:
            if name not in self._adapter_scales:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded on this model")
            if self._in_use(name):
                raise EngineError(f"adapter {name!r} is serving requests; unload it when they finish")
            del self._adapter_scales[name]
            self._lora.unload(name)
            self._forget_prefixes(name)

        await self._on_model_thread(unload)

    def _in_use(self, name: str) -> bool:
        return any(name == n for job in list(self._jobs.values()) + list(self._waiting) for n, _ in job.request.adapters)

    async def _on_model_thread(self, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(ModelThreadCall(fn, loop, future))  # type: ignore[arg-type]
        return await future

    def stats(self) -> EngineStats:
        busy = len(self._jobs) + (self._lane is not None)
        return EngineStats(self.config.slots, busy, max(0, self._queued - busy), replace(self.prefix_stats),
                           replace(self.speculation_stats) if self._draft is not None else None)

    def _load_draft(self, folder: Path):  # type: ignore[no-untyped-def]
        """The draft model, refused unless its vocabulary is the target's token for token."""
        import mlx_lm

        draft, tokenizer = mlx_lm.load(str(folder))
        ours, theirs = self._hf.get_vocab(), tokenizer._tokenizer.get_vocab()
        if ours != theirs:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
            raise EngineError(f"the draft model {folder} has another vocabulary than {self.config.path} "
                              f"({len(theirs)} against {len(ours)} tokens; first difference: token {differing[0][1]} {differing[0][0]!r})")
        return draft

    async def start(self) -> None:
        pass  # the model thread started with the engine

    def close(self) -> None:
        self._closing = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._vocabulary is not None and not self._thread.is_alive():  # its samplers are closed with their jobs
            self._vocabulary.close()

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True

    def abort_all(self, message: str) -> None:
        """Ends every running and waiting request at the next step with a 503 (the server is
        stopping and its grace period is running out). Called on the event loop."""
        loop = asyncio.get_running_loop()
        self._inbox.put(ModelThreadCall(lambda: self._abort(message), loop, loop.create_future()))

    def _abort(self, message: str) -> None:
        for job in list(self._jobs.values()):
            job.generator.remove([job.uid])
            self._finish(job, "error", error=message, status=503)
        while self._waiting:
            self._finish(self._waiting.pop(0), "error", error=message, status=503)
        if self._lane is not None:
            self._lane.lane.close()
            self._finish(self._lane, "error", error=message, status=503)
            self._lane = None

    # ---- the model thread -------------------------------------------------------------------

    def _run(self) -> None:
        """Requests with the same adapter set share one BatchGenerator (one batch); the sets take
        turns step by step, each step under its own adapters, as in the llama.cpp engine."""
        generators: dict[Any, Any] = {}
        served: Any = None
        waiting = self._waiting
        try:
            while True:
                try:
                    idle = not self._jobs and not waiting and self._lane is None
                    item = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
                    while True:
                        if item is None:
                            return
                        if isinstance(item, ModelThreadCall):
                            item.run()
                        else:
                            waiting.append(item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                for job in [j for j in self._jobs.values() if j.cancelled]:
                    job.generator.remove([job.uid])
                    self._finish(job, "cancelled")
                for job in [j for j in waiting if j.cancelled]:
                    waiting.remove(job)
                    self._finish(job, "cancelled")
                if self._lane is not None and self._lane.cancelled:
                    self._lane.lane.close()
                    self._finish(self._lane, "cancelled")
                    self._lane = None
                room = self.config.slots - len(self._jobs) - (self._lane is not None)
                if room > 0 and waiting and self._speculates(waiting[0], alone=len(waiting) == 1):
                    self._start_lane(waiting.pop(0))
                    room -= 1
                if room > 0 and waiting:
                    admitted = waiting[:room]
                    del waiting[:room]
                    for key in sorted({j.key for j in admitted}):
                        group = [j for j in admitted if j.key == key]
                        if key not in generators:
                            generators[key] = self._generator()
                        self._admit(generators[key], group)
                if self._lane is not None:
                    self._step_lane()  # takes its turn beside the batch
                if not self._jobs:
                    continue
                keys = sorted({j.key for j in self._jobs.values()})
                key = keys[0] if served is None else next((k for k in keys if k > served), keys[0])
                served = key
                if self._lora.active_key != key:
                    self._lora.activate(key)
                _, responses = generators[key].next()
                for response in responses:
                    job = self._jobs.get((key, response.uid))
                    if job is not None:
                        self._token(job, response)
                for idle in [k for k in generators if k != () and all(j.key != k for j in self._jobs.values())]:
                    generators.pop(idle).close()  # an adapter set nobody uses now keeps no batch state
        except Exception as exc:
            log.exception("MLX model thread crashed")
            for job in list(self._jobs.values()) + waiting + ([self._lane] if self._lane else []):
                self._finish(job, "error", error=f"engine failure: {exc}")
            self._lane = None
        finally:
            self._closing = True
            for generator in generators.values():
                generator.close()
            for job in list(self._jobs.values()) + waiting + ([self._lane] if self._lane else []):
                self._finish(job, "error", error="the model is shutting down", status=503)
            self._lane = None
            while True:  # calls that arrived after the last step are answered, not left hanging
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, ModelThreadCall):
                    item.fail(EngineClosed("the model is shutting down"))

    # ---- speculative decoding ------------------------------------------------------------------

    def _measure_speculation(self, k_max: int) -> tuple[StepCost, float]:
        """What a verification of 1 to k_max + 1 tokens costs the target, and a draft token the
        draft, after a short context (the faster of two runs): the same inputs the llama.cpp
        engine's decision takes. Milliseconds on Apple silicon; a few seconds on a CPU."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        def timed(model, n: int) -> float:  # type: ignore[no-untyped-def]
            runs = []
            for _ in range(2):
                cache = make_prompt_cache(model)
                mx.eval(model(mx.array([[1] * 4]), cache=cache))
                start = time.perf_counter()
                mx.eval(model(mx.array([[1] * n]), cache=cache))
                runs.append(time.perf_counter() - start)
            return min(runs)

        # A few sizes, the rest interpolated: the cheap region (2-5 tokens) is where drafts pay.
        sizes = sorted({n for n in (1, 2, 3, 5, k_max + 1) if n <= k_max + 1})
        import numpy as np

        measured = [timed(self.model, n) for n in sizes]
        cost = StepCost(tuple(float(t) for t in np.interp(range(1, k_max + 2), sizes, measured)))
        draft_cost = timed(self._draft, 1)
        log.info("MLX speculation: verify costs %s ms for 1..%d tokens, a draft token %.1f ms",
                 [round(t * 1000, 1) for t in cost.seconds], k_max + 1, draft_cost * 1000)
        return cost, draft_cost

    def _lane_tokens(self) -> int:
        """Drafted tokens per verification for the next speculative request; 0: do not speculate."""
        if self.config.draft_fixed_tokens:
            return self.config.draft_fixed_tokens
        return draft_length(self._acceptance.cautious, self._step_cost, 1, self.config.draft_max_tokens, self._draft_cost)

    def _speculates(self, job: _Job, alone: bool) -> bool:
        """A request decodes speculatively when it would otherwise decode alone: mlx-lm's
        speculative step serves one sequence, and a batch already keeps the cores busy. Grammars
        (the sampler would see drafted tokens) and adapters (the draft has none) stay batched."""
        return (self._draft is not None and self._lane is None and alone and not self._jobs
                and job.sampler is None and job.adjuster is None and job.key == () and self._lane_tokens() > 0)

    def _start_lane(self, job: _Job) -> None:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step

        self.prefix_stats.prompt_tokens += len(job.request.prompt_tokens)
        job.lane_k = self._lane_tokens()
        job.lane = speculative_generate_step(mx.array(job.request.prompt_tokens), self.model, self._draft,
                                             num_draft_tokens=job.lane_k, max_tokens=job.request.max_tokens,
                                             sampler=self._sampler(job))
        self._lane = job

    def _step_lane(self) -> None:
        job = self._lane
        assert job is not None
        try:
            token, logprobs, drafted = next(job.lane)
        except StopIteration:
            self._lane = None
            self._finish(job, "length")
            return
        token = int(token)
        stats = self.speculation_stats
        if drafted:
            stats.accepted += 1
            job.lane_run += 1
        else:
            # A round ends with one token of the target's own; it had drafted up to lane_k.
            k = min(job.lane_k, job.request.max_tokens - job.generated + job.lane_run)
            stats.verify_steps += 1
            stats.drafted += k
            self._acceptance = self._acceptance.update(k, job.lane_run)
            job.lane_run = 0
        job.first_token_at = job.first_token_at or time.perf_counter()
        job.generated += 1
        if token in self._eos:
            job.lane.close()
            self._lane = None
            self._finish(job, "stop")
            return
        logprob = self._logprob(job, logprobs, token) if job.request.sampling.logprobs else None
        text = job.stops.feed(job.utf8.feed(self._pieces.get(token, b"")))
        job.stream.push(TokenEvent(text, token, logprob))
        if job.stops.stopped or job.generated >= job.request.max_tokens:
            job.lane.close()
            self._lane = None
            self._finish(job, "stop" if job.stops.stopped else "length")

    def _generator(self):  # type: ignore[no-untyped-def]
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(self.model, completion_batch_size=self.config.slots, prefill_batch_size=self.config.slots,
                              stop_tokens=[[t] for t in self._eos])

    def _admit(self, generator, jobs: list[_Job]) -> None:  # type: ignore[no-untyped-def]
        starts = [self._cached_prefix(j) for j in jobs]
        uids = generator.insert([list(j.request.prompt_tokens[j.reused:]) for j in jobs],
                                max_tokens=[j.request.max_tokens for j in jobs],
                                caches=[cache for cache, _ in starts], all_tokens=[done for _, done in starts],
                                samplers=[self._sampler(j) for j in jobs])
        for job, uid in zip(jobs, uids):
            job.uid, job.generator = uid, generator
            self._jobs[(job.key, uid)] = job

    # ---- the prompt cache ----------------------------------------------------------------------

    def _cached_prefix(self, job: _Job) -> tuple[list[Any] | None, list[int]]:
        """A copy of the KV of the longest cached prefix of the job's prompt, trimmed to it (at
        least one prompt token is left to compute, for logits), and the tokens it covers."""
        prompt = job.request.prompt_tokens
        self.prefix_stats.prompt_tokens += len(prompt)
        if not self.config.prompt_cache_bytes:
            return None, []
        shared = self._index.match(job.key, prompt)
        if not shared:
            return None, []
        holder, length = max(shared.items(), key=lambda kv: kv[1])
        ident = holder[1]
        cache, _ = self._caches[ident]
        length = min(length, len(prompt) - 1, cache[0].offset)
        if length < self.config.prompt_cache_min_tokens:
            return None, []
        self._caches.move_to_end(ident)
        start = copy.deepcopy(cache)  # the stored entry stays whole for the next request
        for layer in start:
            layer.trim(layer.offset - length)
        job.reused = length
        self.prefix_stats.reused_from_host += length
        return start, list(prompt[:length])

    def _forget_prefixes(self, name: str) -> None:
        """Drops every cached prefix computed with the adapter (a reload may change its weights)."""
        for holder in self._index.holders():
            if any(n == name for n, _ in self._index.key(holder)):  # type: ignore[attr-defined]
                self._index.remove(holder)
                _, size = self._caches.pop(holder[1])
                self.prefix_stats.host_bytes -= size
        self.prefix_stats.host_entries = len(self._caches)

    def _keep(self, key: Any, cache: list[Any] | None, tokens: list[int] | None) -> None:
        if not self.config.prompt_cache_bytes or not cache or not tokens:
            return
        length = min(cache[0].offset, len(tokens))
        size = sum(layer.nbytes for layer in cache)
        if length < self.config.prompt_cache_min_tokens or size > self.config.prompt_cache_bytes:
            return
        ident = next(self._cache_ids)
        self._caches[ident] = (cache, size)
        self._index.insert(key, ("cache", ident), tuple(tokens[:length]))
        stats = self.prefix_stats
        stats.host_saves += 1
        stats.host_bytes += size
        while stats.host_bytes > self.config.prompt_cache_bytes:
            old, (_, old_size) = self._caches.popitem(last=False)
            self._index.remove(("cache", old))
            stats.host_bytes -= old_size
            stats.host_evictions += 1
        stats.host_entries = len(self._caches)

    def _llama_sampler(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
        """llama.cpp's chain for requests that need it: a grammar, or a draw (for its seed). Greedy
        requests without a grammar stay on MLX's own argmax, which keeps the step pipelined."""
        s = request.sampling
        if self._vocabulary is None or (s.grammar is None and s.temperature <= 0.0):
            return None
        from engines.llamacpp.runtime import Sampler

        return Sampler(self._vocabulary, temperature=s.temperature, top_p=s.top_p, seed=s.seed, grammar=s.grammar)

    def _sampler(self, job: _Job):  # type: ignore[no-untyped-def]
        import mlx.core as mx
        import numpy as np
        from mlx_lm.sample_utils import make_sampler

        if job.sampler is not None:
            chain = job.sampler
            draw = lambda logprobs: mx.array([chain.pick(np.array(logprobs.astype(mx.float32)))], dtype=mx.uint32)  # noqa: E731
        else:
            s = job.request.sampling
            draw = make_sampler(temp=max(s.temperature, 0.0), top_p=s.top_p if 0 < s.top_p < 1 else 0.0)
        adjuster = job.adjuster
        if adjuster is None:
            return draw

        def adjusted(logprobs):  # type: ignore[no-untyped-def]
            # Log-probabilities differ from logits by a constant per row: the same adjustments apply.
            row = adjuster(np.array(logprobs.astype(mx.float32)))
            token = draw(mx.array(row.reshape(logprobs.shape)))
            adjuster.accept(int(np.array(token).reshape(-1)[0]))  # counted as drawn, whatever the pipeline does next
            return token

        return adjusted

    def _token(self, job: _Job, response) -> None:  # type: ignore[no-untyped-def]
        token = int(response.token)
        job.first_token_at = job.first_token_at or time.perf_counter()
        job.generated += 1
        if token in self._eos:
            self._keep(job.key, response.prompt_cache, response.all_tokens)
            self._finish(job, "stop")
            return
        logprob = self._logprob(job, response.logprobs, token) if job.request.sampling.logprobs else None
        text = job.stops.feed(job.utf8.feed(self._pieces.get(token, b"")))
        job.stream.push(TokenEvent(text, token, logprob))
        if job.stops.stopped:
            kept = job.generator.remove([job.uid], return_prompt_caches=True).get(job.uid)
            if kept:
                self._keep(job.key, *kept)
            self._finish(job, "stop")
        elif response.finish_reason is not None:
            self._keep(job.key, response.prompt_cache, response.all_tokens)
            self._finish(job, "length" if response.finish_reason == "length" else "stop")

    def _logprob(self, job: _Job, logprobs, token: int) -> TokenLogprob:  # type: ignore[no-untyped-def]
        import mlx.core as mx
        import numpy as np

        values = np.array(logprobs.astype(mx.float32), dtype=np.float64)
        k = job.request.sampling.top_logprobs
        tops: tuple[TopLogprob, ...] = ()
        if k > 0:
            best = np.argsort(-values, kind="stable")[:k]
            tops = tuple(TopLogprob(self._pieces[int(t)].decode("utf-8", "replace"), self._pieces[int(t)], float(values[t])) for t in best)
        piece = self._pieces.get(token, b"")
        return TokenLogprob(piece.decode("utf-8", "replace"), piece, float(values[token]), tops)

    def _finish(self, job: _Job, reason: FinishReason, error: str | None = None, status: int | None = None) -> None:
        if job.uid is not None:
            self._jobs.pop((job.key, job.uid), None)
        if job.sampler is not None:
            job.sampler.close()
        with self._lock:
            self._queued -= 1
        tail = job.stops.feed(job.utf8.flush()) + job.stops.flush() if reason in ("stop", "length") else ""
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted_at
        job.stream.push(FinishEvent(reason, Usage(len(job.request.prompt_tokens), job.generated, job.reused), tail, ttft,
                                    time.perf_counter() - job.submitted_at, error, error_status=status,
                                    error_code=SHUTTING_DOWN if status else None, retry_after_s=SHUTDOWN_RETRY_AFTER_S if status else None))
