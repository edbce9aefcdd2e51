"""Speculative decoding's bookkeeping, pure: where drafts come from and how long they should be.

A slot that speculates puts its pending token and k drafted tokens into the step's batch, with
logits at every position; it then samples position by position and keeps drafted tokens while
they agree with what it sampled. Greedy output is therefore the same token for token, and sampled
output has the same distribution (each kept token was sampled from the target model).
"""

from __future__ import annotations

from dataclasses import dataclass


class NgramLookup:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (longest n first). Pays off when the output repeats the prompt: edits,
    extraction, code."""

    def __init__(self, tokens: tuple[int, ...] = (), n_max: int = 3, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        end = len(self.tokens)
        for n in range(1, self.n_max + 1):
            if end >= n:
                self._next[tuple(self.tokens[end - n :])] = end
        self.tokens.append(token)

    def draft(self, k: int) -> tuple[int, ...]:
        if k <= 0:
            return ()
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(self.tokens) < n:
                continue
            at = self._next.get(tuple(self.tokens[-n:]))
            if at is not None:
                return tuple(self.tokens[at : at + k])
        return ()


@dataclass(frozen=True)
class StepCost:
    """Decode time by tokens in the batch: `seconds[n - 1]` for n tokens, each with logits (what a
    verify step asks for). Measured at load and kept current by what the engine's steps take, since
    a few noisy samples at load (or other work on the machine since) must not make long drafts look
    cheap. Beyond the table, the last step's slope continues."""

    seconds: tuple[float, ...]
    # Observations behind each entry; the measurement at load counts as one.
    samples: tuple[int, ...] = ()

    def __call__(self, tokens: int) -> float:
        table = self.seconds
        if tokens <= 0:
            return 0.0
        if tokens <= len(table):
            return max(table[:tokens])  # more tokens never cost less: a low sample is noise
        top = max(table)
        slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return top + max(slope, 0.0) * (tokens - len(table))

    def observe(self, tokens: int, seconds: float, weight: float = 0.2) -> StepCost:
        """This table after a step of `tokens` tokens took `seconds`: the mean of an entry's first
        observations, then a moving average, so a rarely seen size (a long verify) is corrected by
        its first few steps and a common one follows the machine."""
        if not 0 < tokens <= len(self.seconds) or seconds <= 0:
            return self
        table = list(self.seconds)
        counts = list(self.samples) if len(self.samples) == len(table) else [1] * len(table)
        counts[tokens - 1] += 1
        table[tokens - 1] += max(weight, 1.0 / counts[tokens - 1]) * (seconds - table[tokens - 1])
        return StepCost(tuple(table), tuple(counts))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step yields with k drafts when each is accepted with this probability
    (the first rejection ends the run; the sampled token at that position is kept)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def draft_length(acceptance: float, cost: StepCost, batch_tokens: int, k_max: int, draft_cost: float = 0.0,
                 setup_s: float = 0.0, tokens_left: int | None = None) -> int:
    """How many tokens to draft for one slot, 0 when speculation would not pay.

    A step of `batch_tokens` tokens (one per decoding slot) takes cost(batch_tokens) and yields
    that many tokens. k drafts make it take cost(batch_tokens + k), plus `draft_cost` each to make
    them (a draft model's decode; nothing for prompt lookup). Speculation pays when the extra
    tokens it is expected to yield come faster than the step's own rate.
    """
    if k_max <= 0 or not cost.seconds:
        return 0
    base = cost(batch_tokens)
    rate = batch_tokens / base if base > 0 else 0.0
    best_k, best_gain = 0, 0.0
    for k in range(1, k_max + 1):
        extra_tokens = expected_tokens(acceptance, k) - 1.0
        extra_time = cost(batch_tokens + k) - base + draft_cost * k
        if setup_s:
            steps = max(1.0, tokens_left / expected_tokens(acceptance, k)) if tokens_left else 1.0
            extra_time += setup_s / steps
        gain = extra_tokens - rate * extra_time  # tokens won beyond what the time would give anyway
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


@dataclass(frozen=True)
class Acceptance:
    """A decayed count of accepted and rejected drafts, with a uniform prior."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    @property
    def cautious(self) -> float:
        """One standard deviation below the rate (Beta posterior): a rejected verify costs several
        steps, so little evidence must not buy long drafts."""
        a, b = self.accepted + 1.0, self.rejected + 1.0
        spread = (a * b / ((a + b) ** 2 * (a + b + 1.0))) ** 0.5
        return max(0.0, self.rate - spread)

    def prior(self, weight: float = 2.0) -> Acceptance:
        """This estimate's rate as a light prior for a new request: its own drafts soon outweigh it."""
        return Acceptance(self.rate * weight, (1.0 - self.rate) * weight)

    def update(self, drafted: int, kept: int, decay: float = 0.9) -> Acceptance:
        # One verify is a run of `kept` successes ended by one failure, unless all were kept.
        return Acceptance(self.accepted * decay + kept, self.rejected * decay + (1 if kept < drafted else 0))
