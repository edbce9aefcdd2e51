"""Distillation's collect step as decisions: which kept answers become training examples, and on
which side of the split. Pure: rows in, examples and counts out (the IO is appliance/distill/export.py).

An example must be verified (feedback said good, a validator passed it, or the route's frontier
tier produced it and nobody rejected it), of a tenant that opted in, free of personal data, the
only one for its prompt, and it lands in training or the held-out part by its prompt's hash.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass

from policy.guardrails import find_pii

Turn = tuple[str, str]  # (role, content)

# Verdicts, strongest first: a duplicate prompt keeps the answer with the strongest one.
VERDICTS = ("feedback", "admin", "validator", "frontier")


@dataclass(frozen=True)
class Kept:
    """A kept answer as stored (appliance/store/kept_answers.py), with the cache's verdict on it."""

    response_id: str
    tenant: str
    route: str | None  # the routed alias asked; None when the request named a model
    model: str
    family: str | None
    messages: tuple[Turn, ...]
    answer: str
    finish_reason: str
    created_at: float
    validator: str | None = None  # a validator it passed on its way out
    rating: str | None = None  # the caller's feedback on this response: good, bad
    cache_state: str | None = None  # its semantic-cache entry's state, when the cache holds it
    cache_reason: str | None = None  # why the entry has that state: feedback:good, admin, sweep:agreed, ...


@dataclass(frozen=True)
class Wanted:
    """What an export asks for."""

    route: str
    tiers: tuple[str, ...]  # the route's tiers, cheapest first: the last is its frontier
    tenants: frozenset[str]  # opted in, as the config says now
    family: str | None = None  # None: every family
    held_out: float = 0.1  # the share of prompts held out
    seed: int = 0  # another seed, another split (each still deterministic)


@dataclass(frozen=True)
class Example:
    messages: tuple[Turn, ...]  # the prompt
    answer: str
    verified: str  # one of VERDICTS
    tenant: str
    response_id: str
    created_at: float

    def record(self) -> dict[str, list[dict[str, str]]]:
        """The chat-format training line: the prompt's turns, then the answer."""
        return {"messages": [{"role": r, "content": c} for r, c in self.messages] + [{"role": "assistant", "content": self.answer}]}


@dataclass(frozen=True)
class Counts:
    found: int = 0  # kept answers of the route (and family) in the window
    verified: int = 0
    opted_in: int = 0  # of those, from tenants opted in now
    personal_data: int = 0  # dropped: a detector fired
    duplicates: int = 0  # dropped: another answer to the same prompt was kept
    train: int = 0
    held_out: int = 0


@dataclass(frozen=True)
class Selection:
    train: tuple[Example, ...]
    held_out: tuple[Example, ...]
    counts: Counts


def of_route(kept: Kept, wanted: Wanted) -> bool:
    """A routed answer of this route, or one a request got by naming one of its tiers."""
    if kept.route is not None:
        return kept.route == wanted.route
    return kept.model in wanted.tiers


def verdict(kept: Kept, frontier: str) -> str | None:
    """How the answer was verified, or None. A rejection anywhere (the caller's feedback, the cache
    entry's) outweighs everything; a sweep's agreement is the model agreeing with itself, no proof."""
    if kept.rating == "bad" or kept.cache_state == "rejected":
        return None
    if kept.rating == "good" or (kept.cache_state == "verified" and kept.cache_reason == "feedback:good"):
        return "feedback"
    if kept.cache_state == "verified" and kept.cache_reason == "admin":
        return "admin"
    if kept.validator is not None:
        return "validator"
    # A frontier answer cut at max_tokens is no answer to learn from.
    if kept.model == frontier and kept.finish_reason == "stop":
        return "frontier"
    return None


def personal_data(kept: Kept) -> tuple[str, ...]:
    """The kinds of personal data the guardrails' detectors find in the prompt or the answer."""
    texts = [c for _, c in kept.messages] + [kept.answer]
    return tuple(sorted({f.kind for text in texts for f in find_pii(text)}))


