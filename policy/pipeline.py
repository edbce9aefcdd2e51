"""The request pipeline's seam: what the API asks policy before and after a model call.

Today it only decides which loaded model serves a request; identity, limits, the semantic cache,
budgets and the router plug in here as plain functions over these values (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestFacts:
    endpoint: str  # "chat", "completion", "embeddings"
    model: str  # the alias the client asked for
    user: str | None = None


@dataclass(frozen=True)
class Route:
    model: str


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    param: str | None
    code: str


def decide(facts: RequestFacts, served: frozenset[str]) -> Route | Refusal:
    """Pure: the model to run, or why not."""
    if facts.model not in served:
        return Refusal(404, f"The model '{facts.model}' does not exist.", "model", "model_not_found")
    return Route(facts.model)
