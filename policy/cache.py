"""Semantic cache decisions, pure: what may be cached, which bucket a request belongs to, when a
stored question answers a new one, and when a near-miss must not.

A wrong cached answer is worse than a model call, so every rule here errs towards a miss.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

STATES = ("unverified", "verified", "rejected", "stale")


@dataclass(frozen=True)
class CachePolicy:
    enabled: bool = True
    # At or above: a hit, if the guards agree. In [judge_band, threshold): ask the judge.
    similarity_threshold: float = 0.70
    judge_band: float = 0.70
    judge_min_probability: float = 0.85
    freshness_s: float = 7 * 86400
    serve_unverified: bool = True
    # Requests sampled hotter than this are not cached: their answers are meant to vary.
    max_temperature: float = 0.3
    max_entries_per_tenant: int = 10_000


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
    temperature: float, n: int, wants_logprobs: bool, has_tools: bool, policy: CachePolicy,
) -> Cacheable | NotCacheable:
    """Whether a chat request may use the cache, and its bucket. `messages` are plain dicts
    (role, content as text); `settings` are the answer-changing request settings."""
    if not policy.enabled:
        return NotCacheable("disabled")
    if n != 1:
        return NotCacheable("n")
    if temperature > policy.max_temperature:
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


# -- near-miss guards ---------------------------------------------------------------------------

_NUMBER_WORDS = {
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty",
    "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million", "billion", "trillion",
    "half", "quarter", "double", "triple", "dozen", "twice", "thrice",
    "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
}  # not "one", "once", "first", "last": as often a pronoun or an adverb as a number
_DATE_WORDS = {
    "january", "february", "march", "april", "june", "july", "august", "september", "october", "november",
    "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
    "today", "tomorrow", "yesterday", "tonight", "morning", "afternoon", "evening", "night", "weekend", "weekday",
    "summer", "autumn", "winter", "noon", "midnight",
    "next", "previous", "ago", "daily", "weekly", "monthly", "yearly", "annual", "annually", "hourly",
}  # not "may", "fall", "spring", "am", "current": common words first
_NEGATIONS = {
    "not", "no", "never", "without", "cannot", "cant", "none", "nobody", "nothing", "neither", "nor", "nowhere",
    "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont", "wouldnt", "shouldnt", "couldnt",
    "hasnt", "havent", "hadnt", "mustnt", "non", "un", "avoid", "except", "excluding", "lack", "lacking",
    "unable", "disallowed", "forbidden", "prohibited",
}
# Quantifiers are rarely paraphrased away: a pair that differs in one asks about another scope.
_QUANTIFIERS = {"all", "every", "each", "some", "none", "most", "only", "both", "either", "least"}
_SAME_QUANTIFIER = {"every": "all", "each": "all"}  # "all" and "every" ask the same
# Words that turn a question around: one question has one side, the other the opposite side.
_OPPOSITES = [
    ("all", "some"), ("all", "none"), ("some", "none"), ("before", "after"), ("more", "less"), ("more", "fewer"),
    ("most", "least"), ("max", "min"), ("maximum", "minimum"), ("above", "below"), ("over", "under"), ("upper", "lower"),
    ("top", "bottom"), ("inside", "outside"), ("increase", "decrease"), ("raise", "lower"), ("first", "last"),
    ("buy", "sell"), ("buying", "selling"), ("import", "export"), ("send", "receive"), ("sending", "receiving"),
    ("upload", "download"), ("push", "pull"), ("install", "uninstall"), ("enable", "disable"), ("add", "remove"),
    ("add", "delete"), ("insert", "delete"), ("encrypt", "decrypt"), ("encode", "decode"), ("compress", "decompress"),
    ("lock", "unlock"), ("open", "close"), ("start", "stop"), ("subscribe", "unsubscribe"), ("login", "logout"),
    ("deposit", "withdraw"), ("borrow", "lend"), ("win", "lose"), ("gain", "loss"), ("profit", "loss"),
    ("hire", "fire"), ("input", "output"), ("inbound", "outbound"), ("incoming", "outgoing"), ("ascending", "descending"),
    ("asc", "desc"), ("left", "right"), ("north", "south"), ("east", "west"), ("early", "late"), ("earlier", "later"),
    ("earliest", "latest"), ("oldest", "newest"), ("old", "new"), ("young", "old"), ("hot", "cold"), ("warm", "cold"),
    ("wet", "dry"), ("positive", "negative"), ("plus", "minus"), ("male", "female"), ("men", "women"), ("boys", "girls"),
    ("true", "false"), ("public", "private"), ("local", "remote"), ("client", "server"), ("frontend", "backend"),
    ("read", "write"), ("reading", "writing"), ("greater", "smaller"), ("greater", "less"), ("larger", "smaller"),
    ("bigger", "smaller"), ("higher", "lower"), ("better", "worse"), ("best", "worst"), ("faster", "slower"),
    ("fastest", "slowest"), ("cheaper", "expensive"), ("cheapest", "expensive"), ("longer", "shorter"),
    ("longest", "shortest"), ("largest", "smallest"), ("biggest", "smallest"), ("highest", "lowest"),
    ("hottest", "coldest"), ("heaviest", "lightest"), ("strongest", "weakest"), ("richest", "poorest"),
    ("min", "max"), ("uppercase", "lowercase"), ("inner", "outer"), ("join", "leave"), ("accept", "reject"),
    ("allow", "block"), ("allow", "deny"), ("include", "exclude"), ("with", "without"), ("always", "never"),
    ("can", "cannot"), ("safe", "unsafe"), ("legal", "illegal"), ("valid", "invalid"), ("possible", "impossible"),
    ("success", "failure"), ("pros", "cons"), ("advantages", "disadvantages"), ("benefits", "risks"),
    ("cause", "effect"), ("causes", "effects"), ("symptoms", "treatment"), ("sunrise", "sunset"), ("morning", "evening"),
    ("up", "down"), ("in", "out"), ("on", "off"), ("closest", "farthest"), ("nearest", "farthest"), ("near", "far"),
    ("high", "low"), ("within", "after"), ("upgrade", "downgrade"), ("increase", "reduce"), ("compress", "extract"),
    ("zip", "unzip"), ("mount", "unmount"), ("connect", "disconnect"), ("follow", "unfollow"), ("pause", "resume"),
    ("arrival", "departure"), ("arrive", "depart"), ("import", "export"), ("inhale", "exhale"), ("rise", "fall"),
]
_CONNECTORS = {"to", "from", "into", "over", "than", "vs", "versus", "before", "after", "against"}
_NEGATING_PREFIXES = ("non-", "non", "un", "in", "im", "ir", "il", "dis", "anti")
_TECH = {
    "python", "java", "javascript", "typescript", "rust", "go", "golang", "ruby", "php", "perl", "swift", "kotlin",
    "scala", "haskell", "elixir", "erlang", "clojure", "lua", "julia", "matlab", "r", "c", "c++", "c#", "f#", "sql",
    "bash", "zsh", "powershell", "html", "css", "react", "vue", "angular", "svelte", "django", "flask", "fastapi",
    "rails", "spring", "node", "node.js", "deno", "linux", "windows", "macos", "ios", "android", "ubuntu", "debian",
    "docker", "kubernetes", "postgres", "postgresql", "mysql", "sqlite", "mongodb", "redis", "git", "aws", "azure",
    "gcp", "excel", "numpy", "pandas", "pytorch", "tensorflow", "chrome", "firefox", "safari", "iphone", "ipad",
}
_STOP = {
    "a", "an", "the", "is", "are", "was", "were", "be", "been", "do", "does", "did", "i", "you", "we", "my", "your",
    "me", "it", "its", "of", "in", "on", "at", "for", "with", "by", "and", "or", "what", "whats", "which", "who",
    "how", "why", "when", "where", "can", "could", "would", "should", "will", "please", "tell", "explain", "give",
    "show", "this", "that", "there", "here", "as", "if", "so", "about",
}
_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+#.'’\-]*|\d+(?:[.,:/]\d+)*")


@dataclass(frozen=True)
class Guarded:
    """Why two questions that embed close together must still not share an answer."""

    reason: str  # number, date, negation, scope, entity


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(unicodedata.normalize("NFKC", text))


def _plain(token: str) -> str:
    token = token.casefold().replace("’", "'").rstrip(".")
    if token.endswith("'s"):
        token = token[:-2]
    return token.replace("'", "")


def _numbers(tokens: list[str]) -> set[str]:
    found = set()
    for t in tokens:
        p = _plain(t)
        if p[:1].isdigit():
            found.add(p.replace(",", ""))
        elif p in _NUMBER_WORDS:
            found.add(p)
        elif re.fullmatch(r"\d+(st|nd|rd|th|s|k|m|gb|mb|kb|tb|km|kg|g|cm|mm|ml|l|h|x|%)", p):
            found.add(p)
    return found


def _entity_words(tokens: list[str]) -> set[str]:
    """Proper-noun-like tokens: capitalised past the first word, all-caps, tech names, or with
    symbols (C++, node.js)."""
    found = set()
    for i, t in enumerate(tokens):
        p = _plain(t)
        if p in _TECH or any(c in t for c in "+#") or ("." in t.rstrip(".") and not t[0].isdigit()):
            found.add(p)
        elif t[:1].isupper() and i > 0 and p not in _STOP and p not in _NEGATIONS:
            found.add(p)
    return found


def _missing_entity(tokens: list[str], other: list[str]) -> str | None:
    """An entity of one question that the other never mentions, in any case or number: users do
    not always capitalise, so the other side is matched case-insensitively."""
    others = {_plain(t) for t in other}
    others |= {w[:-1] for w in others if w.endswith("s")}
    for word in _entity_words(tokens):
        if word not in others and word.rstrip("s") not in others:
            return word
    return None


def _negations(tokens: list[str]) -> int:
    return sum(1 for t in tokens if _plain(t) in _NEGATIONS or t.casefold().replace("’", "'").endswith("n't"))


def _negated_word(words: set[str], other: set[str]) -> bool:
    """'magnetic' / 'non-magnetic', 'mutable' / 'immutable', 'rational' / 'irrational'."""
    for word in words - other:
        for prefix in _NEGATING_PREFIXES:
            if word.startswith(prefix) and len(word) - len(prefix) >= 4 and word[len(prefix):].lstrip("-") in other:
                return True
    return False


def _content(tokens: list[str]) -> list[str]:
    return [p for p in (_plain(t) for t in tokens) if p not in _STOP]


def near_miss(cached: str, asked: str) -> Guarded | None:
    """None when nothing marks the pair as different questions; else the first reason found."""
    a, b = _tokens(cached), _tokens(asked)
    if _numbers(a) != _numbers(b):
        return Guarded("number")
    plain_a, plain_b = {_plain(t) for t in a}, {_plain(t) for t in b}
    if (plain_a & _DATE_WORDS) != (plain_b & _DATE_WORDS):
        return Guarded("date")
    if _negations(a) != _negations(b) or _negated_word(plain_a, plain_b) or _negated_word(plain_b, plain_a):
        return Guarded("negation")
    quant_a = {_SAME_QUANTIFIER.get(w, w) for w in plain_a & _QUANTIFIERS}
    quant_b = {_SAME_QUANTIFIER.get(w, w) for w in plain_b & _QUANTIFIERS}
    if quant_a != quant_b:
        return Guarded("scope")
    count_a, count_b = Counter(_plain(t) for t in a), Counter(_plain(t) for t in b)
    for x, y in _OPPOSITES:
        if (count_a[x] > count_b[x] and count_b[y] > count_a[y]) or (count_a[y] > count_b[y] and count_b[x] > count_a[x]):
            return Guarded("scope")
    content_a, content_b = _content(a), _content(b)
    if sorted(content_a) == sorted(content_b) and content_a != content_b and _CONNECTORS & set(content_a):
        return Guarded("scope")  # the same words the other way round: dollars to euros, renting over buying
    if _missing_entity(a, b) or _missing_entity(b, a):
        return Guarded("entity")
    if len(content_a) == len(content_b) >= 2:
        differing = [(x, y) for x, y in zip(content_a, content_b) if x != y]
        if len(differing) == 1 and len(a) == len(b):
            return Guarded("entity")  # one word swapped, all else equal: ethanol / methanol
    return None


@dataclass(frozen=True)
class Candidate:
    entry_id: int
    question: str
    similarity: float
    state: str
    created_at: float


@dataclass(frozen=True)
class Hit:
    entry_id: int
    similarity: float
    judged: bool


@dataclass(frozen=True)
class AskJudge:
    candidate: Candidate


@dataclass(frozen=True)
class Miss:
    reason: str


def servable(state: str, created_at: float, now: float, policy: CachePolicy) -> bool:
    if state == "verified" or (state == "unverified" and policy.serve_unverified):
        return now - created_at <= policy.freshness_s
    return False


def judge_candidates(asked: str, candidates: list[Candidate], now: float, policy: CachePolicy) -> Hit | AskJudge | Miss:
    """Nearest first: the first servable candidate above the threshold that no guard flags is a hit;
    failing that, the first one in the judge band goes to the judge."""
    reason = "no candidate"
    band: Candidate | None = None
    for c in sorted(candidates, key=lambda c: -c.similarity):
        if c.similarity < policy.judge_band:
            reason = reason if reason != "no candidate" else "similarity"
            break
        if not servable(c.state, c.created_at, now, policy):
            reason = "stale" if c.state in ("unverified", "verified") else c.state
            continue
        guard = near_miss(c.question, asked)
        if guard is not None:
            reason = f"guard:{guard.reason}"
            continue
        if c.similarity >= policy.similarity_threshold:
            return Hit(c.entry_id, c.similarity, judged=False)
        if band is None:
            band = c
    if band is not None:
        return AskJudge(band)
    return Miss(reason)
