"""What every embedding engine shares, as plain functions: the length check, packing a request's
inputs into forward passes, running those passes one at a time, pooling token states, and
finishing vectors (truncation, L2)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from engines.interface import ContextLengthExceeded, EngineError

POOLINGS = ("mean", "cls", "last")


def resolve_pooling(configured: str, declared: str | None) -> str:
    """The pooling to run: the configured one, or with "auto" the one the model file declares;
    mean for a model that declares none (a chat model served for embeddings)."""
    if configured != "auto":
        return configured
    if declared == "rank":
        raise EngineError("the model declares rank pooling: it is a reranker, not an embedding model")
    return declared if declared in POOLINGS else "mean"


def check_lengths(inputs: Sequence[Sequence[int]], limit: int) -> None:
    """Refuses the first input longer than the model takes: an embedding is never of a truncated text."""
    for i, tokens in enumerate(inputs):
        if len(tokens) > limit:
            where = f"input[{i}]" if len(inputs) > 1 else "the input"
            raise ContextLengthExceeded(f"{where} has {len(tokens)} tokens; this embedding model takes at most {limit}")


def pack(lengths: Sequence[int], *, max_tokens: int, max_rows: int, padded: bool) -> list[list[int]]:
    """Input indexes grouped into forward passes, as few as the limits allow: at most `max_rows`
    inputs and `max_tokens` tokens each, counted as rows x longest when inputs are padded to one
    length. Longest first, so inputs of like length share a pass and padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    used = 0
    for i in order:
        n = max(1, lengths[i])
        group = groups[-1] if groups else None
        if group is not None and len(group) < max_rows:
            # Sorted longest first, so a padded group's width is its first input's length.
            cost = (len(group) + 1) * max(1, lengths[group[0]]) if padded else used + n
            if cost <= max_tokens:
                group.append(i)
                used = cost
                continue
        groups.append([i])
        used = n
    return groups


def place(out: np.ndarray | None, count: int, group: Sequence[int], rows: np.ndarray) -> np.ndarray:
    """A pass's rows put at its inputs' places in the request's (count, width) result, made on the first pass."""
    if out is None:
        out = np.empty((count, rows.shape[1]), dtype=np.float32)
    out[list(group)] = rows
    return out


async def embed_in_passes(inputs: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                          run: Callable[[list[Sequence[int]]], Awaitable[np.ndarray]]) -> np.ndarray:
    """A request's passes, each asked for only when the one before has returned: other requests'
    passes queue between them on the model's one thread, so requests take turns pass by pass and
    none holds the model for all its inputs; a caller cancelled (a client gone) stops at the next pass."""
    out = None
    for group in groups:
        out = place(out, len(inputs), group, await run([inputs[i] for i in group]))
    if out is None:
        raise EngineError("no inputs to embed")
    return out


def pool(hidden: np.ndarray, mask: np.ndarray, how: str) -> np.ndarray:
    """(batch, tokens, width) token states to (batch, width): `mask` marks real tokens (1) and
    padding (0), padding on the right."""
    if how == "cls":
        return hidden[:, 0, :]
    if how == "last":
        last = np.maximum(mask.sum(axis=1) - 1, 0)
        return hidden[np.arange(hidden.shape[0]), last, :]
    if how != "mean":
        raise ValueError(f"unknown pooling {how!r}")
    weights = mask[:, :, None].astype(np.float32)
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


def finish(rows: np.ndarray, *, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """The vectors a caller gets: the first `dimensions` components (Matryoshka truncation), then
    unit length if the model's vectors are compared by cosine, as float32."""
    out = np.asarray(rows, dtype=np.float32)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)
