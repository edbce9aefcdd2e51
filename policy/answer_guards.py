"""Near-miss guards, pure: whether two questions that embed close together may share an answer.

The two questions are compared word by word after normalising what does not change a question
(case, punctuation, contractions, inflections, common typos, stop words). A content word one side
has and the other lacks is what matters: if it is a negator, a number, a date, a quantifier, a
name or an opposite of the other side's word, or the two questions differ by nothing but swapped
words, the answer is not shared whatever the cosine says. Any other unmatched word leaves the pair
to a stricter cosine threshold (`Comparison.differs`).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from itertools import pairwise
from types import MappingProxyType

from policy.answer_words import (
    CONNECTORS, COURTESY, DATE_WORDS, ENDING_VERBS, KEYBOARD, MEASURES, NEGATING_PREFIXES, NEGATORS, NUMBER_WORDS,
    OPPOSITE_PREFIXES, OPPOSITES, PERIODIC, QUANTIFIERS, RELATIVE_TIME, SAME_QUANTIFIER, SCAFFOLD_BEFORE, STOP, TECH, TIME_RELATION_WORDS,
    TIME_RELATIONS, TIME_SPANS, TIME_UNITS, UNITS, UNITS_BESIDE_NUMBERS, VOWELS,
)


def _keyboard_neighbours() -> dict[str, set[str]]:
    near: dict[str, set[str]] = {}
    for r, row in enumerate(KEYBOARD):
        for c, ch in enumerate(row):
            cells = [(r, c - 1), (r, c + 1), (r - 1, c), (r - 1, c + 1), (r + 1, c - 1), (r + 1, c)]
            near[ch] = {KEYBOARD[i][j] for i, j in cells if 0 <= i < 3 and 0 <= j < len(KEYBOARD[i])}
    return near


_NEAR_KEYS = _keyboard_neighbours()


def _pairs(text: str) -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    for item in text.split():
        x, y = item.split("/")
        table.setdefault(x, set()).add(y)
        table.setdefault(y, set()).add(x)
    return table




@dataclass(frozen=True)
class Lexicon:
    """Words a vocabulary knows whole, by rank (lower is more common). A word it does not know is a
    typo, or a rare name or term; without a lexicon every word counts as known."""

    ranks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def knows(self, word: str) -> bool:
        return not self.ranks or word in self.ranks or _stem(word) in self.ranks or _stem(word) + "e" in self.ranks


def lexicon_from_vocab(lines: Iterable[str]) -> Lexicon:
    """From a WordPiece vocabulary (one piece a line, most common first): its whole alphabetic words."""
    ranks: dict[str, int] = {}
    for rank, line in enumerate(lines):
        word = line.strip()
        if len(word) > 1 and word.isascii() and word.isalpha():
            ranks.setdefault(word, rank)
    return Lexicon(MappingProxyType(ranks))


NO_LEXICON = Lexicon()


# -- words ---------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\$?\d+(?:[.,:/]\d+)*(?:st|nd|rd|th|s|%)?|[^\W\d_](?:[\w+#']|\.(?=\w))*[+#]*", re.UNICODE)
_PERCENT = re.compile(r"(?i)(\d)\s*(?:per ?cent|pct)\b")  # "10 percent" is "10%"
_CONTRACTION = re.compile(r"(?i)\b(can|won|shan|ai)'?t\b|n't\b|'(re|ve|ll|d|m|s)\b")


@dataclass(frozen=True)
class Word:
    plain: str  # casefolded, units and number words spelled one way
    stem: str
    name: bool  # capitalised past the start of a sentence, all capitals, or a product's spelling
    after: str = ""  # the word before it


def _expand(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        if m.group(1):
            return {"can": "can not", "won": "will not", "shan": "shall not", "ai": "is not"}[m.group(1).lower()]
        return " not" if m.group(0).lower() == "n't" else " "
    text = unicodedata.normalize("NFKC", text).replace("’", "'").replace("‘", "'")
    text = _PERCENT.sub(r"\1%", re.sub(COURTESY, " ", text, flags=re.IGNORECASE))
    return _CONTRACTION.sub(repl, text)


def _stem(word: str) -> str:
    """Inflections that do not change a question: plurals, -ed, -ing, -ly, a final e."""
    for suffix, repl in (("ies", "y"), ("ied", "y"), ("sses", "ss"), ("ches", "ch"), ("shes", "sh"), ("xes", "x"),
                         ("ing", ""), ("ed", ""), ("ly", ""), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith(("ss", "us", "is")):
            word = word[: -len(suffix)] + repl
            break
    if len(word) > 4 and word[-1] == word[-2] and word[-1] not in "aeiousl":
        word = word[:-1]  # running -> runn -> run
    return word.rstrip("e") if len(word) > 3 else word


_OPPOSITE = {**{_stem(w): {_stem(o) for o in os} for w, os in _pairs(OPPOSITES).items()}, **_pairs(OPPOSITES)}


def _unaccented(word: str) -> str:
    """Accents dropped, as people often type them ("horario", "opcao"): a word and its accented
    spelling are one word (a slip, not a swap)."""
    if word.isascii():
        return word
    return "".join(c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c))


def words(text: str) -> list[Word]:
    found: list[Word] = []
    text = _expand(text)
    matches = list(_TOKEN.finditer(text))
    tokens = [m.group(0) for m in matches]
    for i, m in enumerate(matches):
        token = m.group(0)
        start = not text[: m.start()].strip() or text[: m.start()].rstrip()[-1] in ".?!:;\"(-"
        parts = [p for p in re.split(r"[-_/]", token) if p] if token[:1].isalpha() else [token]
        for part in parts:
            plain = _unaccented(part.casefold().replace("'", "").rstrip(".").lstrip("$"))
            if not plain:
                continue
            beside_number = i > 0 and tokens[i - 1][:1].isdigit()
            if plain in UNITS and (beside_number or plain not in UNITS_BESIDE_NUMBERS):
                plain = UNITS[plain]
            plain = NUMBER_WORDS.get(plain, plain)
            if plain in ("am", "pm", "a.m", "p.m") and beside_number:
                plain = plain[0] + ".m."  # a time of day, not "I am"
            name = (not start and part[:1].isupper() and plain != "i") or (len(part) > 1 and part.isupper()) \
                or plain in TECH or any(c in part for c in "+#") or ("." in part and part[:1].isalpha())
            found.append(Word(plain, _stem(plain) if plain.isalpha() else plain, name, found[-1].plain if found else ""))
            start = False
    return found


def _is_number(word: str) -> bool:
    return word[:1].isdigit() or word in set(NUMBER_WORDS.values())


def _typo(a: str, b: str) -> bool:
    """One slip of the kind people make: two letters swapped, a vowel for a vowel, a key beside the
    right one, a vowel or a doubled letter dropped or added. The first letter is rarely the slip."""
    if a == b or a[:1] != b[:1] or min(len(a), len(b)) < 4 or not (a.isalpha() and b.isalpha()):
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]:
            return True
        if len(diff) == 1:
            x, y = a[diff[0]], b[diff[0]]
            return (x in VOWELS and y in VOWELS) or y in _NEAR_KEYS.get(x, set())
        return False
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    if len(long_) != len(short) + 1:
        return False
    for i, ch in enumerate(long_):
        if long_[:i] + long_[i + 1:] == short:
            beside = {long_[i - 1] if i > 0 else "", long_[i + 1] if i + 1 < len(long_) else ""}
            return ch in VOWELS or ch in beside or bool(_NEAR_KEYS.get(ch, set()) & beside)
    return False


def spelled(text: str, lexicon: Lexicon) -> str:
    """The question with each word the lexicon does not know, and that is one common slip from a
    word it does, spelled as that word (the most common one): "recieve" embeds as "receive"."""
    if not lexicon.ranks:
        return text

    def fix(m: re.Match[str]) -> str:
        word = m.group(0)
        lower = word.lower()
        if len(lower) < 5 or lexicon.knows(lower) or not word.islower():
            return word
        best = min((w for w in _variants(lower) if w in lexicon.ranks and _typo(lower, w)),
                   key=lambda w: lexicon.ranks[w], default=None)
        return best or word

    return re.sub(r"[A-Za-z]+", fix, text)


def _variants(word: str) -> set[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    splits = [(word[:i], word[i:]) for i in range(len(word) + 1)]
    out = {a + b[1:] for a, b in splits if b}
    out |= {a + b[1] + b[0] + b[2:] for a, b in splits if len(b) > 1}
    out |= {a + c + b[1:] for a, b in splits if b for c in letters}
    out |= {a + c + b for a, b in splits for c in letters}
    return out


# -- the comparison ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    guard: str | None  # why they are different questions: number, date, negation, opposite, scope, entity, swap
    differs: tuple[str, ...] = ()  # content words one side has that the other lacks (no guard among them)


_ADJECTIVE_ENDINGS = ("ous", "ent", "ant", "ive", "ful", "al", "ic", "able", "ible")


def _unscaffolded(ws: list[Word]) -> list[Word]:
    """Without "best" in "the best way to" (it asks how, not which is best), nor "every" in "every
    day" (daily)."""
    out = []
    for i, w in enumerate(ws):
        after = ws[i + 1].plain if i + 1 < len(ws) else ""
        if w.plain in ("best", "better") and after in SCAFFOLD_BEFORE:
            continue
        if w.plain in ("each", "every", "per", "a") and after in TIME_UNITS:
            continue
        if w.plain == "recent" and i > 0 and ws[i - 1].plain == "most":
            continue
        if w.plain == "most" and after == "recent":
            out.append(Word("last", "last", False, w.after))  # "the most recent commit" is "the last commit"
            continue
        if w.plain == "most" and after.endswith(_ADJECTIVE_ENDINGS) and after not in STOP:
            out.append(Word("most-", "most-", False, w.after))  # "most populous" is a superlative, not "most people"
            continue
        out.append(Word(PERIODIC[w.plain], PERIODIC[w.plain], False) if w.plain in PERIODIC else w)
    return out


