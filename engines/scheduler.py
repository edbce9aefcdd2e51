"""The slot scheduler's bookkeeping as pure functions: which tokens go into the next batch.

Decode tokens of generating slots go first (one each), so generation never waits behind a long
prompt; then prompt chunks of admitted slots, oldest first, under a per-step token budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotView:
    slot: int
    admitted_seq: int  # admission order; lower is older
    prompt_len: int
    n_past: int  # tokens already in the KV cache (prompt, then generated)
    generating: bool  # prompt done, has a sampled token waiting to be decoded


@dataclass(frozen=True)
class BatchItem:
    slot: int
    start: int  # position of the first token of this item in the slot's sequence
    count: int
    is_decode: bool
    wants_logits: bool  # the last token of this item needs logits (decode, or the prompt's end)


def plan_batch(slots: tuple[SlotView, ...], token_budget: int) -> tuple[BatchItem, ...]:
    """One step's batch. Every generating slot decodes; prefill fills what budget is left."""
    items: list[BatchItem] = []
    generating = [s for s in slots if s.generating]
    for s in sorted(generating, key=lambda s: s.slot):
        items.append(BatchItem(s.slot, s.n_past, 1, True, True))
    budget = token_budget - len(items)
    for s in sorted((s for s in slots if not s.generating and s.n_past < s.prompt_len), key=lambda s: s.admitted_seq):
        if budget <= 0:
            break
        count = min(budget, s.prompt_len - s.n_past)
        finishes = s.n_past + count == s.prompt_len
        items.append(BatchItem(s.slot, s.n_past, count, False, finishes))
        budget -= count
    return tuple(items)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Placement:
    slot: int
    reuse: int  # prompt tokens whose KV the slot already holds


def place(free: dict[int, tuple[int, ...]], prompt: tuple[int, ...], min_gain: int = 16) -> Placement:
    """Picks a free slot for a prompt, given the tokens each free slot still holds in its KV.

    The lowest free slot keeps active sequences contiguous (llama.cpp batches consecutive
    sequences together); another slot wins only if it saves at least `min_gain` prompt tokens.
    At least one prompt token is always recomputed, so there are logits to sample from.
    """
    def reuse(slot: int) -> int:
        return min(common_prefix(free[slot], prompt), len(prompt) - 1)

    lowest = min(free)
    best = max(sorted(free), key=reuse)
    chosen = best if reuse(best) - reuse(lowest) >= min_gain else lowest
    return Placement(chosen, reuse(chosen))
