"""The router's decisions, pure: what a request needs (features), which tier of a cost-ordered
fleet that calls for (with a confidence), the role's floor and ceiling, and whether an answer
passes the validators that decide an escalation.

Features are measured from what the request needs, never from what it says about itself: a user
message that asks for a bigger model, poses as a system instruction, or is padded to look hard
buys nothing, because none of that moves a feature.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass

import jsonschema
import numpy as np

from policy.guardrails import INJECTION as _INJECTION
from policy.router_knn import Knn, cheapest_within, estimate, feature_vector
from policy.router_text import routing_text

TIER_NAMES = ("small", "mid", "frontier")


@dataclass(frozen=True)
class Features:
    words: int  # distinct words of the user's text, after removing repeats
    code: bool
    math: int  # maths signals: operators between numbers, equations, maths words
    steps: int  # how many steps or parts the request asks for
    structured_output: bool  # a JSON schema or object is required
    turns: int  # earlier conversation turns
    non_ascii_ratio: float
    injection: bool  # text that poses as instructions to the system (recorded; buys nothing)
    word_problem: bool = False  # several stated quantities and a question about a quantity: multi-step arithmetic


@dataclass(frozen=True)
class Decision:
    tier: int  # index into the route's tiers, 0 = smallest
    confidence: float  # 0..1: how sure the heuristics are
    score: float
    reason: str
    by: str = "heuristics"  # or "buckets", "knn" (a calibration decided)


_CODE = re.compile(r"```|\bdef |\bclass |\bfunction\b|\breturn\b|=>|[{};]\s*$|\bimport |#include|\bSELECT\b|\bfn \w+\(", re.MULTILINE)
_MATH_WORDS = re.compile(
    r"\b(solve|equation|integral|derivative|probability|prove|theorem|percent|percentage|average|sum of|product of|"
    r"how many|how much|calculat\w*|compute|total|remainder|ratio|fraction|times as many|per hour|per day)\b", re.IGNORECASE)
_QUANTITY_QUESTION = re.compile(r"\b(how (many|much|long|far|old)|what (is|was) the (total|number|amount|cost|price|difference)|"
                                r"in total|altogether|left over|remain)\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?![\w.])")
_MATH_OPS = re.compile(r"\d\s*[-+*/×÷^=]\s*\d|\d+\s*%|\$\s*\d")
_STEPS = re.compile(r"\b(step[- ]by[- ]step|steps|first\b.*\bthen\b|explain why|compare|analy[sz]e|design|plan|trade-?offs?|"
                    r"pros and cons|in detail|reasoning|derive|justify|evaluate)\b", re.IGNORECASE | re.DOTALL)
_ENUMERATION = re.compile(r"^\s*(\d+[.)]|[-*•])\s+", re.MULTILINE)


def features(messages: list[dict[str, str]], structured_output: bool) -> Features:
    """From the user turns only: the system prompt is the operator's, not the caller's to game."""
    user_text = "\n".join(m.get("content", "") for m in messages if m.get("role") == "user")
    injection = bool(_INJECTION.search(user_text))
    cleaned = routing_text(messages)
    words = len(set(re.findall(r"\w+", cleaned.lower())))
    numbers = len(_NUMBER.findall(cleaned))  # a word problem states several quantities
    math_hits = len(_MATH_OPS.findall(cleaned)) + len(_MATH_WORDS.findall(cleaned)) + (min(3, numbers // 2) if numbers >= 2 else 0)
    steps = len(_STEPS.findall(cleaned)) + min(5, len(_ENUMERATION.findall(cleaned)))
    letters = [c for c in cleaned if c.isalpha()]
    non_ascii = sum(1 for c in letters if ord(c) > 127) / len(letters) if letters else 0.0
    turns = sum(1 for m in messages[:-1] if m.get("role") in ("user", "assistant"))
    word_problem = numbers >= 3 and bool(_QUANTITY_QUESTION.search(cleaned))
    return Features(words, bool(_CODE.search(cleaned)), math_hits, steps, structured_output, turns, non_ascii, injection, word_problem)


def parts(f: Features) -> dict[str, float]:
    """Each heuristic feature's share of the difficulty score, by name (what `appliance eval features`
    weighs against measured outcomes)."""
    return {
        "words": min(1.0, f.words / 120),  # long asks need more model, up to a point (distinct words: padding is flat)
        "code": 0.8 if f.code else 0.0,
        # Any maths signal reaches the middle tier: measured on bench/mixed_set.py's calibration part, the
        # smallest tier answered 6 of 16 short sums and counts, the middle one 13 (docs/performance.md).
        "math": min(1.2, 0.9 + 0.1 * (f.math - 1)) if f.math else 0.0,
        "steps": min(1.0, 0.35 * f.steps),
        "structured_output": 0.3 if f.structured_output else 0.0,
        "word_problem": 0.8 if f.word_problem else 0.0,  # measured: a 0.5B model solves 17% of GSM8K, a 1.5B 57%
        "turns": min(0.4, 0.1 * f.turns),
        "non_ascii": 0.3 if f.non_ascii_ratio > 0.3 else 0.0,
    }


ALL_FEATURES = ("words", "code", "math", "steps", "structured_output", "word_problem", "turns", "non_ascii")
# The features the heuristics score with: those that predicted a better tier on the development data
# (`appliance eval simulate`; tests/test_router_learned.py checks it on what is measured); a feature that
# does not is dropped here.
HEURISTIC_FEATURES = ALL_FEATURES


def score(f: Features, use: tuple[str, ...] = HEURISTIC_FEATURES) -> float:
    """A difficulty score: 0 trivial, ~1 mid, ~2 and more frontier, from the features in `use`."""
    found = parts(f)
    return sum(found[name] for name in use)


def decide(f: Features, tiers: int, mid_at: float = 0.9, frontier_at: float = 1.8, use: tuple[str, ...] = HEURISTIC_FEATURES) -> Decision:
    """Tier from the score; confidence falls near a boundary, where the cheap LLM may be asked."""
    s = score(f, use)
    bounds = [mid_at, frontier_at][: max(0, tiers - 1)]
    tier = sum(1 for b in bounds if s >= b)
    distance = min((abs(s - b) for b in bounds), default=1.0)
    confidence = min(1.0, 0.5 + distance)
    said = [f"score {s:.2f}"]
    if f.code:
        said.append("code")
    if f.math:
        said.append(f"maths x{f.math}")
    if f.steps:
        said.append(f"steps x{f.steps}")
    if f.structured_output:
        said.append("structured output")
    if f.word_problem:
        said.append("word problem")
    return Decision(tier, round(confidence, 3), round(s, 3), ", ".join(said))


def clamp_tier(tier: int, tiers: int, floor: int | None, ceiling: int | None) -> int:
    """A role's floor and ceiling bound the tier (the ceiling wins if they cross)."""
    if floor is not None:
        tier = max(tier, floor)
    if ceiling is not None:
        tier = min(tier, ceiling)
    return max(0, min(tiers - 1, tier))