def prompt_key(messages: tuple[Turn, ...]) -> str:
    """Identifies a prompt: the same turns, whatever tenant or time they came at."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def is_held_out(key: str, share: float, seed: int) -> bool:
    """The prompt's side, from its hash alone: the same prompt lands on the same side every time."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def _strength(example: Example) -> tuple[int, float, str]:
    return (VERDICTS.index(example.verified), -example.created_at, example.response_id)


def select(rows: list[Kept], wanted: Wanted) -> Selection:
    """Kept answers to training examples: route and family, verified, opted in, personal data, one
    per prompt (the strongest verdict, then the newest), then the split."""
    frontier = wanted.tiers[-1]
    found = [k for k in rows if of_route(k, wanted) and (wanted.family is None or k.family == wanted.family)]
    verified = [(k, v) for k in found if (v := verdict(k, frontier)) is not None]
    opted_in = [(k, v) for k, v in verified if k.tenant in wanted.tenants]
    clean = [Example(k.messages, k.answer, v, k.tenant, k.response_id, k.created_at) for k, v in opted_in if not personal_data(k)]
    best: dict[str, Example] = {}
    for example in clean:
        key = prompt_key(example.messages)
        if key not in best or _strength(example) < _strength(best[key]):
            best[key] = example
    chosen = sorted(best.items(), key=lambda item: (item[1].created_at, item[1].response_id))
    held = tuple(e for key, e in chosen if is_held_out(key, wanted.held_out, wanted.seed))
    train = tuple(e for key, e in chosen if not is_held_out(key, wanted.held_out, wanted.seed))
    counts = Counts(len(found), len(verified), len(opted_in), len(opted_in) - len(clean), len(clean) - len(best), len(train), len(held))
    return Selection(train, held, counts)


# --- evaluate: is the adapter good enough to serve? --------------------------------------------

def _words(text: str) -> str:
    return " ".join(re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold()))


def agrees(reference: str, text: str) -> bool:
    """A held-out answer is right when it says what the verified answer says: the same JSON value
    when the verified answer is JSON, else the same words (case, spacing and punctuation aside)."""
    try:
        expected = json.loads(reference)
    except ValueError:
        return _words(reference) == _words(text) and bool(_words(text))
    if not isinstance(expected, (dict, list)):
        return _words(reference) == _words(text)
    try:
        return bool(json.loads(text.strip().removeprefix("```json").removeprefix("```").removesuffix("```")) == expected)
    except ValueError:
        return False


@dataclass(frozen=True)
class Score:
    asked: int = 0
    right: int = 0

    @property
    def accuracy(self) -> float:
        return self.right / self.asked if self.asked else 0.0

    def __add__(self, other: Score) -> Score:
        return Score(self.asked + other.asked, self.right + other.right)


@dataclass(frozen=True)
class Promotion:
    promote: bool
    reason: str


def promotion(student: Score, adapter: Score, teacher: Score, margin: float) -> Promotion:
    """The adapter serves only if it beats the student alone and comes within `margin` (a share of
    the teacher's accuracy) of the teacher, on the same questions."""
    if adapter.asked == 0:
        return Promotion(False, "no held-out question was asked")
    if adapter.accuracy <= student.accuracy:
        return Promotion(False, f"the adapter ({adapter.accuracy:.1%}) does not beat the student alone ({student.accuracy:.1%})")
    floor = (1 - margin) * teacher.accuracy
    if adapter.accuracy < floor:
        return Promotion(False, f"the adapter ({adapter.accuracy:.1%}) is below {1 - margin:.0%} of the teacher's {teacher.accuracy:.1%}")
    return Promotion(True, f"the adapter ({adapter.accuracy:.1%}) beats the student alone ({student.accuracy:.1%}) "
                           f"and reaches {adapter.accuracy / teacher.accuracy if teacher.accuracy else 1:.0%} of the teacher's {teacher.accuracy:.1%}")


def promoted_tiers(tiers: tuple[str, ...], student: str, adapter: str) -> tuple[str, ...]:
    """The route's tiers with the distilled tier just above its student (the same price, better on
    what it was taught), or where the student would be when the route does not run the student."""
    tier = f"{student}:{adapter}"
    if tier in tiers:
        return tiers
    at = tiers.index(student) + 1 if student in tiers else 0
    return (*tiers[:at], tier, *tiers[at:])
