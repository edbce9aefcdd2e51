"""Embedding inputs with a model: every input tokenized, checked, and embedded by the model's
engine (one forward pass per group that fits, engines/embedding.py), then shortened and normalised
as the model's settings say, admitted and settled as any call is. Requests take turns on the model
pass by pass, and a client that goes away stops its request at the next pass. The wire (OpenAI's
/v1/embeddings, Ollama's /api/embed) is the caller's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.config.settings import ModelSettings
from appliance.fleet.registry import LoadedModel
from appliance.pipeline.call import engine_refusal, until_disconnect
from appliance.pipeline.context import CallContext
from appliance.pipeline.errors import APIError, invalid
from appliance.pipeline.models import resolve_model
from appliance.pipeline.prepare import check_token_ids
from appliance.server.services import price_of
from engines.embedding import finish
from engines.interface import EngineError

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def inputs_of(raw: str | list[Any]) -> list[str | list[int]]:
    """The request's inputs: a string, a list of strings, one token array, or a list of token
    arrays, as OpenAI takes them. Refuses an empty or mixed list, an empty input, too many inputs."""
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [list(raw)]
    elif all(isinstance(x, str) for x in raw) or all(isinstance(x, list) for x in raw):
        inputs = list(raw)
    else:
        raise invalid("'input' must be a string, a list of strings, a list of token ids, or a list of token-id lists.", "input")
    if not inputs:
        raise invalid("'input' must not be an empty list.", "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"'input' has {len(inputs)} items; at most {MAX_INPUTS} are taken in one request.", "input")
    empty = next((i for i, x in enumerate(inputs) if len(x) == 0), None)
    if empty is not None:
        where = f"input[{empty}]" if len(inputs) > 1 else "input"
        raise invalid(f"'{where}' is empty; every input needs at least one character or token.", "input")
    return inputs


def check_dimensions(dimensions: int | None, model: ModelSettings) -> None:
    """`dimensions` before the model runs: only a model declared Matryoshka-trained may shorten its vectors."""
    if dimensions is None:
        return
    if not model.matryoshka:
        raise invalid(f"The model '{model.alias}' does not support 'dimensions': its vectors cannot be shortened.", "dimensions")
    if dimensions < 1:
        raise invalid("'dimensions' must be at least 1.", "dimensions")


def _tokens(model: LoadedModel, inputs: list[str | list[int]]) -> list[list[int]]:
    """Token arrays as given; text with the model's own special tokens (BERT's [CLS] and [SEP])."""
    engine = model.engine
    out = [x if isinstance(x, list) else engine.tokenize(x, add_special=True, parse_special=False) for x in inputs]
    for tokens in out:
        check_token_ids(tokens, engine.vocab_size(), "input")
    return out



@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # one row per input
    model: str  # the alias that embedded them
    prompt_tokens: int


async def embed(ctx: CallContext, model_name: str, raw_input: str | list[Any], dimensions: int | None) -> Embedded:
    """The inputs' vectors, charged for their tokens; ends the trace (no stream outlives the handler)."""
    services, principal, request_id = ctx.services, ctx.principal, ctx.request_id
    model = resolve_model(services, model_name, "embedding")
    check_dimensions(dimensions, model.settings)
    inputs = inputs_of(raw_input)
    token_lists = await asyncio.to_thread(_tokens, model, inputs)  # thousands of inputs take a while
    prompt_tokens = sum(len(t) for t in token_lists)
    alias = model.settings.alias
    ctx.trace.annotate(model=alias, inputs=len(inputs))
    ctx.trace.answered(request_id, alias, None, prompt_tokens)
    admission = await services.gate.admit(principal, request_id, alias, price_of(model), prompt_tokens, 0)
    outcome = "refused"
    try:
        rows = await until_disconnect(ctx.receive, model.engine.embed(token_lists))
        if dimensions is not None and dimensions > rows.shape[1]:
            raise invalid(f"'dimensions' must be at most {rows.shape[1]} for the model '{alias}'.", "dimensions")
        outcome = "stop"
    except EngineError as exc:
        raise engine_refusal(exc, "input") from None
    except APIError as exc:
        if exc.code == "client_closed":
            outcome = "cancelled"  # the inputs were taken: paid for, as a chat prompt is when its client leaves
        raise
    finally:
        services.gate.settle(admission, 0 if outcome == "refused" else prompt_tokens, 0, outcome)
    vectors = finish(rows, normalize=model.settings.normalize, dimensions=dimensions)
    services.metrics.prompt_tokens.labels(alias).inc(prompt_tokens)
    services.metrics.requests.labels(alias, "embeddings", "ok").inc()
    ctx.trace.end()  # no stream outlives the handler: the trace ends with it
    return Embedded(vectors, alias, prompt_tokens)