def _content(ws: list[Word]) -> list[Word]:
    return [w for w in ws if not (w.plain in STOP or (len(w.plain) == 1 and w.plain.isalpha() and not w.name))]


_IRREGULAR = _pairs("man/men woman/women child/children person/people foot/feet tooth/teeth mouse/mice goose/geese "
                    "die/dice ox/oxen leaf/leaves life/lives knife/knives wife/wives half/halves")


def _same_word(x: Word, y: Word, lexicon: Lexicon) -> bool:
    a, b = x.plain, y.plain
    if a == b or x.stem == y.stem or a in (b + "s", b + "es") or b in (a + "s", a + "es") or b in _IRREGULAR.get(a, ()):
        return True
    if not (a.isalpha() and b.isalpha()):
        return False
    if (not lexicon.knows(a) or not lexicon.knows(b)) and _typo(a, b):
        return True
    if _spelling(a) == _spelling(b):
        return True  # colour / color, centre / center, organise / organize
    short, long_ = sorted((a, b), key=len)
    if len(short) >= 4 and any(long_ in (short + end, short[:-1] + end) for end in _DEMONYM_ENDINGS):
        return True  # Africa / African, Japan / Japanese, Canada / Canadian, Rome / Roman
    if x.name and y.name:
        return False  # Austria / Australia
    if len(short) >= 3 and len(long_) >= 2 * len(short) and long_.startswith(short):
        return True  # env / environment, app / application
    common = len(_common_prefix(a, b))
    return common >= 5 and common >= 0.8 * len(short)  # differ / difference, bacterium / bacteria


