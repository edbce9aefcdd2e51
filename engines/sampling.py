"""OpenAI's logit adjustments (logit_bias, frequency_penalty, presence_penalty), one copy for
every local engine: a pure function of a row of logits and the tokens the completion has
generated so far, applied before the sampler chain (grammar, top-p, temperature, draw).

They depend on nothing but the request's own logits and history, so a request's output stays
independent of what shares its batch, and greedy decoding with them is still deterministic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np

from engines.interface import SamplingParams


def adjust_logits(logits: np.ndarray, sampling: SamplingParams, counts: Mapping[int, int]) -> np.ndarray:
    """A new row: logit_bias added, then, for each token generated `c > 0` times in this completion,
    `c * frequency_penalty + presence_penalty` subtracted (OpenAI's definition). `logits` is not changed."""
    out = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
    if sampling.logit_bias:
        ids = np.fromiter((t for t, _ in sampling.logit_bias), dtype=np.int64, count=len(sampling.logit_bias))
        out[ids] += np.fromiter((b for _, b in sampling.logit_bias), dtype=np.float32, count=len(ids))
    if counts and (sampling.frequency_penalty or sampling.presence_penalty):
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        seen = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        out[ids] -= seen * np.float32(sampling.frequency_penalty) + (seen > 0) * np.float32(sampling.presence_penalty)
    return out


class LogitAdjuster:
    """One completion's adjustments: the pure function plus the counts it needs, fed with each
    token as it is sampled (every sampled token, end-of-generation included, as OpenAI counts them)."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.counts: Counter[int] = Counter()

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        return adjust_logits(logits, self.sampling, self.counts)

    def accept(self, token: int) -> None:
        self.counts[token] += 1
