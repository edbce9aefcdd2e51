"""Semantic cache decisions, pure: what may be cached, which bucket a request belongs to, when a
stored question answers a new one, and when a near-miss must not.

A wrong cached answer is worse than a model call, so every rule here errs towards a miss.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from dataclasses import dataclass

from policy.answer_bound import Cut
from policy.answer_guards import NO_LEXICON, Comparison, Lexicon, compare
from policy.answer_negation import negations_differ
from policy.budgets import Price

# verified: by a caller's feedback, a validator or an operator, never by the cache itself; consistent: a
# sweep asked again and the model agreed with itself (consistency, not correctness).
STATES = ("unverified", "consistent", "verified", "rejected", "stale")
SERVED = ("unverified", "consistent", "verified")


@dataclass(frozen=True)
class CachePolicy:
    enabled: bool = True
    # At or above: a hit, if the guards agree. In [judge_band, threshold): ask the judge.
    similarity_threshold: float = 0.70
    # A pair whose content words all match (after spelling, inflection and stop words) needs this much
    # less: tuned on the labelled pairs' tune half (bench/cache_quality.py).
    same_words_relief: float = 0.06
    judge_band: float = 0.70
    judge_min_probability: float = 0.85
    freshness_s: float = 7 * 86400
    serve_unverified: bool = True
    # Requests sampled hotter than this are not cached: their answers are meant to vary.
    max_temperature: float = 0.3
    # A request that sets no temperature asks for the server's usual answer, not for variety: cacheable.
    cache_unset_temperature: bool = True
    max_entries_per_tenant: int = 10_000
    # At most this share of near misses served, with 95% confidence over the known ones (policy/answer_bound.py);
    # 0: no bound, the thresholds and the judge band alone decide.
    max_false_hit_rate: float = 0.02


@dataclass(frozen=True)
class Bucket:
    """Entries are only ever compared within one bucket: never across tenants, roles, models
    (a new model file is a new version) or prompt versions."""

    tenant: str
    role: str
    model: str
    model_version: str
    prompt_version: str

    @property
    def key(self) -> str:
        raw = "\x1f".join((self.tenant, self.role, self.model, self.model_version, self.prompt_version))
        return hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Cacheable:
    bucket: Bucket
    question: str
    question_hash: str


@dataclass(frozen=True)
class NotCacheable:
    reason: str


def normalise(text: str) -> str:
    """Case, Unicode width, whitespace and trailing punctuation do not change a question."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = re.sub(r"\s+", " ", text).strip()
    return text.rstrip(" ?!.。？！")


def question_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode()).hexdigest()


def prompt_version(context: object) -> str:
    """A digest of everything besides the last user turn that changes the answer."""
    return hashlib.sha256(json.dumps(context, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()[:32]


def classify(
    *, tenant: str, role: str, model: str, model_version: str, messages: list[dict[str, object]], settings: dict[str, object],
    temperature: float | None, n: int, wants_logprobs: bool, has_tools: bool, policy: CachePolicy,
) -> Cacheable | NotCacheable:
    """Whether a chat request may use the cache, and its bucket. `messages` are plain dicts
    (role, content as text); `settings` are the answer-changing request settings; `temperature` is
    None when the request sets none and the policy caches such requests."""
    if not policy.enabled:
        return NotCacheable("disabled")
    if n != 1:
        return NotCacheable("n")
    if temperature is not None and temperature > policy.max_temperature:
        return NotCacheable("temperature")
    if wants_logprobs:
        return NotCacheable("logprobs")
    if has_tools:
        return NotCacheable("tools")
    if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), str):
        return NotCacheable("last turn is not a text user message")
    question = str(messages[-1]["content"])
    if not normalise(question):
        return NotCacheable("empty question")
    context = {"messages": messages[:-1], "settings": settings}
    bucket = Bucket(tenant, role, model, model_version, prompt_version(context))
    return Cacheable(bucket, question, question_hash(question))


@dataclass(frozen=True)
class Candidate:
    entry_id: int
    question: str
    similarity: float
    state: str
    created_at: float
    language: str | None = None  # the stored question's, where a bound is in force
    cost_nanos: int = 0  # what the stored answer's model call cost: what a hit on it saves


@dataclass(frozen=True)
class Hit:
    entry_id: int
    similarity: float
    judged: bool
    score: float | None = None  # the pair's score, where an error bound admitted it (or sent it to the judge)
    judge: float | None = None  # the judge's P(same answer), where a judge admitted it


@dataclass(frozen=True)
class AskJudge:
    candidate: Candidate
    score: float | None = None  # its pair score, where an error bound is in force
    flagged: bool = False  # judge_flagged: the judge's answer is read more strictly (judge_score)


@dataclass(frozen=True)
class Miss:
    reason: str


def servable(state: str, created_at: float, now: float, policy: CachePolicy) -> bool:
    if state == "verified" or (state in ("unverified", "consistent") and policy.serve_unverified):
        return now - created_at <= policy.freshness_s
    return False


def threshold_for(comparison: Comparison, policy: CachePolicy) -> float:
    return policy.similarity_threshold - (0.0 if comparison.differs else policy.same_words_relief)


def pair_score(comparison: Comparison, similarity: float, policy: CachePolicy) -> float:
    """How safe serving one question's answer to the other is, for the error bound to cut: -inf for
    a pair a guard flags or below its threshold; pairs whose content words all match rank above
    every pair that differs in one (a slip of the keys is not a near miss; a changed word may be)."""
    if comparison.guard is not None or similarity < threshold_for(comparison, policy):
        return -math.inf
    return similarity + (0.0 if comparison.differs else 1.0)


