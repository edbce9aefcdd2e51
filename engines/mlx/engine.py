"""The MLX engine: mlx-lm's continuous batching (BatchGenerator) on the model thread of engines/core.py.

New requests join the running batch at the next step; the core gives each its stop strings,
UTF-8 streaming, logprobs and cancellation, as on llama.cpp. A prompt cache across requests:
every finished sequence's KV is kept (LRU by bytes) in the core's host tier, and a new prompt
starts from the longest shared prefix. Grammars and seeded draws run llama.cpp's own sampler
chain over MLX's logits, through the vocabulary of the GGUF the folder was converted from.
LoRA adapters switch per step; a draft model decodes a request speculatively when it would
otherwise decode alone.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.core import AdapterKey, Job, LocalEngine
from engines.interface import Capabilities, EngineError, EngineEvent, FinishReason, GenerationRequest, PrefixKey
from engines.mlx.lora import AdapterSet, LoraWeights, read_adapter
from engines.mlx.vocabulary import MlxVocabulary
from engines.speculation import Acceptance, StepCost, draft_length
from engines.vocabulary import SpeaksVocabulary

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


class _BatchJob(Job):
    """A request in a BatchGenerator (uid), or decoding speculatively on its own (lane)."""

    def __init__(self, request: GenerationRequest, sampler: Any, emit: Callable[[EngineEvent], None]) -> None:
        super().__init__(request, sampler, emit)  # sampler: llama.cpp's chain over this job's logits (grammar, seed), or None
        self.uid: int | None = None
        self.generator: Any = None  # the BatchGenerator of its adapter set, once admitted
        self.lane: Any = None  # mlx-lm's speculative generator, when the job decodes speculatively
        self.lane_k = 0  # its drafted tokens per verification
        self.lane_run = 0  # drafted tokens accepted since its last verification


class MlxEngine(SpeaksVocabulary, LocalEngine):
    name = "mlx"

    def __init__(self, config: MlxConfig) -> None:
        from mlx_lm.utils import load_model

        super().__init__(slots=config.slots, max_queue=config.max_queue, host_cache_bytes=config.prompt_cache_bytes,
                         thread_name=f"mlx:{config.path.name}")
        self.config = config
        self.capabilities(grammar_vocabulary=config.vocabulary is not None).apply(self)
        self.model, _ = load_model(config.path)
        self.vocabulary = MlxVocabulary(config.path)
        self._grammar_vocabulary = None  # the GGUF's, for llama.cpp's sampler chain
        if config.vocabulary is not None:
            from engines.llamacpp.runtime import Model

            self._grammar_vocabulary = Model(config.vocabulary, vocab_only=True)
        self._eos = set(self.vocabulary.eos)
        self._jobs: dict[tuple[Any, int], _BatchJob] = {}  # (adapter set, uid in its generator) -> job
        self._generators: dict[AdapterKey, Any] = {}  # a BatchGenerator per adapter set with work
        self._lora = AdapterSet(self.model)
        self._draft = None
        self._lane: _BatchJob | None = None  # the request decoding speculatively, alone
        self._acceptance = Acceptance()
        self._step_cost, self._draft_cost = StepCost(()), 0.0
        if config.draft is not None:
            self._draft = self._load_draft(config.draft)
            if not config.draft_fixed_tokens:
                self._step_cost, self._draft_cost = self._measure_speculation(config.draft_max_tokens)
        self._install_adapters(config.adapters)  # before the model thread starts: this thread may touch the model
        self._start_thread()

    # ---- the model's own surface ------------------------------------------------------------------

    @classmethod
    def capabilities(cls, *, grammar_vocabulary: bool) -> Capabilities:
        """What a model of this config serves: grammars need the GGUF vocabulary the folder came from."""
        return Capabilities.of(cls, supports_grammar=grammar_vocabulary)

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def _load_draft(self, folder: Path):  # type: ignore[no-untyped-def]
        """The draft model, refused unless its vocabulary is the target's token for token."""
        import mlx_lm

        draft, tokenizer = mlx_lm.load(str(folder))
        ours, theirs = self.vocabulary.hf.get_vocab(), tokenizer._tokenizer.get_vocab()
        if ours != theirs:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
            raise EngineError(f"the draft model {folder} has another vocabulary than {self.config.path} "
                              f"({len(theirs)} against {len(ours)} tokens; first difference: token {differing[0][1]} {differing[0][0]!r})")
        return draft

    # ---- the core's hooks -------------------------------------------------------------------------

    def _new_job(self, request: GenerationRequest, sampler: Any, emit: Callable[[EngineEvent], None]) -> Job:
        return _BatchJob(request, sampler, emit)

    def _piece(self, token: int, special: bool) -> bytes:
        return self.vocabulary.piece(token)

    def _is_eog(self, token: int) -> bool:
        return token in self._eos

    def _read_adapter(self, path: Path) -> LoraWeights:
        return read_adapter(path)

    def _attach_adapter(self, name: str, prepared: LoraWeights) -> LoraWeights:
        self._lora.load(name, prepared)
        return prepared

    def _detach_adapter(self, name: str, handle: LoraWeights) -> None:
        if self._lora.weights(name) is handle:  # not when a reload put other weights under the name
            self._lora.unload(name)

    def _apply_adapters(self, key: AdapterKey) -> None:
        self._lora.activate(key)

    def _on_thread_end(self) -> None:
        for generator in self._generators.values():
            generator.close()
        self._generators.clear()

    def _free_model(self) -> None:
        if self._grammar_vocabulary is not None:  # its samplers are closed with their jobs
            self._grammar_vocabulary.close()

    @property
    def _speculating(self) -> bool:
        return self._draft is not None

    def _admit(self, waiting: deque[Job]) -> None:
        """Requests with the same adapter set share one BatchGenerator (one batch); the sets take
        turns step by step (the core's `_take_turn`), each step under its own adapters."""
        room = self.config.slots - len(self._running)
        if room > 0 and waiting and self._speculates(waiting[0], alone=len(waiting) == 1):  # type: ignore[arg-type]
            self._start_lane(waiting.popleft())  # type: ignore[arg-type]
            room -= 1
        if room > 0 and waiting:
            admitted: list[_BatchJob] = [waiting.popleft() for _ in range(min(room, len(waiting)))]  # type: ignore[misc]
            for key in sorted({j.key for j in admitted}):
                if key not in self._generators:
                    self._generators[key] = self._generator()
                self._insert(self._generators[key], [j for j in admitted if j.key == key])

    def _step(self) -> None:
        if self._lane is not None:
            self._step_lane()  # takes its turn beside the batch
        if not self._jobs:
            return
        turn = self._take_turn(list(self._jobs.values()))  # type: ignore[arg-type]
        if not turn:
            return
        key = turn[0].key
        _, responses = self._generators[key].next()
        for response in responses:
            job = self._jobs.get((key, response.uid))
            if job is not None:
                self._token(job, response)
        for idle in [k for k in self._generators if k != () and all(j.key != k for j in self._jobs.values())]:
            self._generators.pop(idle).close()  # an adapter set nobody uses now keeps no batch state

    def _release(self, job: Job, reason: FinishReason) -> None:
        assert isinstance(job, _BatchJob)
        if job.lane is not None:
            job.lane.close()
            if self._lane is job:
                self._lane = None
        elif job.uid is not None:
            self._jobs.pop((job.key, job.uid), None)
            if reason in ("cancelled", "error"):  # a finished sequence has already left its batch
                job.generator.remove([job.uid])

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

    def _speculates(self, job: _BatchJob, alone: bool) -> bool:
        """A request decodes speculatively when it would otherwise decode alone: mlx-lm's
        speculative step serves one sequence, and a batch already keeps the cores busy. Grammars
        (the sampler would see drafted tokens) and adapters (the draft has none) stay batched."""
        return (self._draft is not None and self._lane is None and alone and not self._jobs
                and job.sampler is None and job.adjuster is None and job.key == () and self._lane_tokens() > 0)

    def _start_lane(self, job: _BatchJob) -> None:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step

        self._started(job)
        job.first_step_at = time.perf_counter()
        self.prefix_stats.prompt_tokens += len(job.request.prompt_tokens)
        job.lane_k = self._lane_tokens()
        job.lane = speculative_generate_step(mx.array(job.request.prompt_tokens), self.model, self._draft,
                                             num_draft_tokens=job.lane_k, max_tokens=job.request.max_tokens,
                                             sampler=self._sampler(job))
        self._lane = job

    def _step_lane(self) -> None:
        job = self._lane
        assert job is not None
        self._use_adapters(())  # the draft has no adapters, and the target must match it
        try:
            token, logprobs, drafted = next(job.lane)
        except StopIteration:
            self._end(job, "length")
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
        reason = self._deliver(job, token, lambda: _float64(logprobs))
        if reason is not None:
            self._end(job, reason)

    def _generator(self):  # type: ignore[no-untyped-def]
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(self.model, completion_batch_size=self.config.slots, prefill_batch_size=self.config.slots,
                              stop_tokens=[[t] for t in self._eos])

    def _insert(self, generator, jobs: list[_BatchJob]) -> None:  # type: ignore[no-untyped-def]
        starts = [self._cached_prefix(j) for j in jobs]
        uids = generator.insert([list(j.request.prompt_tokens[j.reused:]) for j in jobs],
                                max_tokens=[j.request.max_tokens for j in jobs],
                                caches=[cache for cache, _ in starts], all_tokens=[done for _, done in starts],
                                samplers=[self._sampler(j) for j in jobs])
        now = time.perf_counter()
        for job, uid in zip(jobs, uids):
            self._started(job)
            job.first_step_at = now  # the generator prefills it at its next step
            job.uid, job.generator = uid, generator
            self._jobs[(job.key, uid)] = job

    # ---- the prompt cache ----------------------------------------------------------------------

    def _cached_prefix(self, job: _BatchJob) -> tuple[list[Any] | None, list[int]]:
        """A copy of the KV of the longest cached prefix of the job's prompt, trimmed to it (at
        least one prompt token is left to compute, for logits), and the tokens it covers."""
        prompt = job.request.prompt_tokens
        self.prefix_stats.prompt_tokens += len(prompt)
        if not self.config.prompt_cache_bytes:
            return None, []
        shared = self._index.match(job.prefix_key, prompt)
        if not shared:
            return None, []
        holder, length = max(shared.items(), key=lambda kv: kv[1])
        ident = holder[1]  # type: ignore[index]
        cache = self._host.get(ident)
        length = min(length, len(prompt) - 1, cache[0].offset)
        if length < self.config.prompt_cache_min_tokens:
            return None, []
        start = copy.deepcopy(cache)  # the stored entry stays whole for the next request
        for layer in start:
            layer.trim(layer.offset - length)
        job.reused = length
        self.prefix_stats.reused_from_host += length
        return start, list(prompt[:length])

    def _keep(self, key: PrefixKey, cache: list[Any] | None, tokens: list[int] | None) -> None:
        if not self.config.prompt_cache_bytes or not cache or not tokens:
            return
        length = min(cache[0].offset, len(tokens))
        if length < self.config.prompt_cache_min_tokens:
            return
        self._host.put(key, tuple(tokens[:length]), cache, sum(layer.nbytes for layer in cache))

    def _make_sampler(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
        """llama.cpp's chain for requests that need it: a grammar, or a draw (for its seed). Greedy
        requests without a grammar stay on MLX's own argmax, which keeps the step pipelined."""
        s = request.sampling
        if self._grammar_vocabulary is None or (s.grammar is None and s.temperature <= 0.0):
            return None
        from engines.llamacpp.runtime import Sampler

        return Sampler(self._grammar_vocabulary, temperature=s.temperature, top_p=s.top_p, seed=s.seed, grammar=s.grammar,
                       top_k=s.top_k)

    def _sampler(self, job: _BatchJob):  # type: ignore[no-untyped-def]
        import mlx.core as mx
        import numpy as np
        from mlx_lm.sample_utils import make_sampler

        if job.sampler is not None:
            chain = job.sampler
            draw = lambda logprobs: mx.array([chain.pick(np.array(logprobs.astype(mx.float32)))], dtype=mx.uint32)  # noqa: E731
        else:
            s = job.request.sampling
            draw = make_sampler(temp=max(s.temperature, 0.0), top_p=s.top_p if 0 < s.top_p < 1 else 0.0, top_k=max(s.top_k, 0))
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

    def _token(self, job: _BatchJob, response) -> None:  # type: ignore[no-untyped-def]
        reason = self._deliver(job, int(response.token), lambda: _float64(response.logprobs))
        if reason is None and response.finish_reason is not None:
            reason = "length" if response.finish_reason == "length" else "stop"
        if reason is None:
            return
        if response.finish_reason is not None:  # the generator let it go with its cache
            self._keep(job.prefix_key, response.prompt_cache, response.all_tokens)
        else:  # a stop string: take it out of the batch, cache and all
            kept = job.generator.remove([job.uid], return_prompt_caches=True).get(job.uid)
            if kept:
                self._keep(job.prefix_key, *kept)
        self._end(job, reason)


def _float64(logprobs):  # type: ignore[no-untyped-def]
    """An MLX row of log-probabilities as numpy float64, as the core's logprobs take it."""
    import mlx.core as mx
    import numpy as np

    return np.array(logprobs.astype(mx.float32), dtype=np.float64)