def split_tier(tier: str) -> tuple[str, str | None]:
    """A route's tier: a chat model's alias, or "<alias>:<adapter>" (the model with that LoRA adapter)."""
    alias, _, adapter = tier.partition(":")
    return alias, adapter or None


def family_rank(tiers: tuple[str, ...], tier: str) -> int | None:
    """Where a family tier stands in its route's chain: its own place, else its base model's (an
    adapter costs what its base does). None when its model is not in the chain."""
    if tier in tiers:
        return tiers.index(tier)
    base = split_tier(tier)[0]
    return next((i for i, t in enumerate(tiers) if split_tier(t)[0] == base), None)


def family_first(family_tiers: tuple[tuple[str, str], ...], tiers: tuple[str, ...], metadata: dict[str, str] | None,
                 floor: int | None, ceiling: int | None) -> str | None:
    """The tier promoted for the family a request's metadata names, tried before the route's own
    choice (an adapter is evaluated on one family, so that family is where it may serve). A role whose
    floor is above its place in the chain (`family_rank`) or whose ceiling is below it skips it, so that
    naming a family buys neither a dearer model nor a cheaper one than the role allows."""
    family = (metadata or {}).get("family")
    tier = dict(family_tiers).get(family) if family is not None else None
    rank = family_rank(tiers, tier) if tier is not None else None
    if tier is None or rank is None or (floor is not None and rank < floor) or (ceiling is not None and rank > ceiling):
        return None
    return tier