# Guards a judge may overrule under an error bound, on a stricter reading of its answer: they read names,
# abbreviations and reworded verbs through English word lists, and refuse many true rewordings in other
# languages ("CNH" / "carteira de motorista"). Negations, numbers and dates stay hard: no judge overrules them.
SOFT_GUARDS = frozenset({"entity", "swap", "scope"})
# How much surer the judge must be where a soft guard flagged the pair, in log-odds (tuned on the tuning
# pair sets: docs/performance/cache.md).
FLAGGED_LOG_ODDS = 1.0
# The judge's prompt without the two questions (answer_cache/service.py: ask_judge, in the chat template of
# a Qwen or SmolLM model): 60 tokens, measured. What a judge call costs is priced from it (judge_call_cost).
JUDGE_PROMPT_TOKENS = 60
FREE = Price(0, 0)


def judge_eligible(comparison: Comparison, similarity: float, policy: CachePolicy) -> bool:
    """A pair the judge may be asked about: in the judge band or above, and no guard flags it but a soft one."""
    return (comparison.guard is None or comparison.guard in SOFT_GUARDS) and similarity >= policy.judge_band


def judge_flagged(comparison: Comparison, cached_language: str | None, asked_language: str | None) -> bool:
    """Where the judge's answer is read more strictly: a soft guard flagged the pair, or the two questions
    are in different languages (the judge tells a near miss from a rewording less well across a switch,
    and the known traps are mostly of one language)."""
    crossed = cached_language is not None and asked_language is not None and cached_language != asked_language
    return comparison.guard is not None or crossed


def judge_score(probability: float, flagged: bool) -> float:
    """The judge's P(same answer) as its cut reads it: on a pair a soft guard flagged, discounted by
    FLAGGED_LOG_ODDS. The same function scores the known traps and the lookups, so one cut holds both."""
    if not flagged:
        return probability
    p = min(max(probability, 1e-12), 1 - 1e-12)
    return 1.0 / (1.0 + math.exp(FLAGGED_LOG_ODDS - math.log(p / (1 - p))))


def judge_call_cost(price: Price, cached: str, asked: str) -> int:
    """What asking the judge about two questions costs, in nano-dollars, before it is asked: its fixed
    prompt plus both questions at about four characters a token, and its one-token answer."""
    return price.cost(JUDGE_PROMPT_TOKENS + (len(cached) + len(asked)) // 4, 1)


def judge_candidates(asked: str, candidates: list[Candidate], now: float, policy: CachePolicy,
                     lexicon: Lexicon = NO_LEXICON, cut: Cut | None = None, language: str | None = None,
                     judge_cut: Cut | None = None, judge_price: Price = FREE) -> Hit | AskJudge | Miss:
    """Nearest first: the first servable candidate at or above its threshold that no guard flags is
    a hit; failing that, the first one in the judge band goes to the judge. Under an error bound
    (`cut`) a hit also needs a score the cut admits, and the judge is asked only where it has a cut
    of its own (`judge_cut`, from its answers on the same labelled traps: answer_cache/calibration.py).
    `language`, where known, has each question's negators counted in its own language (the
    candidate's language on it) in place of the English guards' count. A judge call that would cost more
    than the stored answer it could save (`judge_price`) is never asked: the lookup misses instead."""
    reason = "no candidate"
    dearer = False  # a candidate went without the judge because asking costs more than its answer
    band: Candidate | None = None
    band_score = -math.inf
    band_flagged = False
    judging = cut is not None and judge_cut is not None and judge_cut.score < math.inf
    floor = min(policy.judge_band, policy.similarity_threshold - policy.same_words_relief)
    for c in sorted(candidates, key=lambda c: -c.similarity):
        if c.similarity < floor:
            reason = reason if reason != "no candidate" else "similarity"
            break
        if not servable(c.state, c.created_at, now, policy):
            reason = "stale" if c.state in SERVED else c.state
            continue
        comparison = compare(c.question, asked, lexicon, count_negators=language is None)
        if comparison.guard is not None and not (judging and comparison.guard in SOFT_GUARDS):
            reason = f"guard:{comparison.guard}"
            continue
        if language is not None and negations_differ(c.question, c.language or language, asked, language):
            reason = "guard:negation"
            continue
        if cut is not None:
            score = pair_score(comparison, c.similarity, policy)
            if score > -math.inf and cut.admits(score):
                return Hit(c.entry_id, c.similarity, judged=False, score=score)
            if band is None and judging and judge_eligible(comparison, c.similarity, policy):
                if c.cost_nanos >= judge_call_cost(judge_price, c.question, asked):
                    band, band_score, band_flagged = c, score, judge_flagged(comparison, c.language or language, language)
                else:
                    dearer = True
            if comparison.guard is not None:
                reason = f"guard:{comparison.guard}"
                continue
            if score > -math.inf:
                reason = "bound"  # a candidate only the bound refused says more than one below its threshold
            elif reason == "no candidate":
                reason = "similarity"
            continue
        if c.similarity >= threshold_for(comparison, policy):
            return Hit(c.entry_id, c.similarity, judged=False)
        if band is None and c.similarity >= policy.judge_band:
            if c.cost_nanos >= judge_call_cost(judge_price, c.question, asked):
                band = c
            else:
                dearer = True
        if reason == "no candidate":
            reason = "similarity"
    if band is not None:
        return AskJudge(band, band_score if cut is not None else None, band_flagged)
    return Miss("judge:dearer" if dearer else reason)
