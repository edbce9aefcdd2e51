"""The semantic cache at work: lookups (exact hash, then nearest neighbours in the bucket, guards,
the error bound of the question's language, or the judge for the borderline band where no bound is
set), storing answers, feedback, and the refresh sweeps.

Decisions are in policy/answer_cache.py; entries in appliance/store/answer_entries.py on this module's own store
thread (a nearest-neighbour search must not hold up the budget ledger's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import Gauge

from appliance.answer_cache import calibration
from appliance.answer_cache import language as languages
from appliance.answer_cache.calibration import Bounds, Known
from appliance.config.settings import CacheSettings, ModelSettings, TracingSettings
from appliance.evaluation.judge import yes_probability
from appliance.fleet.embedders import BUNDLED, Embedder, EngineEmbedder
from appliance.fleet.registry import LoadedModel, Registry
from appliance.server.metrics import Metrics
from appliance.server.tracing import Tracing, annotate
from appliance.store.answer_entries import CacheStore, Entry, LabelledTrap
from appliance.store.worker import StoreWorker
from engines.interface import EngineError, FinishEvent, GenerationRequest, SamplingParams
from policy.answer_cache import (
    FREE,
    AskJudge,
    Cacheable,
    CachePolicy,
    Candidate,
    Hit,
    Miss,
    judge_candidates,
    judge_score,
    normalise,
    servable,
)
from policy.answer_guards import NO_LEXICON, Lexicon, lexicon_from_vocab, spelled
from policy.budgets import Price, usd

log = logging.getLogger("appliance.cache")

# A caller's report of a false hit: a known trap the judge can no longer be asked about (its texts are
# not kept); where the judge admitted it, its answer is kept with the hit.
REPORTED = "reported"
# Part of what a judge's answers on known traps are kept under: a new prompt asks anew.
JUDGE_PROMPT_VERSION = "1"
# Answers on known traps kept at a time while they are gathered (each also recomputes the cuts).
_JUDGE_BATCH = 16

@dataclass(frozen=True)
class Lookup:
    entry: Entry | None  # the answer to serve; None on a miss
    similarity: float
    judged: bool
    reason: str
    vector: np.ndarray | None  # the question's embedding, kept for storing after a miss
    judge_tokens: tuple[int, int] = (0, 0)  # (prompt, completion) spent asking the judge
    score: float | None = None  # what the error bound admitted, on a similar hit under one
    language: str | None = None  # the question's, where a bound was looked up
    judge: float | None = None  # the judge's P(same answer), on a hit its cut admitted


def cost_weighted_verified_hit_rate(metrics: Metrics) -> float | None:
    """Saved on verified hits / cost of all cacheable requests, since start; None before any cost."""
    cost = metrics.cache_request_cost_usd._value.get()
    return metrics.cache_saved_usd.labels("verified")._value.get() / cost if cost else None


def model_version(settings: ModelSettings) -> str:
    """What makes an answer this model's: its file (by digest when the config gives one)."""
    return settings.sha256 or str(settings.path or settings.package_file or f"{settings.hf_repo}/{settings.hf_file}")


def policy_of(cache: CacheSettings, threshold: float | None = None) -> CachePolicy:
    return CachePolicy(
        enabled=cache.enabled, similarity_threshold=threshold if threshold is not None else cache.similarity_threshold,
        judge_band=min(cache.judge_band, threshold if threshold is not None else cache.judge_band),
        judge_min_probability=cache.judge_min_probability, freshness_s=cache.freshness_s,
        serve_unverified=cache.serve_unverified, max_temperature=cache.max_temperature,
        cache_unset_temperature=cache.cache_unset_temperature,
        max_entries_per_tenant=cache.max_entries_per_tenant, max_false_hit_rate=cache.max_false_hit_rate,
    )


def bundled_lexicon() -> Lexicon:
    """The MiniLM WordPiece vocabulary's whole words: what the guards take as spelled right."""
    from importlib import resources

    vocab = resources.files("appliance").joinpath("data/all-minilm-l6-v2/vocab.txt")
    return lexicon_from_vocab(vocab.read_text(encoding="utf-8").splitlines())


async def ask_judge(model: LoadedModel, cached: str, asked: str, tenant: str | None = None) -> tuple[float, tuple[int, int]]:
    """P(one answer serves both questions), from a small local chat model, and the tokens spent."""
    return await yes_probability(model, [
        {"role": "system", "content": "You compare two user questions. Answer yes if one answer fully and correctly answers both, otherwise no."},
        {"role": "user", "content": f"Question 1: {cached}\nQuestion 2: {asked}\nDo these two questions have the same answer? Answer yes or no."},
    ], tenant)


