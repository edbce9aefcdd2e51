"""The labelled traps the answer cache's error bound is computed from: the near misses shipped with
the appliance (appliance/data/cache_traps.jsonl, written from the blind-written pair sets by
`python -m bench.cache_traps`), those an operator labels, and the false hits a tenant's callers reported.

Each trap is scored as a lookup would score it (policy/answer_cache.py: pair_score) and filed under
the language of its asked question, so a language's cut comes from its own traps only.

Where a judge model is configured, it is asked about every trap in its band (in the background, once
per judge model: cache_judgements), and a language whose traps it has all answered gets two cuts: the
embedder's at half the bound, and the judge's on what that leaves, so that the traps served by
either together stay within the bound. A trap the judge was not asked about counts as served by it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from policy.answer_bound import Cut, cut_for
from policy.answer_cache import CachePolicy, judge_eligible, judge_flagged, judge_score, pair_score
from policy.answer_guards import Lexicon, compare, spelled
from policy.answer_negation import negations_differ

TRAPS_FILE = "data/cache_traps.jsonl"


@dataclass(frozen=True)
class SeedTrap:
    cached: str
    asked: str
    kind: str
    cosine: float | None  # by the embedder asked for, as shipped; None: not shipped for it


def shipped_traps(embedder: str = "minilm") -> list[SeedTrap]:
    """The shipped traps, each with its stored cosine by `embedder` (a name in fleet.embedders.BUNDLED)."""
    text = resources.files("appliance").joinpath(TRAPS_FILE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [SeedTrap(r["a"], r["b"], r["kind"], r.get(embedder)) for r in rows]


@dataclass(frozen=True)
class Known:
    """A known trap as lookups see it: its pair score, whether a judge would be asked about it,
    and the judge's P(same answer) once asked."""

    score: float
    pair: str | None = None  # what the judge's answer is kept under (pair_key); None: not a question for the judge
    judge: float | None = None  # as its cut reads it (policy/answer_cache.py: judge_score)
    flagged: bool = False  # a soft guard flagged the pair, or it switches language: the judge's answer is read more strictly


Pools = dict[str, list[Known]]  # language -> known traps


def pair_texts(pairs: Iterable[tuple[str, str]], lexicon: Lexicon) -> list[str]:
    """The distinct texts a list of question pairs needs embedded, each spelled as the cache spells a
    question before embedding it (in lookups and in stored vectors)."""
    return sorted({spelled(q, lexicon) for pair in pairs for q in pair})


def pair_cosines(pairs: Iterable[tuple[str, str]], lexicon: Lexicon, vectors: Mapping[str, Any]) -> list[float]:
    """Each pair's cosine from the normalised vectors of pair_texts."""
    return [float(vectors[spelled(a, lexicon)] @ vectors[spelled(b, lexicon)]) for a, b in pairs]


def pair_key(cached: str, asked: str) -> str:
    return hashlib.sha256(f"{cached}\x1f{asked}".encode()).hexdigest()[:32]


def scored(traps: Iterable[SeedTrap], cosines: Iterable[float], language_of: Callable[[str], str], lexicon: Lexicon,
           policy: CachePolicy) -> Pools:
    """Each trap's score, by the language of its asked question (blocking: a few hundred ms)."""
    pools: Pools = {}
    for trap, cosine in zip(traps, cosines, strict=True):
        language, cached_language = language_of(trap.asked), language_of(trap.cached)
        comparison = compare(trap.cached, trap.asked, lexicon, count_negators=False)
        # as a lookup refuses it: each question's negators counted in its own language
        refused = negations_differ(trap.cached, cached_language, trap.asked, language)
        score = -math.inf if refused else pair_score(comparison, cosine, policy)
        judged = not refused and judge_eligible(comparison, cosine, policy)
        pools.setdefault(language, []).append(Known(score, pair_key(trap.cached, trap.asked) if judged else None,
                                                    flagged=judge_flagged(comparison, cached_language, language)))
    return pools


def shipped_pools(language_of: Callable[[str], str], lexicon: Lexicon, policy: CachePolicy, embedder: str = "minilm") -> Pools:
    """The shipped traps scored with a bundled embedder's cosines they carry (blocking)."""
    traps = shipped_traps(embedder)
    return scored(traps, [t.cosine or 0.0 for t in traps], language_of, lexicon, policy)


def merge(into: Pools, more: Pools) -> None:
    for language, known in more.items():
        into.setdefault(language, []).extend(known)


def with_judge(pools: Pools, answers: dict[str, float]) -> Pools:
    """The pools with the judge's answers (its P(same answer) by pair) filled in where it has given them,
    each as the judge's cut reads it."""
    return {language: [Known(k.score, k.pair, judge_score(answers[k.pair], k.flagged), k.flagged)
                       if k.pair is not None and k.pair in answers else k for k in known]
            for language, known in pools.items()}


