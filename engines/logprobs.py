"""OpenAI's logprobs for a sampled token, one copy for every local engine: pure functions of a
row of log-probabilities (or of logits, through `log_softmax`) and the tokens' bytes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engines.interface import TokenLogprob, TopLogprob


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities in float64 (a float32 sum over a large vocabulary loses the small ones)."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    top = values.max()
    return values - (top + np.log(np.exp(values - top).sum()))


def top_tokens(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The k most likely tokens, most likely first; among equals the lower id first. Linear in the
    vocabulary (a partition, then a sort of the k), where a full sort costs milliseconds a token."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= len(logprobs):
        return np.argsort(-logprobs, kind="stable")
    kth = np.partition(logprobs, len(logprobs) - k)[len(logprobs) - k]  # the k-th largest value
    above = np.flatnonzero(logprobs > kth)
    ties = np.flatnonzero(logprobs == kth)[: k - len(above)]
    best = np.concatenate([above, ties])
    return best[np.argsort(-logprobs[best], kind="stable")]


def token_logprob(logprobs: np.ndarray, token: int, k: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The sampled token's log-probability and the `k` most likely alternatives, each with its bytes."""

    def entry(t: int) -> tuple[str, bytes]:
        data = piece(t)
        return data.decode("utf-8", errors="replace"), data

    tops = tuple(TopLogprob(*entry(int(t)), float(logprobs[t])) for t in top_tokens(logprobs, k))
    return TokenLogprob(*entry(token), float(logprobs[token]), tops)
