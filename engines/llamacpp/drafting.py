"""Where a speculating slot's drafts come from: the prompt itself, or a small draft model.

Both are driven by the engine's model thread. A drafter proposes up to k tokens per slot to
follow the slot's pending token; the engine verifies them in the target's batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from engines.interface import EngineError
from engines.llamacpp.runtime import Context, ContextParams, Model
from engines.scheduler import common_prefix
from engines.speculation import NgramLookup, StepCost

log = logging.getLogger("appliance.llamacpp")


@dataclass
class DraftState:
    """Per request; owned by the model thread."""

    lookup: NgramLookup | None = None


class Drafter(Protocol):
    kind: str
    # What one drafted token costs before verification (0 for prompt lookup).
    cost_per_token: float
    # What catching up costs per token the drafter has not seen (a draft model's prefill).
    catch_up_cost: float

    def behind(self, slot: int, tokens: int) -> int:
        """How many of the slot's first `tokens` tokens the drafter must still process."""
        ...

    def start(self, slot: int, prompt: tuple[int, ...], reused: int) -> DraftState:
        """A request takes the slot, its first `reused` tokens' KV kept from the slot's last request
        (same prefix scope): a drafter keeps no more of what it held (another scope's prompt)."""
        ...

    def observe(self, state: DraftState, token: int) -> None: ...

    def draft(self, wants: list[tuple[int, DraftState, list[int], int]]) -> dict[int, tuple[int, ...]]:
        """wants: (slot, state, the slot's tokens up to and including its pending one, k)."""
        ...

    def settle(self, slot: int, valid: int) -> None:
        """After verification the target holds `valid` tokens of this slot's sequence."""
        ...

    def calibrate(self) -> None:
        """Measures what a drafted token costs; called on the model thread before serving."""
        ...

    def close(self) -> None: ...


class PromptLookupDrafter:
    kind = "prompt_lookup"
    cost_per_token = 0.0
    catch_up_cost = 0.0

    def behind(self, slot: int, tokens: int) -> int:
        return 0

    def start(self, slot: int, prompt: tuple[int, ...], reused: int) -> DraftState:
        return DraftState(NgramLookup(prompt))

    def observe(self, state: DraftState, token: int) -> None:
        assert state.lookup is not None
        state.lookup.append(token)

    def draft(self, wants: list[tuple[int, DraftState, list[int], int]]) -> dict[int, tuple[int, ...]]:
        out = {}
        for slot, state, _, k in wants:
            assert state.lookup is not None
            out[slot] = state.lookup.draft(k)
        return out

    def settle(self, slot: int, valid: int) -> None:
        pass

    def calibrate(self) -> None:
        pass

    def close(self) -> None:
        pass


def check_same_vocabulary(target: Model, draft: Model) -> None:
    """A draft model must tokenize like the target, or its tokens mean nothing to the target."""
    problem = None
    if target.n_vocab != draft.n_vocab:
        problem = f"{target.n_vocab} tokens in the target's vocabulary, {draft.n_vocab} in the draft's"
    else:
        for token in range(target.n_vocab):
            if target.piece(token, special=True) != draft.piece(token, special=True):
                problem = f"token {token} is {target.piece(token, special=True)!r} in the target, {draft.piece(token, special=True)!r} in the draft"
                break
    if problem:
        raise EngineError(f"draft model {draft.path.name} cannot draft for {target.path.name}: {problem}")


