"""Cheap local input checks, run before any model: personal data patterns (flagged or refused, as the
config says) and prompt-injection patterns (flagged and recorded; the router never obeys them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Phrases that try to steer the router or pose as the system. Flagged and recorded, never obeyed.
INJECTION = re.compile(
    r"(ignore (all |the )?(previous|prior|above) (instructions|rules)|you are now|system prompt|\bsystem:|<\|im_start\|>|"
    r"\[/?inst\]|<\|system\|>|developer mode|use (the )?(biggest|largest|best|most expensive|frontier|gpt-?4|strongest) model|"
    r"route (this|me) to|escalate (this|to)|this is (very )?(hard|difficult|complex)|requires? (the )?(frontier|large) model|"
    r"tier\s*[:=]\s*\w+|priority\s*[:=]\s*(high|max))", re.I)


# Weaker cues: alone they prove nothing ("what are the instructions for this oven?"), so they make
# the cheap check unsure, and an LLM judge, when one is configured, decides.
SUSPICIOUS = re.compile(
    r"(\binstructions?\b|\bpretend\b|\brole-?play\b|\bjailbreak|\bdisregard\b|\boverride\b|\bforget (everything|all|your)|"
    r"\bact as\b|\bfrom now on\b|\bnew rules?\b|\breveal (your|the)\b|\bbypass\b|\bunfiltered\b|\bno restrictions\b)", re.I)


def injection_flagged(text: str) -> bool:
    return bool(INJECTION.search(text))


def injection_unsure(text: str) -> bool:
    """Not flagged by the sure patterns, but carrying a cue worth a second opinion."""
    return not injection_flagged(text) and bool(SUSPICIOUS.search(text))


_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?|\d{2,4}[\s.-])\d{3,4}[\s.-]\d{3,4}(?!\w)")
_CARD = re.compile(r"\b(?:\d[ -]?){13,19}\b")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?:\s?[A-Z0-9]{4}){2,7}(?:\s?[A-Z0-9]{1,4})?\b")
_US_SSN = re.compile(r"\b(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}\b")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _iban_ok(text: str) -> bool:
    compact = text.replace(" ", "")
    moved = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in moved)
    return int(number) % 97 == 1


@dataclass(frozen=True)
class PiiFinding:
    kind: str  # email, phone, card, iban, ssn
    count: int


def find_pii(text: str) -> tuple[PiiFinding, ...]:
    """Kinds of personal data in `text`, checked as far as a pattern can (Luhn for cards, the
    ISO 7064 check for IBANs), so order numbers and prices are not flagged as cards."""
    found = []
    emails = _EMAIL.findall(text)
    if emails:
        found.append(PiiFinding("email", len(emails)))
    cards = [m for m in _CARD.findall(text) if 13 <= len(d := re.sub(r"\D", "", m)) <= 19 and _luhn(d)]
    if cards:
        found.append(PiiFinding("card", len(cards)))
    ibans = [m for m in _IBAN.findall(text) if _iban_ok(m)]
    if ibans:
        found.append(PiiFinding("iban", len(ibans)))
    ssns = _US_SSN.findall(text)
    if ssns:
        found.append(PiiFinding("ssn", len(ssns)))
    without_cards = _CARD.sub(" ", text)
    phones = _PHONE.findall(without_cards)
    if phones:
        found.append(PiiFinding("phone", len(phones)))
    return tuple(found)


@dataclass(frozen=True)
class GuardOutcome:
    pii: tuple[PiiFinding, ...]
    refuse: bool  # the policy says personal data must not reach a model
    injection: bool = False
    unsure: bool = False  # no sure injection pattern, but a cue: a judge may decide


def check_input(texts: list[str], pii_mode: str) -> GuardOutcome:
    """pii_mode: "off", "flag" (recorded in the trace and metrics), or "block" (refused)."""
    injection = any(injection_flagged(t) for t in texts)
    unsure = not injection and any(injection_unsure(t) for t in texts)
    if pii_mode == "off":
        return GuardOutcome((), False, injection, unsure)
    findings: dict[str, int] = {}
    for text in texts:
        for f in find_pii(text):
            findings[f.kind] = findings.get(f.kind, 0) + f.count
    pii = tuple(PiiFinding(k, n) for k, n in sorted(findings.items()))
    return GuardOutcome(pii, bool(pii) and pii_mode == "block", injection, unsure)