_DEMONYM_ENDINGS = ("n", "an", "ian", "ese", "ish")


def _spelling(word: str) -> str:
    word = re.sub(r"our\b|our(?=s|ed|ing)", "or", word)
    word = re.sub(r"([^aeiou])re\b", r"\1er", word)
    return re.sub(r"is(e|ed|es|ing|ation)\b", r"iz\1", word)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _matches(w: Word, other: list[Word], lexicon: Lexicon) -> bool:
    if any(_same_word(w, o, lexicon) for o in other):
        return True
    return w.plain in {a.plain + b.plain for a, b in pairwise(other)}  # wifi / wi-fi, login / log in


def _unmatched(ws: list[Word], other: list[Word], lexicon: Lexicon) -> list[Word]:
    others = {o.plain for o in other}
    joined = {id(w) for a, b in pairwise(ws) if a.plain + b.plain in others for w in (a, b)}
    return [w for w in ws if id(w) not in joined and not _matches(w, other, lexicon)]


def _canonical(word: str) -> str:
    return SAME_QUANTIFIER.get(word, word)


def _ordered(ws: list[Word]) -> set[tuple[str, str, str]]:
    """(word, connector, word) around each connector: "dollars to euros" is not "euros to dollars"."""
    out = set()
    for i, w in enumerate(ws):
        if w.plain in CONNECTORS:
            before = next((v.stem for v in reversed(ws[:i]) if v.plain not in STOP), None)
            after = next((v.stem for v in ws[i + 1:] if v.plain not in STOP), None)
            if before and after:
                out.add((before, w.plain, after))
    return out


