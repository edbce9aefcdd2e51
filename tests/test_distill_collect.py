"""Distillation's collect step, without IO: which kept answers become training examples (verified,
opted in, free of personal data, one per prompt) and the deterministic split; and the kept-answer
store on an in-memory database."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.store import kept_answers
from appliance.store.db import connect, migrate
from appliance.store.answer_entries import CacheStore
from policy.answer_cache import Bucket
from policy.distill import Kept, Wanted, is_held_out, personal_data, prompt_key, select, verdict

TIERS = ("small", "big")
WANTED = Wanted("auto", TIERS, frozenset({"acme"}), held_out=0.0)


def kept(question: str, *, model: str = "big", route: str | None = "auto", tenant: str = "acme", answer: str = "Paris.",
         at: float = 100.0, **fields: object) -> Kept:
    return Kept(f"r-{question}-{at}-{tenant}", tenant, route, model, fields.pop("family", None),  # type: ignore[arg-type]
                (("system", "Be brief."), ("user", question)), answer, fields.pop("finish_reason", "stop"), at, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, "frontier"),
    ({"finish_reason": "length"}, None),  # cut off: nothing to learn from
    ({"model": "small"}, None),  # a cheaper tier, unconfirmed
    ({"model": "small", "rating": "good"}, "feedback"),
    ({"model": "small", "cache_state": "verified", "cache_reason": "feedback:good"}, "feedback"),  # good through a cache hit
    ({"model": "small", "cache_state": "verified", "cache_reason": "admin"}, "admin"),
    ({"model": "small", "cache_state": "verified", "cache_reason": "sweep:agreed"}, None),  # the model agreeing with itself
    ({"model": "small", "validator": "json_schema"}, "validator"),
    ({"rating": "bad"}, None),  # a frontier answer someone rejected
    ({"cache_state": "rejected", "cache_reason": "admin"}, None),
    ({"rating": "good", "cache_state": "rejected"}, None),  # a rejection anywhere wins
    ({"model": "big:tuned@1"}, None),  # the frontier with an adapter is another model
])
def test_what_counts_as_verified(fields: dict, expected: str | None) -> None:
    assert verdict(kept("q", **fields), frontier="big") == expected


def test_the_route_takes_its_routed_answers_and_its_tiers_named_directly() -> None:
    rows = [kept("a"), kept("b", route="other"), kept("c", route=None), kept("d", route=None, model="elsewhere")]
    assert [e.messages[-1][1] for e in select(rows, WANTED).train] == ["a", "c"]


def test_family_filter() -> None:
    rows = [kept("a", family="extraction"), kept("b", family="factual"), kept("c")]
    chosen = select(rows, dataclasses.replace(WANTED, family="extraction"))
    assert [e.messages[-1][1] for e in chosen.train] == ["a"] and chosen.counts.found == 1


def test_only_opted_in_tenants() -> None:
    rows = [kept("a"), kept("b", tenant="zeta"), kept("c", tenant="zeta", rating="good")]
    chosen = select(rows, WANTED)
    assert [e.tenant for e in chosen.train] == ["acme"]
    assert (chosen.counts.found, chosen.counts.verified, chosen.counts.opted_in) == (3, 3, 1)


@pytest.mark.parametrize(("text", "kinds"), [
    ("Write to anna.berg@example.com about it.", ("email",)),
    ("My card is 4111 1111 1111 1111.", ("card",)),
    ("IBAN DE89 3704 0044 0532 0130 00 please", ("iban",)),
    ("Call +44 20 7946 0958 today", ("phone",)),
    ("Order 12345 costs 19.99", ()),  # numbers that are not personal data
])
def test_personal_data_in_the_prompt_or_the_answer_drops_the_example(text: str, kinds: tuple[str, ...]) -> None:
    assert personal_data(kept(text)) == kinds
    assert personal_data(kept("q", answer=text)) == kinds
    chosen = select([kept(text), kept("clean")], WANTED)
    assert chosen.counts.personal_data == (1 if kinds else 0)
    assert len(chosen.train) == (1 if kinds else 2)


def test_one_example_per_prompt_the_strongest_verdict_then_the_newest() -> None:
    rows = [kept("q", answer="old frontier", at=1), kept("q", answer="new frontier", at=2),
            kept("q", model="small", answer="confirmed", rating="good", at=0), kept("r", at=3)]
    chosen = select(rows, WANTED)
    assert [(e.messages[-1][1], e.answer, e.verified) for e in chosen.train] == [("q", "confirmed", "feedback"), ("r", "Paris.", "frontier")]
    assert chosen.counts.duplicates == 2
    rows = [kept("q", answer="old", at=1), kept("q", answer="new", at=2)]
    assert [e.answer for e in select(rows, WANTED).train] == ["new"]
    # The same turns from two tenants are one prompt.
    assert select([kept("q"), kept("q", tenant="beta")], dataclasses.replace(WANTED, tenants=frozenset({"acme", "beta"}))).counts.duplicates == 1


def test_counts_follow_each_step() -> None:
    rows = [kept("a"), kept("a", at=2), kept("b", model="small"), kept("c", tenant="zeta"), kept("mail me: x@y.org"), kept("d"),
            kept("e", route="other")]
    counts = select(rows, dataclasses.replace(WANTED, held_out=0.5)).counts
    assert (counts.found, counts.verified, counts.opted_in, counts.personal_data, counts.duplicates) == (6, 5, 4, 1, 1)
    assert counts.train + counts.held_out == 2


def test_the_training_line_is_chat_format() -> None:
    (example,) = select([kept("What is the capital of France?")], WANTED).train
    assert example.record() == {"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "What is the capital of France?"},
                                             {"role": "assistant", "content": "Paris."}]}


questions = st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=40, unique=True)


@given(questions, st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_the_split_is_by_prompt_stable_and_disjoint(texts: list[str], share: float, seed: int) -> None:
    rows = [kept(t, at=float(i)) for i, t in enumerate(texts)]
    wanted = dataclasses.replace(WANTED, held_out=share, seed=seed)
    first = select(rows, wanted)
    train = {prompt_key(e.messages) for e in first.train}
    held = {prompt_key(e.messages) for e in first.held_out}
    assert not train & held and len(train | held) == len(texts)
    # Other rows around it (more traffic, another order) never move a prompt to the other side.
    again = select(list(reversed(rows)) + [kept("extra " + t, at=99.0) for t in texts], wanted)
    assert held <= {prompt_key(e.messages) for e in again.held_out}
    assert train <= {prompt_key(e.messages) for e in again.train}


def test_the_held_out_share_is_about_what_was_asked() -> None:
    keys = [prompt_key((("user", f"question {i}"),)) for i in range(4000)]
    for share in (0.1, 0.3):
        held = sum(is_held_out(k, share, seed=0) for k in keys) / len(keys)
        assert abs(held - share) < 0.03
    assert not any(is_held_out(k, 0.0, 0) for k in keys) and all(is_held_out(k, 1.0, 0) for k in keys)
    # Another seed, another split.
    assert [is_held_out(k, 0.5, 0) for k in keys[:64]] != [is_held_out(k, 0.5, 1) for k in keys[:64]]


# -- the store ------------------------------------------------------------------------------------

def answer(response_id: str, tenant: str = "acme", **fields: object) -> kept_answers.Answer:
    values = {"route": "auto", "model": "big", "family": None, "messages": [{"role": "user", "content": "q " + response_id}],
              "answer": "a", "finish_reason": "stop", "validator": None, **fields}
    return kept_answers.Answer(tenant, response_id, **values)  # type: ignore[arg-type]


def test_the_store_keeps_rates_and_retires() -> None:
    db = connect(":memory:")
    migrate(db)
    kept_answers.keep(db, answer("r1", family="factual"), retention_s=100, now=1000)
    kept_answers.keep(db, answer("r2"), retention_s=100, now=1050)
    assert kept_answers.rate(db, "acme", "r1", "good")
    assert not kept_answers.rate(db, "zeta", "r1", "bad")  # another tenant's answer is as absent
    assert not kept_answers.rate(db, "acme", "nope", "good")
    rows = kept_answers.since(db, 0)
    assert [(k.response_id, k.rating, k.family, k.messages) for k in rows] == [
        ("r1", "good", "factual", (("user", "q r1"),)), ("r2", None, None, (("user", "q r2"),))]
    assert [k.response_id for k in kept_answers.since(db, 1010)] == ["r2"]
    kept_answers.keep(db, answer("r3"), retention_s=100, now=1120)  # r1 is past retention now
    assert [k.response_id for k in kept_answers.since(db, 0)] == ["r2", "r3"]


def test_the_store_reads_the_cache_entry_verdict() -> None:
    db = connect(":memory:")
    migrate(db)
    store = CacheStore(db, "e", 2)
    bucket = Bucket(tenant="acme", role="dev", model="auto", model_version="v", prompt_version="p")
    entry = store.store(bucket, "q", "h", None, "a", "stop", 1, 1, 0, "r1", 1000, 10)
    assert entry is not None
    store.set_state(entry, "rejected", "admin")
    kept_answers.keep(db, answer("r1"), retention_s=100, now=1000)
    (row,) = kept_answers.since(db, 0)
    assert (row.cache_state, row.cache_reason) == ("rejected", "admin")
    assert verdict(row, "big") is None
