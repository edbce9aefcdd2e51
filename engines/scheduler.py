"""The slot scheduler's bookkeeping as pure functions: which tokens go into the next batch.

Decode tokens of generating slots go first (one each), so generation never waits behind a long
prompt; then prompt chunks of admitted slots, oldest first, under a per-step token budget and a
limit on how many prompts a step advances.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotView:
    slot: int
    admitted_seq: int  # admission order; lower is older
    prompt_len: int
    n_past: int  # tokens already in the KV cache (prompt, then generated)
    generating: bool  # prompt done, has a sampled token waiting to be decoded
    drafted: int = 0  # drafted tokens to verify after the pending one (speculative decoding)


@dataclass(frozen=True)
class BatchItem:
    slot: int
    start: int  # position of the first token of this item in the slot's sequence
    count: int
    is_decode: bool
    wants_logits: bool  # the last token of this item needs logits (decode, or the prompt's end)
    # a decode's pending token followed by drafted ones: every position needs logits
    drafted: int = 0


def plan_batch(slots: tuple[SlotView, ...], token_budget: int, max_prefills: int = 0) -> tuple[BatchItem, ...]:
    """One step's batch. Every generating slot decodes (with its drafts, which the engine sizes to
    fit the budget); prefill fills what budget is left, oldest prompt first, leaving at most
    `max_prefills` prompts unfinished (0: no limit). Where prompt tokens cost the same alone or
    together (a CPU), finishing long prompts one after another instead of all together at the end
    is the same work with about half the median wait for a first token; short prompts that finish
    within the step's budget all join it, so a burst of them gets its first tokens in one step."""
    items: list[BatchItem] = []
    generating = [s for s in slots if s.generating]
    for s in sorted(generating, key=lambda s: s.slot):
        items.append(BatchItem(s.slot, s.n_past, 1 + s.drafted, True, True, s.drafted))
    budget = token_budget - sum(i.count for i in items)
    prompts = sorted((s for s in slots if not s.generating and s.n_past < s.prompt_len), key=lambda s: s.admitted_seq)

    def take(s: SlotView) -> None:
        nonlocal budget
        count = min(budget, s.prompt_len - s.n_past)
        items.append(BatchItem(s.slot, s.n_past, count, False, s.n_past + count == s.prompt_len))
        budget -= count

    # The oldest prompt first, whatever its length; then the younger ones that finish in what is
    # left; then what is still left starts the next, up to `max_prefills` left unfinished.
    if prompts and budget > 0:
        take(prompts[0])
    rest = prompts[1:]
    for s in rest:
        if 0 < s.prompt_len - s.n_past <= budget:
            take(s)
    unfinished = sum(not i.is_decode and not i.wants_logits for i in items)
    for s in rest:
        if budget <= 0 or (max_prefills and unfinished >= max_prefills):
            break
        if all(i.slot != s.slot for i in items):
            take(s)
            unfinished += 1
    return tuple(items)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Source:
    """Somewhere else the prompt's prefix lives: another slot, or a sequence saved in host RAM."""

    holder: Hashable
    length: int  # leading prompt tokens it shares
    ready: int  # of those, how many it holds now (a slot still prefilling holds fewer)

    @property
    def usable(self) -> int:
        return min(self.length, self.ready)


@dataclass(frozen=True)
class Admission:
    slot: int
    reuse: int  # prompt tokens the chosen slot already holds
    # Copy this source's prefix into the slot (ready), or park until it is ready (wait).
    source: Source | None = None
    wait: bool = False


def plan_admission(
    free: dict[int, int], sources: list[Source], prompt_len: int, *, min_gain: int = 16, copy_min: int = 64
) -> Admission:
    """Picks a free slot and where its prompt's prefix comes from.

    `free` maps each free slot to the prompt tokens its KV already shares. The lowest free slot
    keeps active sequences contiguous (llama.cpp batches consecutive sequences together); another
    wins only by saving `min_gain` tokens. A copy from elsewhere must save `copy_min` tokens to pay
    for moving the KV; waiting for a slot that is still prefilling the same prefix wins when it
    will save `copy_min` more than anything available now. At least one prompt token is always
    recomputed, so there are logits to sample from.
    """
    cap = max(0, prompt_len - 1)

    def own(slot: int) -> int:
        return min(free[slot], cap)

    lowest = min(free)
    best = max(sorted(free), key=own)
    slot = best if own(best) - own(lowest) >= min_gain else lowest
    reuse = own(slot)
    capped = [Source(s.holder, min(s.length, cap), s.ready) for s in sources]
    now = max(capped, key=lambda s: s.usable, default=None)
    now_len = max(reuse, now.usable if now else 0)
    later = max((s for s in capped if s.ready < s.length), key=lambda s: s.length, default=None)
    if later is not None and later.length - now_len >= copy_min:
        return Admission(slot, reuse, later, wait=True)
    if now is not None and now.usable - reuse >= copy_min:
        return Admission(slot, reuse, Source(now.holder, now.usable, now.usable))
    return Admission(slot, reuse)