# -- validators ---------------------------------------------------------------------------------

_REFUSAL = re.compile(
    r"^\s*(i'?m sorry|i am sorry|sorry,|i cannot|i can't|i can not|i am unable|i'm unable|as an ai|i don't know|"
    r"i do not know|unfortunately, i)", re.IGNORECASE)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # "ok" or why the answer fails
    confidence: float | None = None


def repetition(text: str) -> float:
    """Share of the text taken by its most repeated 4-word sequence: degenerate loops score high."""
    words = text.split()
    if len(words) < 16:
        return 0.0
    grams: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 3):
        gram = tuple(words[i:i + 4])
        grams[gram] = grams.get(gram, 0) + 1
    top = max(grams.values())
    return top * 4 / len(words) if top > 2 else 0.0


def confidence_of(logprobs: list[float]) -> float | None:
    """Geometric-mean token probability of the answer: low when the model was guessing."""
    if not logprobs:
        return None
    return math.exp(sum(logprobs) / len(logprobs))


def validate(text: str, finish_reason: str, logprobs: list[float], schema: dict | None, json_required: bool,
             min_confidence: float, max_repetition: float = 0.5) -> Verdict:
    confidence = confidence_of(logprobs)
    if not text.strip():
        return Verdict(False, "empty", confidence)
    if finish_reason not in ("stop", "length"):
        return Verdict(False, f"finish:{finish_reason}", confidence)
    if _REFUSAL.search(text):
        return Verdict(False, "refusal", confidence)
    if repetition(text) > max_repetition:
        return Verdict(False, "repetition", confidence)
    if json_required or schema is not None:
        if finish_reason == "length":
            return Verdict(False, "json cut off at max_tokens", confidence)
        try:
            value = json.loads(text)
        except ValueError:
            return Verdict(False, "invalid json", confidence)
        except RecursionError:  # a grammar's JSON may nest past Python's limit
            return Verdict(False, "json nested too deep", confidence)
        if schema is not None:
            problem = schema_problem(value, schema)
            if problem:
                return Verdict(False, f"schema: {problem}", confidence)
    if confidence is not None and confidence < min_confidence:
        return Verdict(False, f"low confidence {confidence:.2f}", confidence)
    return Verdict(True, "ok", confidence)


def schema_problem(value: object, schema: dict) -> str | None:
    """The first way `value` breaks the JSON Schema, or None."""
    validator_class = jsonschema.validators.validator_for(schema)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"the schema itself is invalid: {exc.message}"
    error = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(value))
    if error is None:
        return None
    where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"{where}: {error.message}"


# -- calibration: tiers from measured accuracy ----------------------------------------------------

KINDS = ("code", "word_problem", "math", "text")


def buckets(f: Features) -> tuple[str, str]:
    """(fine, coarse) names of the kind of request: the coarse one is the kind alone ("math*"), the fine one adds
    what changes the work (JSON output, length in distinct words, asked-for steps, conversation depth,
    script). "What is 7 + 5?" and a GSM8K problem are both maths; only the fine bucket tells them apart."""
    kind = "code" if f.code else "word_problem" if f.word_problem else "math" if f.math else "text"
    extras = [name for name, present in (("json", f.structured_output), ("short", f.words < 20), ("long", f.words >= 60), ("steps", f.steps >= 2),
                                         ("chat", f.turns >= 2), ("intl", f.non_ascii_ratio > 0.3)) if present]
    return "+".join([kind, *extras]), coarse_bucket(kind)


