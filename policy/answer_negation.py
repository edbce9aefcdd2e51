"""Negation in the languages the English guards cannot read, pure: two questions whose counts of
negating words differ ask opposite things, however close they embed ("Quais linhas funcionam de
madrugada?" / "Quais linhas não funcionam de madrugada?" embed at 0.993 with the bundled model).

Closed classes of each language's negators, chosen by the question's language, because a negator in
one language is an ordinary word in another ("no" is "in the" in Portuguese). English's are counted by
policy/answer_guards.py, which knows its contractions; each question is read in its own language.
"""

from __future__ import annotations

import re
import unicodedata

from policy.answer_guards import negations as english_negations

NEGATORS: dict[str, frozenset[str]] = {
    "pt": frozenset("não nao nunca jamais nem nenhum nenhuma nenhuns nenhumas sem ninguém ninguem nada".split()),
    "es": frozenset("no nunca jamás jamas ni ningún ningun ninguno ninguna sin nadie nada tampoco".split()),
    "de": frozenset("nicht kein keine keinen keinem keiner keines nie niemals ohne nichts niemand".split()),
    "fr": frozenset("ne n pas jamais sans aucun aucune rien".split()),
    "it": frozenset("non mai senza nessuno nessuna niente nulla né".split()),
}
_WORD = re.compile(r"\w+")


def _negations(text: str, negators: frozenset[str]) -> int:
    words = _WORD.findall(unicodedata.normalize("NFKC", text).casefold())
    return sum(w in negators for w in words)


def negations_in(text: str, language: str | None) -> int:
    """A question's negators, counted in its own language: English's (with its contractions) for
    English and any language without a list here."""
    negators = NEGATORS.get(language or "")
    return _negations(text, negators) if negators is not None else english_negations(text)


def negations_differ(cached: str, cached_language: str | None, asked: str, asked_language: str | None) -> bool:
    """Whether one question negates what the other asks, each read in its own language, so that a
    Portuguese "não" matches an English "isn't" and a Portuguese "no" (in the) is no negator."""
    return negations_in(cached, cached_language) != negations_in(asked, asked_language)