class DraftModelDrafter:
    """A small model with the target's vocabulary, one sequence per slot, drafting greedily.

    Each slot's draft sequence follows the target's: before drafting it catches up on the tokens
    the target accepted since (a whole prompt the first time, in chunks under `batch_tokens`),
    then decodes k tokens one batched step at a time for all drafting slots together.
    """

    kind = "draft"

    def __init__(self, path: Path, target: Model, *, slots: int, context_length: int, batch_tokens: int, threads: int) -> None:
        self.model = Model(path)
        try:
            check_same_vocabulary(target, self.model)
            self.ctx = Context(self.model, ContextParams(slots, context_length, batch_tokens, threads, kv_unified=True, flash_attn=True, kv_type="f16"))
        except Exception:
            self.model.close()
            raise
        self.batch_tokens = batch_tokens
        self.held: dict[int, list[int]] = {s: [] for s in range(slots)}
        self.cost_per_token = self.catch_up_cost = 0.0

    def calibrate(self) -> None:
        """Seconds per drafted token (a one-token decode after a 64-token prompt) and per token of
        catching up (that prompt's prefill), medians of three, on the model thread."""
        singles, prefills = [], []
        for _ in range(3):
            start = time.perf_counter()
            self.ctx.decode([(0, i, 0, i == 63) for i in range(64)])
            prefills.append((time.perf_counter() - start) / 64)
            start = time.perf_counter()
            self.ctx.decode([(0, 64, 0, True)])
            singles.append(time.perf_counter() - start)
            self.ctx.clear_sequence(0)
        self.cost_per_token, self.catch_up_cost = sorted(singles)[1], sorted(prefills)[1]
        self.held[0] = []

    def behind(self, slot: int, tokens: int) -> int:
        return max(0, tokens - len(self.held[slot]))

    def start(self, slot: int, prompt: tuple[int, ...], reused: int) -> DraftState:
        held = self.held[slot]
        keep = common_prefix(tuple(held), prompt[:reused])
        del held[keep:]
        self.ctx.trim_sequence(slot, keep)
        return DraftState()

    def observe(self, state: DraftState, token: int) -> None:
        pass

    def draft(self, wants: list[tuple[int, DraftState, list[int], int]]) -> dict[int, tuple[int, ...]]:
        budget = self.batch_tokens
        entries: list[tuple[int, int, int, bool]] = []
        rows: dict[int, int] = {}
        ks: dict[int, int] = {}
        for slot, _, tokens, k in wants:
            held = self.held[slot]
            missing = tokens[len(held) :]
            if not missing or k <= 0:
                continue
            take = missing[:budget]
            for offset, token in enumerate(take):
                entries.append((token, len(held) + offset, slot, False))
            budget -= len(take)
            held.extend(take)
            if len(take) == len(missing):  # caught up: this slot drafts this step
                entries[-1] = entries[-1][:3] + (True,)
                rows[slot] = len(entries) - 1
                ks[slot] = k
            if budget <= 0:
                break
        drafts: dict[int, list[int]] = {slot: [] for slot in rows}
        while rows:
            try:
                self.ctx.decode(entries)
            except EngineError as exc:
                log.warning("draft model failed (%s); verifying without drafts this step", exc)
                for slot in self.held:
                    self.ctx.clear_sequence(slot)
                    self.held[slot] = []
                return {}
            entries, next_rows = [], {}
            for slot, row in rows.items():
                token = int(np.argmax(self.ctx.logits(row)))
                drafts[slot].append(token)
                if len(drafts[slot]) < ks[slot]:
                    entries.append((token, len(self.held[slot]), slot, True))
                    self.held[slot].append(token)
                    next_rows[slot] = len(entries) - 1
            rows = next_rows
        return {slot: tuple(d) for slot, d in drafts.items()}

    def settle(self, slot: int, valid: int) -> None:
        held = self.held[slot]
        if len(held) > valid:
            del held[valid:]
            self.ctx.trim_sequence(slot, valid)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def measure_step_cost(ctx: Context, k: int, passes: int = 3) -> StepCost:
    """The target's decode time for 1 to 1 + k tokens in one sequence, with logits at every
    position (what a verify step asks for), on sequence 0 at load. Passes over every size in turn,
    median per size: a slow moment then touches one sample of several sizes rather than all samples
    of one (a one-token step once measured 135 ms instead of 45, making every draft look cheap).
    The curve is not a line on a CPU (kernels switch at batch sizes), so it is kept as a table; the
    engine corrects it from the steps it serves."""

    def timed(n: int) -> float:
        start = time.perf_counter()
        ctx.decode([(0, i, 0, True) for i in range(n)])
        elapsed = time.perf_counter() - start
        ctx.clear_sequence(0)
        return elapsed

    sizes = range(1, k + 2)
    for n in sizes:  # warm-up: every graph size once
        timed(n)
    samples = [[timed(n) for n in sizes] for _ in range(passes)]
    return StepCost(tuple(sorted(column)[len(column) // 2] for column in zip(*samples)))