def coarse_bucket(fine: str) -> str:
    """The kind alone, marked so that a plain fine bucket ("math") never shares its name."""
    return fine.split("+", 1)[0] + "*"


@dataclass(frozen=True)
class Observation:
    """One labelled question answered by one tier alone, from an eval run."""
    bucket: str  # fine bucket
    tier: int
    correct: bool
    cost_nanos: int


@dataclass(frozen=True)
class BucketChoice:
    tier: int
    samples: int  # questions measured in this bucket
    accuracy: tuple[float, ...]  # per tier, smoothed
    cost_nanos: tuple[float, ...]  # mean per answer, per tier


@dataclass(frozen=True)
class Calibration:
    """Per bucket, the cheapest tier that keeps `keep` of the best tier's accuracy there, as measured.
    Keeping that share in every bucket keeps it overall, whatever the workload's mix of buckets.
    With a labelled table (`knn`), each request is compared with the labelled requests most like it
    first; the buckets decide where it has too few near neighbours."""
    tiers: tuple[str, ...]  # the aliases it was measured with, cheapest first
    keep: float
    min_samples: int
    choices: tuple[tuple[str, BucketChoice], ...]  # fine and coarse buckets
    knn: Knn | None = None
    samples: int = 0  # questions measured on every tier
    accuracy: tuple[float, ...] = ()  # per tier, over all of them (as measured, not smoothed)
    cost_nanos: tuple[float, ...] = ()  # mean per answer, per tier
    # The keep the buckets' tiers were chosen at, where the table's threshold was set apart from it
    # (chosen on a development run, which varies the table's alone); None: `keep`.
    bucket_keep: float | None = None

    @property
    def bucket_choice_keep(self) -> float:
        return self.keep if self.bucket_keep is None else self.bucket_keep

    @property
    def method(self) -> str:
        return "knn" if self.knn is not None else "buckets"

    def choice(self, name: str) -> BucketChoice | None:
        """The bucket's choice if it was measured often enough to be used."""
        for key, found in self.choices:
            if key == name:
                return found if found.samples >= self.min_samples else None
        return None

    def measured(self) -> list[str]:
        """The buckets whose tier comes from this calibration rather than the heuristics."""
        return [name for name, _ in self.choices if self.choice(name) is not None]


def calibrate(observations: list[Observation], tiers: tuple[str, ...], keep: float = 0.9, min_samples: int = 4) -> Calibration:
    """Pure: from per-question, per-tier results to a tier per bucket. Accuracy is smoothed (Laplace:
    (right + 1) / (n + 2)), so a tier measured on a handful of questions is neither perfect nor hopeless;
    a bucket no tier answers well goes to the cheapest tier, where the validators may still escalate."""
    grouped: dict[str, list[Observation]] = {}
    for o in observations:
        for key in (o.bucket, coarse_bucket(o.bucket)):
            grouped.setdefault(key, []).append(o)
    choices = []
    for key in sorted(grouped):
        rows = grouped[key]
        accuracy, cost, counts = [], [], []
        for tier in range(len(tiers)):
            mine = [o for o in rows if o.tier == tier]
            counts.append(len(mine))
            accuracy.append(round((sum(o.correct for o in mine) + 1) / (len(mine) + 2), 4))
            cost.append(round(sum(o.cost_nanos for o in mine) / len(mine), 1) if mine else 0.0)
        best = max(accuracy)
        chosen = next(t for t in range(len(tiers)) if accuracy[t] >= keep * best)
        choices.append((key, BucketChoice(chosen, min(counts), tuple(accuracy), tuple(cost))))
    per_tier = [[o for o in observations if o.tier == tier] for tier in range(len(tiers))]
    return Calibration(tuple(tiers), keep, min_samples, tuple(choices), None, min(len(rows) for rows in per_tier),
                       tuple(round(sum(o.correct for o in rows) / len(rows), 4) if rows else 0.0 for rows in per_tier),
                       tuple(round(sum(o.cost_nanos for o in rows) / len(rows), 1) if rows else 0.0 for rows in per_tier))


