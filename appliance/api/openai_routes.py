"""The OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions,
/v1/embeddings."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post

from appliance.api import call, render
from appliance.api.common import authenticate, decode_body
from appliance.api.errors import APIError, invalid
from appliance.api.headers import new_request_id, request_id_of
from appliance.api.flow import annotate_principal, guard, model_with_adapters, resolve_model, serve_chat, with_adapters
from appliance.api.routed import route_meta
from appliance.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from appliance.api.translate import check_token_ids, prepare_completion
from appliance.services import Services, price_of
from appliance.tracing import RequestTrace
from engines.base import ContextLengthExceeded


@get("/v1/models")
async def list_models(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await authenticate(request, services)
    listing = render.model_list(services.registry.all(), services.started_at)
    for model in services.registry.all():
        for adapter in model.engine.adapters():
            listing["data"].append({"id": f"{model.settings.alias}:{adapter.name}", "object": "model", "created": services.started_at,
                                    "owned_by": "appliance-adapter", "meta": {"base": model.settings.alias, "scale": adapter.scale}})
    listing["data"] += [{"id": r.alias, "object": "model", "created": services.started_at, "owned_by": "appliance-route",
                         "meta": route_meta(r)}
                        for r in services.settings.routes]
    return listing


@get("/v1/models/{model_id:str}")
async def retrieve_model(request: Request[Any, Any, Any], services: Services, model_id: str) -> dict[str, Any]:
    await authenticate(request, services)
    model = services.registry.get(model_id)
    if model is None:
        raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return render.model_entry(model, services.started_at)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    request_id = new_request_id(request, "chatcmpl")
    traced = RequestTrace(services.tracing, "chat", request.headers, request__id=request_id)
    try:
        with traced.child("auth"):
            principal = await authenticate(request, services)
        annotate_principal(traced, principal)
        body = decode_body(await request.body(), ChatCompletionRequest)
        traced.requested(body)
        wire_for = render.chat_wire("chat", body.stream_options)
        return traced.stamp(await serve_chat(request, services, principal, body, request_id, traced, wire_for))
    except BaseException as exc:
        traced.fail(exc)
        traced.end()
        raise


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    request_id = new_request_id(request, "cmpl")
    traced = RequestTrace(services.tracing, "text_completion", request.headers, request__id=request_id)
    try:
        principal = await authenticate(request, services)
        annotate_principal(traced, principal)
        body = decode_body(await request.body(), CompletionRequest)
        traced.requested(body)
        await guard(services, traced, [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)],
                    principal, request_id)
        model, adapters = model_with_adapters(services, body.model, body.adapters, "completion")
        traced.annotate(model=model.settings.alias, stream=body.stream, end_user=body.user)
        prepared = with_adapters(prepare_completion(body, model, services.settings.defaults, request_id), adapters)
        wire_for = render.chat_wire("completion", body.stream_options)
        return traced.stamp(await call.respond(request, services, principal, model, prepared, body.stream, "completion", wire_for, traced))
    except BaseException as exc:
        traced.fail(exc)
        traced.end()
        raise


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    traced = RequestTrace(services.tracing, "embeddings", request.headers, request__id=new_request_id(request, "emb"))
    try:
        response = await _embeddings(request, services, traced)
    except BaseException as exc:
        traced.fail(exc)
        raise
    finally:
        traced.end()
    return traced.stamp(response)


async def _embeddings(request: Request[Any, Any, Any], services: Services, traced: RequestTrace) -> Response[Any]:
    principal = await authenticate(request, services)
    annotate_principal(traced, principal)
    body = decode_body(await request.body(), EmbeddingRequest)
    traced.requested(body)
    model = resolve_model(services, body.model, "embedding", "embeddings")
    if body.dimensions is not None:
        raise invalid("This model does not support choosing dimensions.", "dimensions")
    raw = body.input
    if isinstance(raw, str):
        texts: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        texts = [list(raw)]  # type: ignore[arg-type]
    elif all(isinstance(x, (str, list)) for x in raw):
        texts = list(raw)  # type: ignore[arg-type]
    else:
        raise invalid("'input' must be a string, a list of strings, a list of token ids, or a list of those lists.", "input")
    if not texts or any(len(t) == 0 for t in texts):
        raise invalid("'input' must be a non-empty string or a list of non-empty inputs.", "input")
    engine = model.engine
    token_lists = [t if isinstance(t, list) else engine.tokenize(t, add_special=engine.add_bos(), parse_special=False) for t in texts]
    for tokens in token_lists:
        check_token_ids(tokens, engine.vocab_size(), "input")
    prompt_tokens = sum(len(t) for t in token_lists)
    request_id = request_id_of(request.scope)
    traced.annotate(model=model.settings.alias, inputs=len(texts))
    traced.answered(request_id, model.settings.alias, None, prompt_tokens)
    admission = await services.gate.admit(principal, request_id, model.settings.alias, price_of(model), prompt_tokens, 0)
    outcome = "refused"
    try:
        vectors = await engine.embed(token_lists)
        outcome = "stop"
    except ContextLengthExceeded as exc:
        raise APIError(400, str(exc), param="input", code="context_length_exceeded") from None
    finally:
        services.gate.settle(admission, prompt_tokens if outcome == "stop" else 0, 0, outcome)
    services.metrics.prompt_tokens.labels(model.settings.alias).inc(prompt_tokens)
    services.metrics.requests.labels(model.settings.alias, "embeddings", "ok").inc()
    return Response(render.embedding_list(vectors, model.settings.alias, prompt_tokens, body.encoding_format), media_type="application/json")
