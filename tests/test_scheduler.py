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


slot_views = st.builds(
    lambda slot, seq, plen, past, gen: SlotView(slot, seq, plen, min(past, plen) if not gen else plen + past, gen),
    st.integers(0, 31), st.integers(0, 1000), st.integers(1, 3000), st.integers(0, 3000), st.booleans(),
)


@given(st.lists(slot_views, max_size=12, unique_by=lambda s: s.slot), st.integers(1, 2048))
def test_plan_respects_budget_and_covers_every_decode(slots, budget):
    plan = plan_batch(tuple(slots), budget)
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
    assert context_layout(False, "f16") == (True, True)


def test_place_prefers_lowest_slot_unless_a_prefix_saves_enough():
    from engines.scheduler import Placement, place

    prompt = tuple(range(100))
    assert place({0: (), 3: tuple(range(50))}, prompt) == Placement(3, 50)
    assert place({0: tuple(range(10)), 3: tuple(range(20))}, prompt, min_gain=16) == Placement(0, 10)
    # a fully cached prompt still recomputes its last token
    assert place({2: tuple(range(100)) + (7, 8)}, prompt) == Placement(2, 99)
    assert place({1: (5, 6)}, prompt) == Placement(1, 0)