def _pure_swap(ca: list[Word], cb: list[Word], unmatched: list[Word], lexicon: Lexicon) -> bool:
    """The same content words in the same order but for one or two in the same place on each
    side: "for adults" / "for children", "quinoa" / "couscous"."""
    a = [_key(w, cb, lexicon) for w in ca]
    b = [w.stem for w in cb]
    ops = [op for op in SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops or any(op[0] != "replace" for op in ops):
        return False
    swapped = sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in ops)
    if swapped > 2 or len(a) - swapped < 1:
        return False
    loose = {id(w) for w in unmatched}
    if not all(any(id(w) in loose for w in ca[i1:i2]) and any(id(w) in loose for w in cb[j1:j2]) for _, i1, i2, j1, j2 in ops):
        return False  # "Wi-Fi" / "wifi": the same words, written apart
    words = [w for _, i1, i2, j1, j2 in ops for w in ca[i1:i2] + cb[j1:j2]]
    return not all(w.after in _VERB_SLOT for w in words)  # "can I lower" / "can I reduce": a verb said otherwise


def _key(w: Word, other: list[Word], lexicon: Lexicon) -> str:
    """A word as the other side spells it when they are the same word, for aligning the two."""
    return next((o.stem for o in other if _same_word(w, o, lexicon)), w.stem)


def compare(cached: str, asked: str, lexicon: Lexicon = NO_LEXICON, count_negators: bool = True) -> Comparison:
    """`count_negators`: False where the caller counts each question's negators in its own language
    (policy/answer_negation.py), since "no" is a negator in English and "in the" in Portuguese."""
    wa, wb = _unscaffolded(words(cached)), _unscaffolded(words(asked))
    ca, cb = _content(wa), _content(wb)
    if count_negators and _negations(wa) != _negations(wb):
        return Comparison("negation")
    stems_a, stems_b = {w.stem for w in wa} | {w.plain for w in wa}, {w.stem for w in wb} | {w.plain for w in wb}
    for x, y in ((stems_a, stems_b), (stems_b, stems_a)):
        for word in x - y:
            for prefix in NEGATING_PREFIXES:
                rest = word[len(prefix):].lstrip("-")
                if word.startswith(prefix) and len(rest) >= 4 and rest in y and rest not in x:
                    return Comparison("negation")  # safe / unsafe, magnetic / non-magnetic
            for prefix, other in OPPOSITE_PREFIXES:
                if word.startswith(prefix) and len(word) - len(prefix) >= 3 and other + word[len(prefix):] in y:
                    return Comparison("opposite")  # underpay / overpay
    for count_a, count_b in ((Counter(w.plain for w in wa), Counter(w.plain for w in wb)),
                             (Counter(w.stem for w in wa), Counter(w.stem for w in wb))):
        for word in count_a.keys() | count_b.keys():
            for opposite in _OPPOSITE.get(word, ()):
                if count_a[word] > count_b[word] and count_b[opposite] > count_a[opposite]:
                    return Comparison("opposite")
    if _opposites_turned(wa, wb):
        return Comparison("opposite")
    if {_canonical(w.plain) for w in wa if _is_number(w.plain)} != {_canonical(w.plain) for w in wb if _is_number(w.plain)}:
        return Comparison("number")
    if _measures_differ(wa, wb):
        return Comparison("number")
    unmatched_a, unmatched_b = _unmatched(ca, cb, lexicon), _unmatched(cb, ca, lexicon)
    if any(w.plain in DATE_WORDS for w in unmatched_a + unmatched_b) or _times(wa) != _times(wb):
        return Comparison("date")
    for ws, added, other in ((wa, unmatched_a, wb), (wb, unmatched_b, wa)):
        if _time_relation(ws, added) and not any(w.plain in TIME_RELATION_WORDS for w in other):
            return Comparison("date")  # "on Thanksgiving" / "the day after Thanksgiving"
    quant_a = {_canonical(w.plain) for w in wa if w.plain in QUANTIFIERS}
    quant_b = {_canonical(w.plain) for w in wb if w.plain in QUANTIFIERS}
    if quant_a != quant_b or sum(_superlative(w.plain, lexicon) for w in wa) != sum(_superlative(w.plain, lexicon) for w in wb):
        return Comparison("scope")
    if any(w.name for w in unmatched_a + unmatched_b):
        return Comparison("entity")
    order_a, order_b = _ordered(wa), _ordered(wb)
    if any((y, c, x) in order_b and (x, c, y) not in order_b for x, c, y in order_a if x != y):
        return Comparison("scope")  # the same words the other way round: dollars to euros
    if "than" in {w.plain for w in wa} & {w.plain for w in wb} and not unmatched_a and not unmatched_b \
            and [_key(w, cb, lexicon) for w in ca] != [w.stem for w in cb]:
        return Comparison("scope")  # the comparison turned round: is X healthier than Y
    kind_a, kind_b = _asks_for(wa), _asks_for(wb)
    if kind_a and kind_b and kind_a != kind_b:
        return Comparison("question")  # when / where / who was it built
    if _pure_swap(ca, cb, unmatched_a + unmatched_b, lexicon):
        return Comparison("swap")
    if (not unmatched_a and _narrowed(wb, unmatched_b)) or (not unmatched_b and _narrowed(wa, unmatched_a)):
        return Comparison("scope")  # the same question for a narrower group or place: "... in cats", "... as a freelancer"
    if (not unmatched_a and _qualified(wb, unmatched_b, ca, lexicon)) or (not unmatched_b and _qualified(wa, unmatched_a, cb, lexicon)):
        return Comparison("scope")  # a kind of the same thing: "patients" / "diabetic patients", "a" / "the admin password"
    return Comparison(None, tuple(sorted({w.plain for w in unmatched_a + unmatched_b})))