class SemanticCache:
    def __init__(self, settings: CacheSettings, db_path: Path, registry: Registry, metrics: Metrics, synchronous: str = "normal",
                 tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing or Tracing(TracingSettings())
        self.policy = policy_of(settings)
        self.registry = registry
        self.metrics = metrics
        self.worker = StoreWorker(db_path, name="cache-store", synchronous=synchronous)
        # Read from the counters at scrape time, as GET /admin/cache computes it; for a window, PromQL:
        # rate(appliance_cache_saved_usd_total{state="verified"}[1h]) / rate(appliance_cache_request_cost_usd_total[1h])
        Gauge("appliance_cache_cost_weighted_verified_hit_rate", "What hits on verified answers saved / the cost of every cacheable "
              "request (misses as charged, hits as the call they replaced), since start; 0 before any", registry=metrics.registry,
              ).set_function(lambda: cost_weighted_verified_hit_rate(metrics) or 0.0)
        self.embedder: Embedder | None = None
        self.lexicon = NO_LEXICON
        self.languages: languages.Languages | None = None
        # Closed until the traps are scored: a cache that cannot count its near misses serves exact repeats only.
        self.bounds = Bounds(self.policy.max_false_hit_rate)
        self._reports = asyncio.Lock()  # one report at a time recomputes the cuts it touches
        self._bound_gauges = (
            Gauge("appliance_cache_false_hit_bound", "[cache] max_false_hit_rate: the share of near misses the cache may serve, "
                  "by language", ["language"], registry=metrics.registry),
            Gauge("appliance_cache_false_hit_estimate", "The cache's own estimate of the share of near misses it serves, by language "
                  "(known traps above the cut in force / known traps: shipped ones and callers' reports)", ["language"],
                  registry=metrics.registry),
            Gauge("appliance_cache_false_hit_upper", "The 95% upper bound of that share (Clopper-Pearson), by language", ["language"],
                  registry=metrics.registry),
        )
        self._sweeper: asyncio.Task[None] | None = None
        self._calibrating: asyncio.Task[None] | None = None
        self._judging: asyncio.Task[None] | None = None
        self._judge_texts: dict[str, tuple[str, str]] = {}  # pair key -> (cached, asked): the known traps the judge may be asked about
        self._store_ready = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.settings.enabled:
            return
        self.lexicon = await asyncio.to_thread(bundled_lexicon)
        if self.settings.embedder in BUNDLED:
            self.embedder = await asyncio.to_thread(BUNDLED[self.settings.embedder])
        else:
            model = self.registry.get(self.settings.embedder)
            assert model is not None  # settings checked the alias
            embedder = EngineEmbedder.of_model(model)
            await embedder.start()
            self.embedder = embedder
        embedder = self.embedder
        await self.worker.run(lambda db: CacheStore(db, embedder.name, embedder.dimension))
        if self.policy.max_false_hit_rate > 0:
            self.languages = await asyncio.to_thread(languages.load)
            if self.settings.embedder in BUNDLED:
                await self._calibrate()  # about a second: the shipped traps carry this embedder's cosines
            else:  # another embedder measures every trap first (minutes on a small model): exact repeats only till then
                self._calibrating = asyncio.get_running_loop().create_task(self._calibrate_logged(), name="cache-calibration")
        self._store_ready = True
        if self.settings.sweep_interval_s > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="cache-sweeper")

    async def close(self) -> None:
        for task in (self._sweeper, self._calibrating, self._judging):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.embedder is not None:
            await asyncio.to_thread(self.embedder.close)
        await asyncio.to_thread(self.worker.close)

    async def _calibrate(self) -> None:
        """Score the shipped traps and those an operator added as lookups will score pairs, per
        language, with callers' reports: the cuts in force. The bundled embedder's cosines ship with
        the traps; another embedder's are measured here once per start (minutes on a small model)."""
        assert self.embedder is not None and self.languages is not None
        traps = await asyncio.to_thread(calibration.shipped_traps, self.settings.embedder)
        if all(t.cosine is not None for t in traps):
            cosines = [t.cosine or 0.0 for t in traps]
        else:
            cosines = await self._cosines([(t.cached, t.asked) for t in traps])
        seeds = await asyncio.to_thread(calibration.scored, traps, cosines, self.languages.of, self.lexicon, self.policy)
        by_tenant: dict[str, calibration.Pools] = {}
        for r in await self.worker.run(lambda db: self._store(db).reported()):
            by_tenant.setdefault(r.tenant, {}).setdefault(r.language, []).append(Known(r.score, REPORTED, r.judge))
        labelled = await self.worker.run(lambda db: self._store(db).labelled_traps())
        for tenant, pools in (await self._scored(labelled)).items():
            calibration.merge(seeds if tenant == "" else by_tenant.setdefault(tenant, {}), pools)
        judge = self._judge()
        if judge is not None:  # the judge's kept answers, before the cuts are computed once
            key = self._judge_key(judge)
            answers = await self.worker.run(lambda db: self._store(db).judgements(key))
            seeds, by_tenant = await asyncio.to_thread(lambda: (calibration.with_judge(seeds, answers), {
                tenant: calibration.with_judge(pools, answers) for tenant, pools in by_tenant.items()}))
        self.bounds = await asyncio.to_thread(Bounds.of, self.policy.max_false_hit_rate, seeds, by_tenant, judge is not None)
        if judge is not None:
            self._ask_judge_about([*traps, *labelled])
        self._publish_bounds()

    def _judge(self) -> LoadedModel | None:
        """The judge model, where one is configured and can be asked (a local chat model)."""
        model = self.registry.get(self.settings.judge_model) if self.settings.judge_model else None
        return model if model is not None and model.template is not None else None

    def _judge_key(self, judge: LoadedModel) -> str:
        return f"{model_version(judge.settings)}#{JUDGE_PROMPT_VERSION}"

    def _ask_judge_about(self, traps: list[Any]) -> None:
        """Known traps (shipped or labelled) whose texts the judge may be asked about; starts the
        asking unless it is under way (it takes up new ones as it goes)."""
        judge = self._judge()
        if judge is None:
            return
        self._judge_texts.update({calibration.pair_key(t.cached, t.asked): (t.cached, t.asked) for t in traps})
        if self._judging is None or self._judging.done():
            self._judging = asyncio.get_running_loop().create_task(self._judge_traps(judge), name="cache-judge-calibration")

    async def _judge_traps(self, judge: LoadedModel) -> None:
        """Ask the judge about each known trap in its band that it has not answered (once per judge
        model, kept in cache_judgements), while no request waits for a model; each batch recomputes
        the cuts, so a language's judge cut opens once its traps are all answered."""
        key = self._judge_key(judge)
        unanswerable: set[str] = set()
        try:
            while pending := [pair for pair in await asyncio.to_thread(self.bounds.to_judge)
                              if pair in self._judge_texts and pair not in unanswerable][:_JUDGE_BATCH]:
                answers: dict[str, float] = {}
                for pair in pending:
                    while not self._idle():
                        await asyncio.sleep(0.5)
                    cached, asked = self._judge_texts[pair]
                    try:
                        answers[pair], _ = await ask_judge(judge, cached, asked)
                    except EngineError as exc:  # too long for the judge's context, say: it stays unanswered (counted as served)
                        unanswerable.add(pair)
                        log.warning("cache: the judge cannot answer a known trap (%s); it counts as served", exc)
                await self.worker.run(lambda db: self._store(db).keep_judgements(key, answers))
                async with self._reports:
                    self.bounds = await asyncio.to_thread(self.bounds.with_judge, answers)
                self._publish_bounds()
            log.info("cache: the judge has answered every known trap in its band")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("cache: could not ask the judge about the known traps; it is asked only where they are answered")

    async def _cosines(self, pairs: list[tuple[str, str]]) -> list[float]:
        assert self.embedder is not None
        texts = calibration.pair_texts(pairs, self.lexicon)
        vectors: dict[str, np.ndarray] = {}
        for start in range(0, len(texts), 32):  # a batch at a time: callers' embeddings go between
            chunk = texts[start:start + 32]
            vectors.update(zip(chunk, await self.embedder.embed(chunk)))
        return calibration.pair_cosines(pairs, self.lexicon, vectors)

    async def _scored(self, labelled: list[LabelledTrap]) -> dict[str, calibration.Pools]:
        """Labelled traps' scores, by tenant ("" for everyone) and language. A trap's cosine is
        measured once per embedder and kept (cache_trap_cosines): a start reads what it can."""
        assert self.languages is not None and self.embedder is not None
        if not labelled:
            return {}
        name = self.embedder.name
        known = await self.worker.run(lambda db: self._store(db).trap_cosines(name))
        missing = [t for t in labelled if t.id not in known]
        measured = dict(zip([t.id for t in missing], await self._cosines([(t.cached, t.asked) for t in missing])))
        fresh = {i: c for i, c in measured.items() if i is not None}
        if fresh:
            await self.worker.run(lambda db: self._store(db).keep_trap_cosines(name, fresh))
        log.info("cache: %d labelled traps scored, %d of them embedded now", len(labelled), len(missing))
        cosines = [known[t.id] if t.id in known else measured[t.id] for t in labelled]
        out: dict[str, calibration.Pools] = {}
        for tenant in {t.tenant for t in labelled}:
            mine = [(calibration.SeedTrap(t.cached, t.asked, "labelled", None), c) for t, c in zip(labelled, cosines) if t.tenant == tenant]
            out[tenant] = await asyncio.to_thread(calibration.scored, [t for t, _ in mine], [c for _, c in mine], self.languages.of,
                                                  self.lexicon, self.policy)
        return out

    async def add_traps(self, labelled: list[LabelledTrap]) -> int:
        """An operator's labelled near misses: stored (the same pair twice is one), scored, and counted
        in the cuts of their language, for everyone or one tenant. Returns how many were new."""
        now = time.time()
        added = await self.worker.run(lambda db: self._store(db).add_traps(labelled, now))
        if added and self.policy.max_false_hit_rate > 0:
            for tenant, pools in (await self._scored(added)).items():
                await self._add_known(tenant, pools)
            self._ask_judge_about(added)
        return len(added)

    async def _calibrate_logged(self) -> None:
        try:
            await self._calibrate()
            log.info("cache: error bounds in force for %d languages", len(self.bounds.languages()))
        except Exception:
            log.exception("cache: could not score the shipped traps; similar questions stay misses")

    def _publish_bounds(self) -> None:
        bound, estimate, upper = self._bound_gauges
        for name, row in self.bounds.summary().items():
            if name not in self.bounds.seeds:  # a language only a tenant's reports name: not shown to whoever reads /metrics
                continue
            bound.labels(name).set(float(row["bound"]))  # type: ignore[arg-type]
            estimate.labels(name).set(float(row["estimate"]))  # type: ignore[arg-type]
            upper.labels(name).set(float(row["upper"]))  # type: ignore[arg-type]

    def _store(self, db: Any) -> CacheStore:
        assert self.embedder is not None
        return CacheStore(db, self.embedder.name, self.embedder.dimension)

    # -- the request path ----------------------------------------------------------------------

    async def lookup(self, item: Cacheable, threshold: float | None = None, span: Any = None) -> Lookup:
        assert self.embedder is not None
        policy = policy_of(self.settings, threshold)
        now = time.time()
        key, qhash = item.bucket.key, item.question_hash
        exact = await self.worker.run(lambda db: self._store(db).exact(key, qhash))
        if exact is not None and servable(exact.state, exact.created_at, now, policy):
            return Lookup(exact, 1.0, False, "exact", None)
        # A slip of the keys ("recieve") is spelled right before embedding, here and so in stored vectors.
        vector = (await self.embedder.embed([spelled(item.question, self.lexicon)]))[0]
        candidates = await self.worker.run(lambda db: self._store(db).nearest(key, vector))
        language, cut, judge_cut = None, None, None
        if policy.max_false_hit_rate > 0 and candidates:
            language, candidates = await asyncio.to_thread(self._languages, item.question, candidates)
            cut, judge_cut = self.bounds.both(item.bucket.tenant, language)
        judge = self._judge()
        decision = judge_candidates(item.question, candidates, now, policy, self.lexicon, cut, language, judge_cut,
                                    Price.of(judge.settings) if judge is not None else FREE)
        judged, judge_tokens = False, (0, 0)
        if isinstance(decision, AskJudge):
            probability, judge_tokens = await self._ask_judge(judge, decision.candidate.question, item.question, span, item.bucket.tenant)
            judged = True
            # Under a bound the judge's own cut decides (set on its answers about the known traps).
            read = judge_score(probability, decision.flagged)
            admitted = judge_cut.admits(read) if judge_cut is not None else probability >= policy.judge_min_probability
            if admitted:
                decision = Hit(decision.candidate.entry_id, decision.candidate.similarity, judged=True, score=decision.score,
                               judge=read if judge_cut is not None else None)
            else:
                decision = Miss(f"judge:{probability:.2f}" + ("/strict" if decision.flagged else ""))
        if isinstance(decision, Hit):
            entry_id = decision.entry_id
            entry = await self.worker.run(lambda db: self._store(db).get(entry_id))
            if entry is not None:
                return Lookup(entry, decision.similarity, decision.judged, "similar", vector, judge_tokens, decision.score, language,
                              decision.judge)
            decision = Miss("gone")
        assert isinstance(decision, Miss)
        best = max((c.similarity for c in candidates), default=0.0)
        return Lookup(None, best, judged, decision.reason, vector, judge_tokens)

    def _languages(self, question: str, candidates: list[Candidate]) -> tuple[str, list[Candidate]]:
        """The question's language, and each candidate's (0.3 ms each)."""
        assert self.languages is not None  # loaded wherever a bound is set
        return self.languages.of(question), [dataclasses.replace(c, language=self.languages.of(c.question)) for c in candidates]

    def record_hit(self, entry: Entry, response_id: str, similarity: float, judged: bool, score: float | None = None,
                   language: str | None = None, judge: float | None = None) -> None:
        now = time.time()
        self.metrics.cache_lookups.labels("hit").inc()
        self.metrics.cache_saved_usd.labels(entry.state).inc(usd(entry.cost_nanos))
        self.metrics.cache_request_cost_usd.inc(usd(entry.cost_nanos))
        self.worker.submit(lambda db: self._store(db).record_hit(entry, response_id, similarity, judged, now, score, language, judge))

    def remember(self, item: Cacheable, vector: np.ndarray | None, answer: str, finish_reason: str, prompt_tokens: int,
                 completion_tokens: int, cost_nanos: int, response_id: str, prompt_text: str = "", max_tokens: int = 0,
                 stop: tuple[str, ...] = (), verified_by: str | None = None) -> None:
        """Store a fresh answer (fire and forget). Validators first: a non-empty answer that ended
        normally. One cut at max_tokens is kept too: max_tokens is part of the bucket, so only a
        request that would have been cut at the same place can get it."""
        if finish_reason not in ("stop", "length") or not answer.strip():
            return
        now, cap = time.time(), self.settings.max_entries_per_tenant

        def write(db: Any) -> None:
            try:
                self._store(db).store(item.bucket, item.question, item.question_hash, vector, answer, finish_reason,
                                      prompt_tokens, completion_tokens, cost_nanos, response_id, now, cap,
                                      prompt_text, max_tokens, json.dumps(list(stop)), verified_by)
            except Exception:
                log.exception("could not store a cache entry")

        self.worker.submit(write)

    def count_miss(self, cost_nanos: int) -> None:
        self.metrics.cache_lookups.labels("miss").inc()
        self.metrics.cache_request_cost_usd.inc(usd(cost_nanos))

    # -- the judge -----------------------------------------------------------------------------

    async def _ask_judge(self, model: LoadedModel | None, cached: str, asked: str, parent: Any = None,
                         tenant: str | None = None) -> tuple[float, tuple[int, int]]:
        """P(the two questions have the same answer), from the judge whose price the decision to ask
        weighed; 0 without one. Traced and costed (the caller settles its tokens) like any other model call."""
        if model is None:
            return 0.0, (0, 0)
        self.metrics.cache_judge_calls.inc()
        with self.tracing.span("cache.judge", parent, model=model.settings.alias) as span:
            probability, tokens = await ask_judge(model, cached, asked, tenant)
            annotate(span, probability=probability, prompt_tokens=tokens[0], completion_tokens=tokens[1])
        return probability, tokens

    # -- correctness over time -----------------------------------------------------------------

    async def feedback(self, response_id: str, rating: str, tenant: str) -> tuple[int, bool] | None:
        now = time.time()
        result = await self.worker.run(lambda db: self._store(db).feedback(response_id, rating, tenant, now))
        if result is not None and rating == "bad" and result[1]:
            self.metrics.cache_false_hits.inc()
            if self.policy.max_false_hit_rate > 0:
                await self._learn_trap(response_id, tenant)
        return result

    async def _learn_trap(self, response_id: str, tenant: str) -> None:
        """A hit the bound admitted was wrong: a known trap of its language, for this tenant's cuts."""
        reported = await self.worker.run(lambda db: self._store(db).newly_reported(response_id, tenant))
        if reported is None:
            return
        await self._add_known(reported.tenant, {reported.language: [Known(reported.score, REPORTED, reported.judge)]})

    async def _add_known(self, tenant: str, pools: calibration.Pools) -> None:
        """More known traps for one tenant or ("") everyone, one change at a time, the cuts computed off the loop."""
        async with self._reports:
            self.bounds = await asyncio.to_thread(self.bounds.with_traps, tenant, pools)
        self._publish_bounds()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                if self._idle():
                    await self.sweep(self.settings.sweep_batch)
            except Exception:
                log.exception("cache sweep failed")

    def _idle(self) -> bool:
        return all(m.engine.stats().slots_busy == 0 and m.engine.stats().queue_depth == 0 for m in self.registry.all())

    async def sweep(self, limit: int) -> dict[str, int]:
        """Retire expired entries and those of models no longer served; re-ask the most valuable
        fresh entries with the cache bypassed and mark the ones whose answer drifted stale."""
        assert self.embedder is not None
        now = time.time()
        versions = {m.settings.alias: model_version(m.settings) for m in self.registry.all()}
        retired = await self.worker.run(lambda db: self._store(db).expire(now, self.settings.freshness_s, versions))
        sample = await self.worker.run(lambda db: self._store(db).sweep_sample(limit, now, self.settings.freshness_s))
        checked = drifted = agreed = 0
        for entry in sample:
            model = self.registry.get(entry.model)
            if model is None or model.template is None or getattr(model.engine, "loaded", True) is False:
                continue  # a sweep never loads a model on demand (nor keeps one loaded past its keep_alive)
            fresh = await self._reask(model, entry)
            if fresh is None:
                continue
            checked += 1
            vectors = await self.embedder.embed([fresh, entry.answer])
            similarity = float(vectors[0] @ vectors[1])
            same = normalise(fresh) == normalise(entry.answer) or similarity >= self.settings.agree_threshold
            outcome = "agreed" if same else "drifted"
            entry_id = entry.id

            def mark(db: Any, outcome: str = outcome, similarity: float = similarity, state: str = entry.state) -> None:
                store = self._store(db)
                # Agreeing with itself is consistency: an entry a caller, validator or operator verified stays verified.
                if outcome != "agreed":
                    store.set_state(entry_id, "stale", f"sweep:{outcome}")
                elif state != "verified":
                    store.set_state(entry_id, "consistent", "sweep:agreed")
                store.record_sweep(entry_id, outcome, similarity, now)

            await self.worker.run(mark)
            agreed += same
            drifted += not same
            self.metrics.cache_sweeps.labels(outcome).inc()
        return {"retired": retired, "checked": checked, "agreed": agreed, "drifted": drifted}

    async def _reask(self, model: LoadedModel, entry: Entry) -> str | None:
        """The stored prompt again, exactly as the model first saw it, greedy, bypassing the cache."""
        if not entry.prompt_text:
            return None
        request_id, max_tokens, stop = f"sweep-{uuid.uuid4().hex}", entry.max_tokens or entry.completion_tokens, tuple(json.loads(entry.stop))
        turns = _turns(entry.prompt_text)
        if model.engine.takes_messages:
            # An upstream model's entry keeps the messages themselves (it templates them there).
            messages = tuple((m["role"], m["content"]) for m in turns or [])
            request = GenerationRequest(request_id, (), max_tokens, SamplingParams(temperature=0.0), stop, messages=messages)
        else:
            if turns is not None:
                tokens = (await model.chat_prompt_async(turns))[1]  # callers' text stays text, as when it was first asked
            else:  # an entry stored before turns were kept: its text, read as it was read then
                tokens = tuple(model.engine.tokenize(entry.prompt_text, add_special=model.engine.add_bos(), parse_special=True))
            request = GenerationRequest(request_id, tokens, max_tokens, SamplingParams(temperature=0.0), stop)
        parts: list[str] = []
        async for event in model.engine.generate(request):
            parts.append(event.text)
            if isinstance(event, FinishEvent):
                break
        return "".join(parts)

    # -- administration ------------------------------------------------------------------------

    async def admin(self, call: Any) -> Any:
        return await self.worker.run(lambda db: call(self._store(db)))

    @property
    def ready(self) -> bool:
        return self._store_ready


def _turns(stored: str) -> list[dict[str, str]] | None:
    """A stored prompt's chat turns, or None for an older entry that kept the rendered text."""
    if not stored.startswith("["):
        return None
    try:
        turns = json.loads(stored)
    except ValueError:
        return None
    ok = isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in turns)
    return turns if ok else None
