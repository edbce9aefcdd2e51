"""Negation in the languages the English guards cannot read, pure: two questions whose counts of
negating words differ ask opposite things, however close they embed ("Quais linhas funcionam de
madrugada?" / "Quais linhas não funcionam de madrugada?" embed at 0.993 with the bundled model).

Closed classes of each language's negators, chosen by the question's language, because a negator in
one language is an ordinary word in another ("no" is "in the" in Portuguese). English is left to
policy/answer_guards.py, which knows its contractions and prefixes.
"""

from __future__ import annotations

import re
import unicodedata

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


def negation_differs(cached: str, asked: str, language: str) -> bool:
    """Whether one question negates what the other asks, in `language` (False for a language with no list)."""
    negators = NEGATORS.get(language)
    return negators is not None and _negations(cached, negators) != _negations(asked, negators)
