"""The learned router, pure: which tier a request needs, estimated from the labelled requests most
like it. Each labelled request carries its embedding, its features and, per tier, whether that tier
answered it correctly and at what cost (from `appliance eval router` runs). A request's probability of
being answered correctly by a tier is the similarity-weighted share of its nearest labelled requests
that tier got right (RouteLLM's similarity-weighted router), shrunk towards the tier's overall
accuracy when the neighbours are few or far; the route takes the cheapest tier whose probability is
at least `keep` times the best tier's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from policy.router import Features

# The traits of a request that its text's embedding cannot see (a JSON answer is asked for in the
# request's response_format, a conversation's depth in its earlier turns), one column each.
FEATURE_COLUMNS = ("bias", "code", "word_problem", "math", "structured_output", "steps", "chat", "intl", "long")


def feature_vector(f: Features) -> np.ndarray:
    """Unit-length; the constant column keeps a request without any trait comparable."""
    row = np.array([1.0, f.code, f.word_problem, f.math > 0, f.structured_output, f.steps >= 2, f.turns >= 2,
                    f.non_ascii_ratio > 0.3, min(1.0, f.words / 120)], dtype=np.float32)
    return row / np.linalg.norm(row)


@dataclass(frozen=True)
class KnnSettings:
    k: int = 12  # neighbours consulted
    floor: float = 0.35  # cosine of the embeddings below which a labelled request says nothing about this one
    min_neighbours: int = 3  # fewer above the floor: the bucket calibration (or the heuristics) decides
    feature_weight: float = 0.2  # similarity = (1 - w) x cosine of embeddings + w x cosine of features
    sharpness: float = 5.0  # weight exp(sharpness x (similarity - nearest's)): one 0.1 less similar counts 0.6
    prior: float = 0.5  # pseudo-neighbours of the tier's overall accuracy mixed into every estimate
    task: bool = False  # the embedded text starts with the system turn's task line (policy/router_text.py: embedded_text)


@dataclass(frozen=True, eq=False)  # numpy arrays: compared field by field where needed
class Knn:
    """The labelled table. Row i: one request; columns of `correct` and `cost_nanos`: the tiers, cheapest first."""
    embedder: str  # the vector space; a request is embedded by the same embedder
    vectors: np.ndarray  # (n, d) float32, unit rows: embeddings of each request's routing text
    features: np.ndarray  # (n, len(FEATURE_COLUMNS)) float32, unit rows
    correct: np.ndarray  # (n, tiers) bool
    cost_nanos: np.ndarray  # (n, tiers) float64: what each tier's answer cost
    texts: tuple[str, ...]  # each request's routing text, to say in a trace which ones decided
    settings: KnnSettings = KnnSettings()

    @property
    def samples(self) -> int:
        return int(self.correct.shape[0])

    def accuracy(self) -> tuple[float, ...]:
        """Per tier, over the whole table."""
        return tuple(round(float(a), 4) for a in self.correct.mean(axis=0)) if self.samples else ()

    def mean_cost(self) -> tuple[float, ...]:
        return tuple(round(float(c), 1) for c in self.cost_nanos.mean(axis=0)) if self.samples else ()


def train(vectors: np.ndarray, features: np.ndarray, correct: np.ndarray, cost_nanos: np.ndarray, texts: tuple[str, ...],
          embedder: str, settings: KnnSettings = KnnSettings()) -> Knn:
    """A kNN model is its table: training checks the shapes and normalises the rows."""
    n = len(texts)
    if not (vectors.shape[0] == features.shape[0] == correct.shape[0] == cost_nanos.shape[0] == n):
        raise ValueError("every array needs one row per labelled request")
    if correct.ndim != 2 or correct.shape != cost_nanos.shape:
        raise ValueError("correct and cost_nanos need one column per tier")
    return Knn(embedder, _unit(vectors), _unit(features), correct.astype(bool), cost_nanos.astype(np.float64), tuple(texts), settings)


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return (rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)).astype(np.float32)


@dataclass(frozen=True)
class Estimate:
    accuracy: tuple[float, ...]  # P(correct) per tier
    neighbours: int  # labelled requests above the similarity floor that were consulted
    weight: float  # their summed weight (the nearest counts 1)
    nearest: int | None  # row of the most similar labelled request
    similarity: float  # its similarity


def similarities(knn: Knn, vector: np.ndarray, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(of the embeddings alone, combined with the features) for every labelled request."""
    w = knn.settings.feature_weight
    text = knn.vectors @ vector.astype(np.float32)
    return text, (1 - w) * text + w * (knn.features @ features.astype(np.float32))


def estimate(knn: Knn, vector: np.ndarray, features: np.ndarray, leave_out: int | None = None) -> Estimate:
    """P(correct | tier) from the k most similar labelled requests whose text is at least `floor`
    similar (the floor reads the embeddings alone: two requests are not alike for sharing no trait).
    `leave_out`: a row of the table to estimate as if it were not there (a held-out check)."""
    s = knn.settings
    right, n = knn.correct.sum(axis=0), knn.samples
    if leave_out is not None:
        right, n = right - knn.correct[leave_out], n - 1
    prior = (right + 1) / (n + 2)  # smoothed: no tier is certain from a handful
    if n == 0:
        return Estimate(tuple(float(p) for p in prior), 0, 0.0, None, 0.0)
    text, sims = similarities(knn, vector, features)
    if leave_out is not None:
        text[leave_out] = sims[leave_out] = -np.inf
    order = np.argsort(-sims, kind="stable")  # stable: equal similarities keep the table's order
    order = order[text[order] >= s.floor][: s.k]
    if len(order) == 0:
        best = int(np.argmax(sims))
        return Estimate(tuple(round(float(p), 4) for p in prior), 0, 0.0, best, round(float(sims[best]), 4))
    weights = np.exp(s.sharpness * (sims[order] - sims[order[0]]))
    right = weights @ knn.correct[order].astype(np.float64)
    accuracy = (right + s.prior * prior) / (weights.sum() + s.prior)
    return Estimate(tuple(round(float(p), 4) for p in accuracy), len(order), round(float(weights.sum()), 4),
                    int(order[0]), round(float(sims[order[0]]), 4))


def cheapest_within(accuracy: tuple[float, ...], keep: float) -> int:
    """The cheapest tier whose estimated accuracy is at least `keep` times the best tier's: a higher
    `keep` can only move the choice to a dearer tier."""
    best = max(accuracy)
    return next(t for t, a in enumerate(accuracy) if a >= keep * best)