def _opposites_turned(wa: list[Word], wb: list[Word]) -> bool:
    """Both sides name the two words of an opposite pair, in the other order: "passing locally but
    failing in CI" / "failing locally but passing in CI"."""
    def first(ws: list[Word]) -> dict[str, int]:
        at: dict[str, int] = {}
        for i, w in enumerate(ws):
            for form in (w.plain, w.stem):
                at.setdefault(form, i)
        return at

    fa, fb = first(_content(wa)), first(_content(wb))  # not "carry over to next year under" / "under ... rolls over"
    for word in fa.keys() & fb.keys():
        for opposite in _OPPOSITE.get(word, ()):
            if opposite in fa and opposite in fb and (fa[word] < fa[opposite]) != (fb[word] < fb[opposite]):
                return True
    return False


def _qualified(ws: list[Word], added: list[Word], other: list[Word], lexicon: Lexicon) -> bool:
    """A word the other side lacks, written right before a content word both sides have: a modifier
    that narrows the thing asked about ("patients" / "diabetic patients"). Not an adverb (-ly: how,
    not what) nor a word the lexicon does not know (a slip)."""
    new = {id(w) for w in added}
    return any(id(w) in new and id(v) not in new and v.plain not in STOP and _matches(v, other, lexicon)
               and lexicon.knows(w.plain) and not w.plain.endswith(_NOT_MODIFIERS) and w.stem not in _QUESTION_NOUNS
               for w, v in pairwise(ws))


_NOT_MODIFIERS = ("ly", "s", "ed")  # an adverb, or a verb's form: "the symbol represents iron", "an order placed online"
_QUESTION_NOUNS = {"reason", "caus", "way", "step", "process", "procedur", "method", "mean", "purpos", "syntax", "command",
                   "formula", "differenc", "vs", "versus", "using", "via"}  # how a question asks, not what about


def negations(text: str) -> int:
    """English negators in a question, as compare counts them."""
    return _negations(_unscaffolded(words(text)))


def _negations(ws: list[Word]) -> int:
    """Negators are counted, not matched: "not" twice is not "not" once."""
    return sum(w.plain in NEGATORS for w in ws) + sum(w.plain in ENDING_VERBS and v.plain.endswith("ing") for w, v in pairwise(ws))


def _measures_differ(wa: list[Word], wb: list[Word]) -> bool:
    """Other units when both sides name some (miles / kilometers), or a number's unit changed
    ("72 degrees Fahrenheit in Celsius" / "72 degrees Celsius in Fahrenheit")."""
    ma, mb = Counter(filter(None, map(_measure, wa))), Counter(filter(None, map(_measure, wb)))
    if ma and mb and ma != mb:
        return True

    def units(ws: list[Word]) -> dict[str, str]:
        return {w.plain: next((m for v in ws[i + 1: i + 4] if (m := _measure(v))), "") for i, w in enumerate(ws) if _is_number(w.plain)}

    ua, ub = units(wa), units(wb)
    return any(ua[n] and ub.get(n) and ua[n] != ub[n] for n in ua)


