"""The distillation traffic (bench/workload/distill_traffic.py): records in the workload's format,
the same for a seed, distinct messages, golds that the workload's checker accepts (and a wrong
answer that it refuses), golds valid under their schemas, labels and schemas spread evenly, and
the leak guard: no generated text shares a sentence, or a run of RUN words, with the
hand-written items whose evaluation split the trained model is scored on."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.workload import distill_classification, distill_extraction, distill_traffic, sources
from tests.test_workload import wc  # the workload's checker, loaded once

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "workload"
FIELDS = ["id", "split", "order", "family", "tenant", "messages", "max_tokens", "response_format", "check", "group",
          "cache", "cache_of", "trap_kind", "adversarial"]
N = 600
RUN = 6  # words in a row that a generated text may not share with a hand-written one

RECORDS = {family: distill_traffic.records(family, N, 0) for family in distill_traffic.FAMILIES}
TENANTS = sources.tenants()


def _text(record: dict[str, Any]) -> str:
    """The part of the user message that the phrase banks wrote (an extraction's schema is the workload's)."""
    user = record["messages"][1]["content"]
    return user.split("\n\nText: ", 1)[1] if record["family"] == "extraction" else user


def _sentences(text: str) -> list[str]:
    return [s for s in (wc.words(part) for part in re.split(r"(?<=[.!?])\s+|\n+", text)) if s]


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _runs(sentence: str) -> set[str]:
    words = sentence.split()
    return {" ".join(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}


# --- format and determinism -----------------------------------------------------------------------

def test_records_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    for family in distill_traffic.FAMILIES:
        assert distill_traffic.records(family, N, 0) == RECORDS[family]
        other = distill_traffic.records(family, 40, 1)
        assert [r["messages"] for r in other] != [r["messages"] for r in RECORDS[family][:40]]


@pytest.mark.parametrize("family", distill_traffic.FAMILIES)
def test_records_have_the_workload_format(family: str) -> None:
    # the committed workload's user messages, to compare each extraction's schema part with
    workload = [json.loads(line) for line in (WORKLOAD / "splits" / "calibration.jsonl").read_text(encoding="utf-8").splitlines()]
    schema_parts = {r["messages"][1]["content"].split("Text: ", 1)[0] for r in workload if r["family"] == "extraction"}
    for n, record in enumerate(RECORDS[family], 1):
        assert list(record) == FIELDS
        assert record["id"] == f"distill-{family}-{n:04d}" and record["order"] == n and record["split"] == "distill"
        assert record["family"] == family and record["group"] == f"g-{record['id']}"
        assert (record["cache"], record["cache_of"], record["trap_kind"], record["adversarial"]) == ("oneoff", None, None, None)
        system, user = record["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert record["max_tokens"] == (sources.LONG_TOKENS if family == "gsm8k" else sources.SHORT_TOKENS)
        prompt = next(p for p in TENANTS[record["tenant"]].values() if p["system"] == system["content"])
        if family == "gsm8k":
            assert record["response_format"] is None and record["check"]["type"] == "number"
        elif family == "classification":
            assert record["response_format"] is None
            assert record["check"]["type"] == "label" and record["check"]["labels"] == prompt["labels"]
        else:
            schema = record["response_format"]["json_schema"]["schema"]
            assert record["response_format"] == {"type": "json_schema", "json_schema": {"name": "record", "schema": schema,
                                                                                        "strict": True}}
            assert user["content"].split("Text: ", 1)[0] in schema_parts
            assert record["check"]["type"] == "json_fields"


def test_cli_writes_the_records_as_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "train.jsonl"
    assert distill_traffic.main(["--family", "extraction", "--n", "30", "--seed", "0", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == distill_traffic.records("extraction", 30, 0)


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="family"):
        distill_traffic.records("factual", 10, 0)


# --- variety and spread ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", distill_traffic.FAMILIES)
def test_no_two_records_have_the_same_user_message(family: str) -> None:
    users = [r["messages"][1]["content"] for r in RECORDS[family]]
    assert len(set(users)) == N


def test_every_label_and_schema_has_at_least_ten_templates() -> None:
    for (tenant, prompt), labels in distill_classification.TEMPLATES.items():
        assert sorted(labels) == sorted(TENANTS[tenant][prompt]["labels"])
        for label, templates in labels.items():
            assert len(set(templates)) >= 10, (tenant, prompt, label)
    assert len(distill_extraction.SCHEMAS) == 6
    for schema in distill_extraction.SCHEMAS:
        assert len(set(schema.templates)) >= 10, schema.name


def test_classification_is_spread_over_the_prompts_and_their_labels() -> None:
    per_prompt = Counter(r["messages"][0]["content"] for r in RECORDS["classification"])
    assert sorted(per_prompt.values()) == [N // 3] * 3
    per_label = Counter((r["tenant"], r["check"]["gold"]) for r in RECORDS["classification"])
    for (tenant, prompt) in distill_traffic.CLASSIFICATION_PROMPTS:
        counts = [per_label[(tenant, label)] for label in TENANTS[tenant][prompt]["labels"]]
        assert max(counts) - min(counts) <= 1, (prompt, counts)


def test_extraction_covers_the_six_schemas_of_the_workload_evenly() -> None:
    """The same (tenant, prompt, schema) triples as handwritten/extraction.jsonl (read for its schemas only)."""
    rows = sources.read_jsonl(WORKLOAD / "handwritten" / "extraction.jsonl")
    workload = {(r["tenant"], r["prompt"], json.dumps(r["schema"])) for r in rows}
    ours = {(s.tenant, s.prompt, json.dumps(s.schema)) for s in distill_extraction.SCHEMAS}
    assert ours == workload
    counts = Counter(json.dumps(r["response_format"]["json_schema"]["schema"]) for r in RECORDS["extraction"])
    assert sorted(counts.values()) == [N // 6] * 6
    # the enum values come up too, not only one of them
    golds = [r["check"]["gold"] for r in RECORDS["extraction"]]
    for field, values in (("issue", 4), ("level", 3), ("currency", 5), ("refund_requested", 2)):
        assert len({g[field] for g in golds if field in g}) == values
    # no refund is asked for about as often as one is, and often without the word
    complaints = [r for r in RECORDS["extraction"] if "refund_requested" in r["check"]["gold"]]
    declined = [r for r in complaints if not r["check"]["gold"]["refund_requested"]]
    assert 0.3 <= len(declined) / len(complaints) <= 0.7
    assert any("refund" not in r["messages"][1]["content"].split("Text:")[-1].lower() for r in declined)


# --- checks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("record", RECORDS["classification"][:N:3], ids=lambda r: r["id"])
def test_the_gold_label_passes_and_another_label_fails(record: dict[str, Any]) -> None:
    gold = record["check"]["gold"]
    assert wc.check(record, gold)
    assert wc.check(record, f"{gold.capitalize()}.")
    for label in record["check"]["labels"]:
        if label != gold:
            assert not wc.check(record, label)


def _wrong(value: Any, schema: dict[str, Any]) -> Any:
    """A value for the field that differs from `value` in a way the checker must notice."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if "enum" in schema:
        return next(v for v in schema["enum"] if v != value)
    if schema.get("description", "").endswith("YYYY-MM-DD"):
        return (dt.date.fromisoformat(value) + dt.timedelta(days=1)).isoformat()
    return value + " Jr"


