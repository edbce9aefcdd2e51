"""The labelled traps the answer cache's error bound is computed from: the near misses shipped with
the appliance (appliance/data/cache_traps.jsonl, written from the blind-written pair sets by
`python -m bench.cache_traps`), those an operator labels, and the false hits a tenant's callers reported.

Each trap is scored as a lookup would score it (policy/answer_cache.py: pair_score) and filed under
the language of its asked question, so a language's cut comes from its own traps only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources

from policy.answer_bound import Cut, cut_for
from policy.answer_cache import CachePolicy, pair_score
from policy.answer_guards import Lexicon, compare
from policy.answer_negation import negation_differs

TRAPS_FILE = "data/cache_traps.jsonl"
# The stored cosine of each shipped trap, by the embedder it was measured with.
BUNDLED_EMBEDDER = "minilm"


@dataclass(frozen=True)
class SeedTrap:
    cached: str
    asked: str
    kind: str
    cosine: float | None  # by the bundled embedder, as shipped


def shipped_traps() -> list[SeedTrap]:
    text = resources.files("appliance").joinpath(TRAPS_FILE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [SeedTrap(r["a"], r["b"], r["kind"], r.get(BUNDLED_EMBEDDER)) for r in rows]


def scored(traps: Iterable[SeedTrap], cosines: Iterable[float], language_of: Callable[[str], str], lexicon: Lexicon,
           policy: CachePolicy) -> dict[str, list[float]]:
    """Each trap's score, by the language of its asked question (blocking: a few hundred ms)."""
    pools: dict[str, list[float]] = {}
    for trap, cosine in zip(traps, cosines, strict=True):
        language = language_of(trap.asked)
        refused = negation_differs(trap.cached, trap.asked, language)  # as a lookup in that language refuses it
        score = -math.inf if refused else pair_score(compare(trap.cached, trap.asked, lexicon), cosine, policy)
        pools.setdefault(language, []).append(score)
    return pools


def shipped_pools(language_of: Callable[[str], str], lexicon: Lexicon, policy: CachePolicy) -> dict[str, list[float]]:
    """The shipped traps scored with the bundled embedder's cosines they carry (blocking)."""
    traps = shipped_traps()
    return scored(traps, [t.cosine or 0.0 for t in traps], language_of, lexicon, policy)


def merge(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for language, scores in more.items():
        into.setdefault(language, []).extend(scores)


SEEDS, EVERYONE = "", "*"  # the keys of the cuts from shipped traps only, and over every tenant's reports


@dataclass(frozen=True)
class Bounds:
    """The cuts in force: shipped traps per language plus each tenant's reported false hits, so one
    tenant's reports tighten its own cache and nobody else's. Computing a cut takes milliseconds, so
    it happens off the event loop (`of`, `with_traps`), and lookups only read `cuts`."""

    bound: float
    seeds: dict[str, list[float]] = field(default_factory=dict)
    reported: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # tenant -> language -> scores
    cuts: dict[tuple[str, str], Cut] = field(default_factory=dict)

    @classmethod
    def of(cls, bound: float, seeds: dict[str, list[float]], reported: dict[str, dict[str, list[float]]]) -> Bounds:
        """Every cut a lookup may need (blocking)."""
        bounds = cls(bound, seeds, reported)
        for language in bounds.languages():
            bounds.cuts[(SEEDS, language)] = cut_for(seeds.get(language, []), bound)
            bounds.cuts[(EVERYONE, language)] = cut_for(seeds.get(language, []) + bounds.all_reported(language), bound)
        for tenant, by_language in reported.items():
            for language, scores in by_language.items():
                bounds.cuts[(tenant, language)] = cut_for(seeds.get(language, []) + scores, bound)
        return bounds

    def cut(self, tenant: str, language: str) -> Cut:
        """Closed (nothing but exact repeats) for a language with no known traps: nothing to promise from."""
        return self.cuts.get((tenant, language)) or self.cuts.get((SEEDS, language)) or Cut(math.inf, 0, 0, self.bound)

    def all_reported(self, language: str) -> list[float]:
        return [s for by_language in self.reported.values() for s in by_language.get(language, [])]

    def with_traps(self, tenant: str, pools: dict[str, list[float]]) -> Bounds:
        """More known traps, by language, for one tenant or ("") everyone: new bounds, every cut
        recomputed (blocking); lookups go on reading the old ones until they are swapped in."""
        seeds = {lang: list(scores) for lang, scores in self.seeds.items()}
        reported = {t: {lang: list(scores) for lang, scores in by.items()} for t, by in self.reported.items()}
        merge(seeds if tenant == "" else reported.setdefault(tenant, {}), pools)
        return Bounds.of(self.bound, seeds, reported)

    def languages(self) -> list[str]:
        return sorted(set(self.seeds) | {lang for by_language in self.reported.values() for lang in by_language})

    def summary(self) -> dict[str, dict[str, object]]:
        """Per language, over the shipped traps and every tenant's reports: what the cache promises
        and its own estimate of the share of near misses it serves."""
        out: dict[str, dict[str, object]] = {}
        for language in self.languages():
            cut = self.cut(EVERYONE, language)
            out[language] = {"traps": cut.traps, "served": cut.served, "estimate": round(cut.estimate, 4), "upper": round(cut.upper, 4),
                             "bound": self.bound, "cut": None if math.isinf(cut.score) else round(cut.score, 4),
                             "open": cut.score < math.inf}
        return out
