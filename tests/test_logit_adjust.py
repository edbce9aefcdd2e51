"""The logit adjustments every local engine applies (engines/sampling.py), without IO."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engines.interface import SamplingParams
from engines.sampling import LogitAdjuster, adjust_logits

VOCAB = 32
logits_rows = arrays(np.float32, VOCAB, elements=st.floats(-30, 30, width=32))
biases = st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=6)
histories = st.lists(st.integers(0, VOCAB - 1), max_size=40)
penalties = st.floats(-2, 2, width=32)


@given(logits_rows, biases, histories, penalties, penalties)
def test_openai_definition(logits: np.ndarray, bias: dict[int, float], history: list[int], frequency: float, presence: float) -> None:
    sampling = SamplingParams(logit_bias=tuple(sorted(bias.items())), frequency_penalty=frequency, presence_penalty=presence)
    before = logits.copy()
    counts = Counter(history)
    out = adjust_logits(logits, sampling, counts)
    np.testing.assert_array_equal(logits, before)  # the engine's own row is never written
    for token in range(VOCAB):
        c = counts.get(token, 0)
        expected = np.float32(logits[token]) + np.float32(bias.get(token, 0.0))
        expected -= np.float32(c) * np.float32(frequency) + np.float32(c > 0) * np.float32(presence)
        assert abs(out[token] - expected) <= 1e-4 * max(1.0, abs(float(expected)))


@given(logits_rows, histories)
def test_nothing_to_adjust_is_the_identity(logits: np.ndarray, history: list[int]) -> None:
    np.testing.assert_array_equal(adjust_logits(logits, SamplingParams(), Counter(history)), logits)


@given(logits_rows, st.integers(0, VOCAB - 1))
def test_full_bias_decides_greedy(logits: np.ndarray, token: int) -> None:
    forced = adjust_logits(logits, SamplingParams(logit_bias=((token, 100.0),)), {})
    assert int(np.argmax(forced)) == token
    banned = adjust_logits(logits, SamplingParams(logit_bias=((token, -100.0),)), {})
    assert int(np.argmax(banned)) != token


def test_adjuster_counts_what_it_accepts() -> None:
    adjuster = LogitAdjuster(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0))
    row = np.zeros(4, dtype=np.float32)
    for token in (2, 2, 3):
        adjuster.accept(token)
    np.testing.assert_allclose(adjuster(row), [0.0, 0.0, -2.0, -1.5])
    assert SamplingParams().adjusts_logits is False
    assert SamplingParams(presence_penalty=-0.1).adjusts_logits is True