def test_the_gold_record_passes_validates_and_one_changed_field_fails() -> None:
    for record in RECORDS["extraction"]:
        gold = record["check"]["gold"]
        schema = record["response_format"]["json_schema"]["schema"]
        jsonschema.validate(gold, schema)
        assert wc.check(record, json.dumps(gold)), record["id"]
        assert wc.check(record, f"```json\n{json.dumps(gold, indent=2)}\n```"), record["id"]
        for field, value in gold.items():
            wrong = {**gold, field: _wrong(value, schema["properties"][field])}
            jsonschema.validate(wrong, schema)
            assert not wc.check(record, json.dumps(wrong)), (record["id"], field)


def test_every_gold_string_is_in_the_text_except_dates_and_enums() -> None:
    """A gold string that the text states (names, ids, cities, codes), so the answer is there to extract."""
    for record in RECORDS["extraction"]:
        properties = record["response_format"]["json_schema"]["schema"]["properties"]
        for field, value in record["check"]["gold"].items():
            if isinstance(value, str) and "enum" not in properties[field] and "description" not in properties[field]:
                assert wc.contains(_text(record), value), (record["id"], field, value)


# --- the leak guard -------------------------------------------------------------------------------

def test_word_problems_are_none_of_the_workloads_and_fewer_are_the_first_of_more() -> None:
    splits = [json.loads(line) for split in ("calibration", "development", "evaluation")
              for line in (WORKLOAD / "splits" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    workload = {r["messages"][1]["content"] for r in splits if r["family"] == "gsm8k"}
    assert len(workload) == 105
    ours = [r["messages"][1]["content"] for r in RECORDS["gsm8k"]]
    assert not set(ours) & workload
    assert [r["messages"][1]["content"] for r in distill_traffic.records("gsm8k", 40, 0)] == ours[:40]
    for record in RECORDS["gsm8k"][:20]:
        assert wc.check(record, f"Answer: {record['check']['value']}") and not wc.check(record, "Answer: -1")


def test_no_generated_text_shares_a_sentence_or_a_long_run_with_the_handwritten_items() -> None:
    """Every string of every hand-written file, cut into sentences and normalised like the checker
    does (lowercase, no accents or punctuation); a generated sentence must be none of them, and
    must share no RUN consecutive words with any of them."""
    sentences: set[str] = set()
    for path in sorted((WORKLOAD / "handwritten").glob("*.jsonl")):
        if path.name.startswith("adversarial_blind"):
            continue  # outsiders' router manipulation templates: never workload traffic (a greeting is no leak)
        for row in sources.read_jsonl(path):
            for text in _strings({k: v for k, v in row.items() if k != "schema"}):
                sentences.update(_sentences(text))
    assert len(sentences) > 500  # the hand-written files were read
    runs = set().union(*(_runs(s) for s in sentences))
    for family in ("classification", "extraction"):  # the written families; GSM8K's problems are the package's
        for record in RECORDS[family]:
            for sentence in _sentences(_text(record)):
                assert sentence not in sentences, (record["id"], sentence)
                shared = _runs(sentence) & runs
                assert not shared, (record["id"], sorted(shared))
