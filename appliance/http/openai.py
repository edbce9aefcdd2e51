"""The OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions
(/v1/embeddings: appliance/http/embeddings.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post

from appliance.http.prologue import Endpoint, authenticate, begin, reply
from appliance.pipeline.errors import APIError
from appliance.pipeline.flow import serve_chat, serve_completion
from appliance.pipeline.route_choice import route_meta
from appliance.server.services import Services
from appliance.wire import openai as render
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest

CHAT = Endpoint("chat", "chatcmpl-", ChatCompletionRequest, "chat", trace_auth=True)
COMPLETION = Endpoint("text_completion", "cmpl-", CompletionRequest, "completion")


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
    ctx, body = await begin(request, services, CHAT)
    return await reply(ctx, serve_chat(ctx.answering(render.chat_wire("chat", body.stream_options), body.stream), body))


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, COMPLETION)
    return await reply(ctx, serve_completion(ctx.answering(render.chat_wire("completion", body.stream_options), body.stream), body))


ROUTES = [list_models, retrieve_model, chat_completions, completions]