def extend_buckets(calibration: Calibration, earlier: Calibration) -> Calibration:
    """`calibration` (over a route's tiers, some of them new) with each bucket's figures for the tiers
    `earlier` measured taken from `earlier`, and each bucket's tier chosen again at the keep `earlier`'s
    buckets were chosen at. The earlier file measured its tiers on every question it asked, the extended
    labels only on the questions its table kept; and re-chosen at another keep, a bucket moves between
    tiers the route already had: a tier added to a route would move requests it has nothing to do with."""
    before, keep = dict(earlier.choices), earlier.bucket_choice_keep

    def merged(earlier_values: tuple[float, ...], values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(earlier_values[earlier.tiers.index(t)] if t in earlier.tiers else v for t, v in zip(calibration.tiers, values))

    choices = []
    for name, choice in calibration.choices:
        old = before.get(name)
        if old is None:
            choices.append((name, dataclasses.replace(choice, tier=cheapest_within(choice.accuracy, keep))))
            continue
        accuracy, cost = merged(old.accuracy, choice.accuracy), merged(old.cost_nanos, choice.cost_nanos)
        choices.append((name, BucketChoice(cheapest_within(accuracy, keep), min(old.samples, choice.samples), accuracy, cost)))
    return dataclasses.replace(calibration, choices=tuple(choices), bucket_keep=None if keep == calibration.keep else keep)


def describe(calibration: Calibration | None, tiers: tuple[str, ...]) -> dict[str, object]:
    """What a route decides by, as `/v1/models` shows it: the method, how many labelled questions it
    learned from, the threshold (`keep`) and each tier's measured accuracy."""
    if calibration is None:
        return {"method": "heuristics", "samples": 0, "tiers": list(tiers), "threshold": None, "accuracy": None,
                "calibrated_buckets": [], "heuristic_features": list(HEURISTIC_FEATURES)}
    knn = calibration.knn
    samples, accuracy = (knn.samples, knn.accuracy()) if knn is not None else (calibration.samples, calibration.accuracy)
    return {"method": calibration.method, "samples": samples, "tiers": list(tiers), "threshold": calibration.keep,
            "accuracy": dict(zip(tiers, accuracy)) if accuracy else None, "calibrated_buckets": calibration.measured()}


def decide_calibrated(f: Features, tiers: int, calibration: Calibration | None, vector: np.ndarray | None = None) -> Decision:
    """The labelled requests nearest this one (given its embedding `vector`) when there are enough
    above the similarity floor; else the measured tier for the request's bucket (fine if measured
    often enough, else coarse); else the heuristics. Confidence grows with what was measured, so a
    thinly measured decision may still consult the classifier model."""
    if calibration is not None and calibration.knn is not None and vector is not None and len(calibration.tiers) == tiers:
        knn = calibration.knn
        found = estimate(knn, vector, feature_vector(f))
        if found.neighbours >= knn.settings.min_neighbours and found.nearest is not None:
            tier = cheapest_within(found.accuracy, calibration.keep)
            accuracy = "/".join(f"{a:.2f}" for a in found.accuracy)
            nearest = knn.texts[found.nearest][:60]
            return Decision(tier, round(found.weight / (found.weight + knn.settings.prior), 3), round(score(f), 3),
                            f"knn: {found.neighbours} neighbours (nearest {found.similarity:.2f}: {nearest!r}), "
                            f"P(correct) by tier {accuracy}, keep {calibration.keep}", "knn")
    fine, coarse = buckets(f)
    for name in (fine, coarse):
        found_bucket = calibration.choice(name) if calibration is not None else None
        if found_bucket is not None and found_bucket.tier < tiers:
            assert calibration is not None
            confidence = found_bucket.samples / (found_bucket.samples + calibration.min_samples)
            accuracy = "/".join(f"{a:.2f}" for a in found_bucket.accuracy)
            return Decision(found_bucket.tier, round(confidence, 3), round(score(f), 3),
                            f"calibrated: {name} (n={found_bucket.samples}, accuracy by tier {accuracy})", "buckets")
    return decide(f, tiers)
