"""The OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions
(/v1/embeddings: appliance/http/embeddings.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post

from appliance.pipeline import call
from appliance.wire import openai as render
from appliance.http.prologue import authenticate, decode_body
from appliance.pipeline.errors import APIError
from appliance.http.headers import new_request_id
from appliance.pipeline.flow import annotate_principal, guard, model_with_adapters, serve_chat
from appliance.pipeline.routed import route_meta
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest
from appliance.pipeline.prepare import prepare_completion, with_adapters
from appliance.server.services import Services
from appliance.server.tracing import RequestTrace


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


ROUTES = [list_models, retrieve_model, chat_completions, completions]
