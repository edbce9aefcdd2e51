"""Is a model's answer right? `check(record, answer_text)` for each check type of the workload
(bench/workload/splits/*.jsonl): no person and no model judges, only numbers, labels, accepted
strings, JSON fields, text properties, and HumanEval's own unit tests run in a subprocess.

Loaded by file path (bench/economics.py, `appliance eval router`), so it imports no sibling module,
only installed packages.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

from appliance.evaluation.runner import extract, same_number  # noqa: E402

HUMANEVAL_TIMEOUT_S = 10.0
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[^\W_]+")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.S)
_QUOTES = ('"', "'", "`")


def words(text: str) -> str:
    """Lowercase tokens without accents or punctuation, one space apart, thousands separators
    dropped: '10am' and '10 a.m.' both hold '10 am', '$1,250.00' is '1250.00'."""
    text = unicodedata.normalize("NFKD", str(text))
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return " ".join(_TOKEN.findall(text))


def contains(haystack: str, needle: str) -> bool:
    """Whole-token containment after `words`, so '5 days' is not found in '15 days'."""
    n = words(needle)
    return bool(n) and f" {n} " in f" {words(haystack)} "


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", "").lstrip("$"))
        except ValueError:
            return None
    return None


def same_value(got: Any, gold: Any) -> bool:
    """A JSON field against its gold value: numbers numerically, strings by `words`, lists as
    multisets, booleans and null exactly."""
    if gold is None or isinstance(gold, bool):
        return got is gold
    if isinstance(gold, int | float):
        number = _number(got)
        return number is not None and math.isclose(number, gold, rel_tol=1e-9, abs_tol=1e-6)
    if isinstance(gold, str):
        return isinstance(got, str) and words(got) == words(gold)
    if isinstance(gold, list):
        if not isinstance(got, list) or len(got) != len(gold):
            return False
        left = list(got)
        for g in gold:  # each gold element takes one equal answer element
            match = next((i for i, x in enumerate(left) if same_value(x, g)), None)
            if match is None:
                return False
            left.pop(match)
        return True
    if isinstance(gold, dict):
        return isinstance(got, dict) and all(same_value(got.get(k), v) for k, v in gold.items())
    return False


def parse_json(text: str) -> tuple[bool, Any]:
    """The answer as JSON: the whole text, or the one fenced block a model wrapped it in."""
    text = text.strip()
    candidates = [text] + [m.group(2) for m in _FENCE.finditer(text)]
    for candidate in candidates:
        try:
            return True, json.loads(candidate)
        except ValueError:
            continue
    return False, None


def check_number(check: dict[str, Any], answer: str) -> bool:
    return same_number(extract(answer), str(check["value"]))


def check_accepted(check: dict[str, Any], answer: str) -> bool:
    return any(contains(answer, accepted) for accepted in check["answers"])


def check_label(check: dict[str, Any], answer: str) -> bool:
    """The answer is one label, or names exactly one; that label must be the gold one."""
    said = words(answer)
    labels = {words(label): label for label in check["labels"]}
    chosen = labels.get(said)
    if chosen is None:
        named = [label for norm, label in labels.items() if f" {norm} " in f" {said} "]
        chosen = named[0] if len(named) == 1 else None
    return chosen is not None and words(chosen) == words(check["gold"])


def check_json_fields(check: dict[str, Any], answer: str) -> bool:
    ok, value = parse_json(answer)
    return ok and isinstance(value, dict) and all(same_value(value.get(k), v) for k, v in check["gold"].items())


def _word_count(text: str) -> int:
    return len(text.split())


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.I) is not None


def _letters(text: str) -> str:
    return "".join(c for c in text if c.isalpha())


def strip_wrapping(answer: str) -> str:
    """Trailing whitespace and one pair of quotes around the whole answer are not part of it."""
    text = answer.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in _QUOTES and text.count(text[0]) == 2:
        text = text[1:-1].strip()
    return text


def check_property(rule: dict[str, Any], answer: str) -> bool:
    """One rule of a rewrite task (see bench/workload/README.md); 'all' combines several."""
    text = strip_wrapping(answer)
    kind = rule["rule"]
    if kind == "all":
        return all(check_property(r, answer) for r in rule["rules"])
    if kind == "max_words":
        return 0 < _word_count(text) <= rule["n"]
    if kind == "min_words":
        return _word_count(text) >= rule["n"]
    if kind == "lowercase":
        return bool(_letters(text)) and _letters(text) == _letters(text).lower()
    if kind == "uppercase":
        return bool(_letters(text)) and _letters(text) == _letters(text).upper()
    if kind == "contains":
        return _has_word(text, rule["word"])
    if kind == "excludes":
        return bool(text) and not _has_word(text, rule["word"])
    if kind == "starts_with":
        return text.lower().startswith(rule["prefix"].lower())
    if kind == "ends_with":
        return text.endswith(rule["suffix"])
    if kind == "lines":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        prefix = rule.get("prefix")
        return len(lines) == rule["n"] and (prefix is None or all(line.startswith(prefix.strip()) for line in lines))
    if kind == "json":
        ok, value = parse_json(answer)
        if not ok:
            return False
        if "keys" in rule and not (isinstance(value, dict) and all(k in value for k in rule["keys"])):
            return False
        return "length" not in rule or (isinstance(value, list) and len(value) == rule["length"])
    raise ValueError(f"unknown property rule {kind!r}")


def completion_code(answer: str, entry_point: str) -> str:
    """The code of an answer: the fenced block that defines the entry point, else the first
    fenced block, else the raw text (a bare continuation of the prompt)."""
    blocks = [m.group(2) for m in _FENCE.finditer(answer)]
    defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
    for block in blocks:
        if defines.search(block):
            return block
    return blocks[0] if blocks else answer


def humaneval_program(check: dict[str, Any], answer: str) -> str:
    """prompt + completion + test + check(entry_point). A whole function redefines the prompt's
    stub (whose docstring body is valid on its own); a bare body continues the stub."""
    code = completion_code(answer, check["entry_point"])
    joint = "\n\n" if re.search(rf"^\s*def\s+{re.escape(check['entry_point'])}\s*\(", code, re.M) else ""
    return f"{check['prompt']}{joint}{code}\n\n{check['test']}\n\ncheck({check['entry_point']})\n"


def run_python(program: str, timeout_s: float) -> bool:
    """Exit status 0 within the timeout, in a temporary directory, isolated mode (-I: no user
    site, no PYTHON* variables, no script dir on the path); the whole process group is killed on
    end so a forked child cannot outlive it."""
    with tempfile.TemporaryDirectory(prefix="workload-check-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program)
        proc = subprocess.Popen([sys.executable, "-I", str(path)], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def check_humaneval(check: dict[str, Any], answer: str, timeout_s: float = HUMANEVAL_TIMEOUT_S) -> bool:
    return run_python(humaneval_program(check, answer), timeout_s)


def check(record: dict[str, Any], answer_text: str, *, timeout_s: float = HUMANEVAL_TIMEOUT_S) -> bool:
    """True when `answer_text` is a right answer to the workload request `record`."""
    spec = record["check"]
    kind = spec["type"]
    if kind == "number":
        return check_number(spec, answer_text)
    if kind == "humaneval":
        return check_humaneval(spec, answer_text, timeout_s)
    if kind == "json_fields":
        return check_json_fields(spec, answer_text)
    if kind == "label":
        return check_label(spec, answer_text)
    if kind == "accepted":
        return check_accepted(spec, answer_text)
    if kind == "property":
        return check_property(spec, answer_text)
    raise ValueError(f"unknown check type {kind!r}")