def _measure(w: Word) -> str:
    """The unit a word names, typed right or one slip off ("centmieters")."""
    forms = (w.plain, w.plain[:-1], w.plain[:-2])
    found = next((m for m in forms if m in MEASURES), "")
    if found or len(w.plain) < 6 or not w.plain.isalpha():
        return found
    return next((m for m in MEASURES for f in forms[:2] if len(m) >= 5 and _typo(f, m)), "")


def _time_relation(ws: list[Word], added: list[Word]) -> bool:
    """An added before / after / until tied to a time, a date, a number or a name ("the day after
    Thanksgiving", "after 30 days"); "after opening" says when as the other side does."""
    new = {id(w) for w in added}
    for i, w in enumerate(ws):
        if w.plain in TIME_RELATIONS and id(w) in new:
            near = [v for v in ws[max(0, i - 2): i] + ws[i + 1: i + 3] if v.plain not in STOP]
            if any(v.stem in TIME_SPANS or v.plain in TIME_SPANS or v.plain in DATE_WORDS or _is_number(v.plain) or v.name for v in near):
                return True
    return False


def _times(ws: list[Word]) -> set[tuple[str, str]]:
    """Relative times: ("last", "year") for "last year"."""
    return {(w.plain, v.stem) for w, v in pairwise(ws) if w.plain in RELATIVE_TIME and (v.stem in TIME_SPANS or v.plain in TIME_SPANS)}


_PREPOSITIONS = {"for", "in", "on", "at", "as", "among", "during", "with", "within", "near", "across", "inside", "outside",
                 "under", "between", "from", "by", "if", "when", "while", "unless"}


def _narrowed(ws: list[Word], added: list[Word]) -> bool:
    """A phrase the other side lacks, led by a preposition: "for trucks", "in young children"."""
    new = {id(w) for w in added}
    for i, w in enumerate(ws):
        if w.plain in _PREPOSITIONS:
            rest = [v for v in ws[i + 1: i + 4] if v.plain not in STOP]
            if rest and id(rest[0]) in new:
                return True
    return False


# After these a word is a verb ("can I lower", "how to reduce"): a verb swapped for another is rewording
# as often as not, and its opposites are listed. After "can" or "do" comes the subject: "do puppies need".
_VERB_SLOT = {"i", "you", "we", "they", "he", "she", "to", "please", "not"}
_ANSWER_KINDS = {"when": "time", "where": "place", "who": "person", "whom": "person", "whose": "person", "why": "reason"}
# "how many days" asks how long, "how many times" how often, "how much leave" as "how many days" does.
_HOW = {"many": "amount", "much": "amount", "long": "duration", "often": "frequency", "far": "distance", "old": "age"}


def _asks_for(ws: list[Word]) -> str | None:
    """The kind of answer a question word asks for; None for what / which / how, which ask for any."""
    for i, w in enumerate(ws):
        if w.plain in _ANSWER_KINDS:
            return _ANSWER_KINDS[w.plain]
        if w.plain == "how" and i + 1 < len(ws) and ws[i + 1].plain in _HOW:
            counted = next((v for v in ws[i + 2: i + 4] if v.plain not in STOP), None)
            if ws[i + 1].plain == "many" and counted is not None and counted.stem in ("time", "tim"):
                return "frequency"
            if ws[i + 1].plain == "many" and counted is not None and {counted.stem, counted.plain, counted.plain[:-1]} & TIME_SPANS:
                return "duration"
            return _HOW[ws[i + 1].plain]
    return None


def _superlative(word: str, lexicon: Lexicon) -> bool:
    if word in ("most", "most-", "least", "best", "worst"):
        return True
    if not word.endswith("est") or len(word) < 6:
        return False
    base = word[:-3]
    candidates = {base, base + "e", base[:-1] if len(base) > 2 and base[-1] == base[-2] else base, base[:-1] + "y" if base.endswith("i") else base}
    return any(c in lexicon.ranks and c not in STOP and len(c) >= 3 for c in candidates)