def cuts_for(known: list[Known], bound: float, judging: bool) -> tuple[Cut, Cut | None]:
    """The embedder's cut, and the judge's where one is configured and can serve anything. With the
    judge, the embedder keeps half the bound and the judge's cut is set on every trap either would
    serve (one the embedder admits, or one the judge was not asked about, counts as served), so the
    two together stay within the bound; if the judge's cut would serve nothing, the embedder keeps it all."""
    scores = [k.score for k in known]
    alone = cut_for(scores, bound)
    if not judging:
        return alone, None
    embed = cut_for(scores, bound / 2)
    judge = cut_for([math.inf if embed.admits(k.score) else -math.inf if k.pair is None
                     else math.inf if k.judge is None else k.judge for k in known], bound)
    return (embed, judge) if judge.score < math.inf else (alone, None)


SEEDS, EVERYONE = "", "*"  # the keys of the cuts from shipped traps only, and over every tenant's reports


@dataclass(frozen=True)
class Bounds:
    """The cuts in force: shipped traps per language plus each tenant's reported false hits, so one
    tenant's reports tighten its own cache and nobody else's. Computing a cut takes milliseconds, so
    it happens off the event loop (`of`, `with_traps`), and lookups only read `cuts`. `judging`: a
    judge model is configured, so a language whose traps it answered gets a judge's cut too."""

    bound: float
    seeds: Pools = field(default_factory=dict)
    reported: dict[str, Pools] = field(default_factory=dict)  # tenant -> language -> known traps
    judging: bool = False
    cuts: dict[tuple[str, str], tuple[Cut, Cut | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, bound: float, seeds: Pools, reported: dict[str, Pools], judging: bool = False) -> Bounds:
        """Every cut a lookup may need (blocking)."""
        bounds = cls(bound, seeds, reported, judging)
        for language in bounds.languages():
            bounds.cuts[(SEEDS, language)] = cuts_for(seeds.get(language, []), bound, judging)
            bounds.cuts[(EVERYONE, language)] = cuts_for(seeds.get(language, []) + bounds.all_reported(language), bound, judging)
        for tenant, by_language in reported.items():
            for language, known in by_language.items():
                bounds.cuts[(tenant, language)] = cuts_for(seeds.get(language, []) + known, bound, judging)
        return bounds

    def both(self, tenant: str, language: str) -> tuple[Cut, Cut | None]:
        """The embedder's cut and the judge's (None: the judge is not asked). Closed (nothing but exact
        repeats) for a language with no known traps: nothing to promise from."""
        return self.cuts.get((tenant, language)) or self.cuts.get((SEEDS, language)) or (Cut(math.inf, 0, 0, self.bound), None)

    def cut(self, tenant: str, language: str) -> Cut:
        return self.both(tenant, language)[0]

    def all_reported(self, language: str) -> list[Known]:
        return [k for by_language in self.reported.values() for k in by_language.get(language, [])]

    def with_traps(self, tenant: str, pools: Pools) -> Bounds:
        """More known traps, by language, for one tenant or ("") everyone: new bounds, every cut
        recomputed (blocking); lookups go on reading the old ones until they are swapped in."""
        seeds = {lang: list(known) for lang, known in self.seeds.items()}
        reported = {t: {lang: list(known) for lang, known in by.items()} for t, by in self.reported.items()}
        merge(seeds if tenant == "" else reported.setdefault(tenant, {}), pools)
        return Bounds.of(self.bound, seeds, reported, self.judging)

    def with_judge(self, answers: dict[str, float]) -> Bounds:
        """The judge's answers on known traps filled in, every cut recomputed (blocking)."""
        return Bounds.of(self.bound, with_judge(self.seeds, answers),
                         {t: with_judge(by, answers) for t, by in self.reported.items()}, self.judging)

    def to_judge(self) -> list[str]:
        """The pairs the judge has yet to answer (their keys), once each: the language with the fewest
        first, since a language's judge cut opens only once all of its are answered."""
        by_language: dict[str, set[str]] = {}
        for language in self.languages():
            for k in self.seeds.get(language, []) + self.all_reported(language):
                if k.pair is not None and k.judge is None:
                    by_language.setdefault(language, set()).add(k.pair)
        order: list[str] = []
        for _, pairs in sorted(by_language.items(), key=lambda item: (len(item[1]), item[0])):
            order += sorted(pairs - set(order))
        return order

    def languages(self) -> list[str]:
        return sorted(set(self.seeds) | {lang for by_language in self.reported.values() for lang in by_language})

    def summary(self) -> dict[str, dict[str, object]]:
        """Per language, over the shipped traps and every tenant's reports: what the cache promises
        and its own estimate of the share of near misses it serves (by the embedder and the judge together)."""
        out: dict[str, dict[str, object]] = {}
        for language in self.languages():
            cut, judge = self.both(EVERYONE, language)
            served = judge if judge is not None else cut
            row: dict[str, object] = {
                "traps": served.traps, "served": served.served, "estimate": round(served.estimate, 4), "upper": round(served.upper, 4),
                "bound": self.bound, "cut": None if math.isinf(cut.score) else round(cut.score, 4), "open": cut.score < math.inf}
            if self.judging:
                asked = [k for k in self.seeds.get(language, []) if k.pair is not None]
                row["judge"] = {"cut": None if judge is None else round(judge.score, 4), "traps_asked": sum(k.judge is not None for k in asked),
                                "traps_in_band": len(asked)}
            out[language] = row
        return out
