"""The slot scheduler's batch planning, pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engines.scheduler import SlotView, plan_batch


def test_decodes_go_first_then_prefill_oldest_first_under_budget():
    slots = (
        SlotView(slot=2, admitted_seq=5, prompt_len=100, n_past=0, generating=False),
        SlotView(slot=0, admitted_seq=1, prompt_len=10, n_past=30, generating=True),
        SlotView(slot=1, admitted_seq=3, prompt_len=50, n_past=20, generating=False),
    )
    plan = plan_batch(slots, token_budget=40)
    assert [(i.slot, i.start, i.count, i.is_decode, i.wants_logits) for i in plan] == [
        (0, 30, 1, True, True),
        (1, 20, 30, False, True),  # finishes its prompt: needs logits
        (2, 0, 9, False, False),
    ]


def test_a_long_prompt_never_blocks_decodes():
    slots = tuple(SlotView(s, s, 5, 10 + s, True) for s in range(4)) + (SlotView(9, 0, 5000, 0, False),)
    plan = plan_batch(slots, token_budget=8)
    assert sum(i.is_decode for i in plan) == 4
    assert sum(i.count for i in plan) == 8


def test_long_prompts_finish_one_after_another():
    slots = tuple(SlotView(s, s, 700, 0, False) for s in range(4)) + (SlotView(9, 0, 10, 10, True),)
    serial = plan_batch(slots, token_budget=512, max_prefills=1)
    assert [(i.slot, i.count, i.wants_logits) for i in serial] == [(9, 1, True), (0, 511, False)]
    # the oldest finishes, and the rest of the budget starts the next one
    then = plan_batch((SlotView(0, 0, 700, 511, False), *slots[1:]), token_budget=512, max_prefills=1)
    assert [(i.slot, i.count, i.wants_logits) for i in then] == [(9, 1, True), (0, 189, True), (1, 322, False)]
    together = plan_batch(slots, token_budget=4096, max_prefills=0)
    assert [i.slot for i in together if not i.is_decode] == [0, 1, 2, 3]
    # A prompt longer than the budget still takes the whole budget, alone.
    long = plan_batch((SlotView(0, 0, 5000, 100, False), SlotView(1, 1, 10, 0, False)), token_budget=512, max_prefills=1)
    assert [(i.slot, i.start, i.count) for i in long] == [(0, 100, 512)]


def test_short_prompts_that_fit_share_one_step():
    # eight 20-token prompts arriving together all get their first token after one step
    burst = tuple(SlotView(s, s, 20, 0, False) for s in range(8))
    plan = plan_batch(burst, token_budget=512, max_prefills=1)
    assert [(i.slot, i.count, i.wants_logits) for i in plan] == [(s, 20, True) for s in range(8)]
    # behind a long prompt that leaves budget, a short one that fits still joins; a long one does not
    mixed = (SlotView(0, 0, 400, 0, False), SlotView(1, 1, 300, 0, False), SlotView(2, 2, 50, 0, False))
    assert [(i.slot, i.count) for i in plan_batch(mixed, token_budget=512, max_prefills=1)] == [(0, 400), (2, 50), (1, 62)]


slot_views = st.builds(
    lambda slot, seq, plen, past, gen: SlotView(slot, seq, plen, min(past, plen) if not gen else plen + past, gen),
    st.integers(0, 31), st.integers(0, 1000), st.integers(1, 3000), st.integers(0, 3000), st.booleans(),
)


@given(st.lists(slot_views, max_size=12, unique_by=lambda s: s.slot), st.integers(1, 2048), st.integers(0, 3))
def test_plan_respects_budget_and_covers_every_decode(slots, budget, max_prefills):
    plan = plan_batch(tuple(slots), budget, max_prefills)
    if max_prefills:
        assert sum(not i.is_decode and not i.wants_logits for i in plan) <= max_prefills
    decoding = {s.slot for s in slots if s.generating}
    assert {i.slot for i in plan if i.is_decode} == decoding
    prefill_tokens = sum(i.count for i in plan if not i.is_decode)
    assert prefill_tokens <= max(0, budget - len(decoding))
    for item in plan:
        view = next(s for s in slots if s.slot == item.slot)
        if not item.is_decode:
            assert item.start == view.n_past and item.start + item.count <= view.prompt_len
            assert item.wants_logits == (item.start + item.count == view.prompt_len)


def test_context_layout_keeps_invariance_rules():
    from engines.llamacpp.engine import context_layout

    # invariant: one KV stream per sequence; flash attention only with a quantized cache
    assert context_layout(True, "q8_0") == (False, True)
    assert context_layout(True, "f16") == (False, False)
    # otherwise: flash attention, one stream per sequence unless the slots share a smaller pool
    assert context_layout(False, "f16") == (False, True)
    assert context_layout(False, "f16", pooled=True) == (True, True)


def test_admission_prefers_lowest_slot_unless_a_prefix_saves_enough():
    from engines.scheduler import Admission, plan_admission

    assert plan_admission({0: 0, 3: 50}, [], 100) == Admission(3, 50)
    assert plan_admission({0: 10, 3: 20}, [], 100, min_gain=16) == Admission(0, 10)
    # a fully cached prompt still recomputes its last token
    assert plan_admission({2: 102}, [], 100) == Admission(2, 99)
    assert plan_admission({1: 0}, [], 100) == Admission(1, 0)


def test_admission_copies_waits_or_computes():
    from engines.scheduler import Admission, Source, plan_admission

    busy_done = Source("slot 5", length=1500, ready=1700)  # holds the prefix already
    busy_prefilling = Source("slot 6", length=1500, ready=300)
    host = Source("host 1", length=800, ready=800)
    # copy what is there now
    assert plan_admission({0: 0}, [busy_done, host], 1600) == Admission(0, 0, Source("slot 5", 1500, 1500))
    # the slot still prefilling the same prompt will save more than the host entry: wait for it
    assert plan_admission({0: 0}, [busy_prefilling, host], 1600) == Admission(0, 0, busy_prefilling, wait=True)
    # not worth moving KV for a few tokens
    assert plan_admission({0: 40}, [Source("slot 1", 90, 90)], 1600, copy_min=64) == Admission(0, 40)
    # the copied length never covers the prompt's last token
    got = plan_admission({0: 0}, [Source("slot 1", 500, 500)], 500)
    assert got.source is not None and got.source.usable == 499


@given(
    st.dictionaries(st.integers(0, 7), st.integers(0, 3000), min_size=1),
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), max_size=6),
    st.integers(1, 3000),
)
def test_admission_never_plans_past_the_prompt(free, raw_sources, prompt_len):
    from engines.scheduler import Source, plan_admission

    sources = [Source(i, length, ready) for i, (length, ready) in enumerate(raw_sources)]
    got = plan_admission(free, sources, prompt_len)
    assert got.slot in free
    assert got.reuse <= min(free[got.slot], prompt_len - 1)
    if got.source is not None:
        assert got.source.length <= prompt_len - 1
        assert got.wait == (got.source.ready < got.source.length)
        assert (got.source.length if got.wait else got.source.usable) > got.reuse
