"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens. A request is
asked as the chat request it translates to (appliance/wire/messages_input.py), through chat's one
flow (guards, route or model, cache, budgets, traces, the call), and answered in the Messages wire
(appliance/wire/messages.py); every error in Anthropic's envelope. The key comes as `x-api-key`
or as a bearer token; `anthropic-version` is accepted and not needed."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from appliance.http.errors import handlers
from appliance.http.prologue import Endpoint, authenticate, begin, reply
from appliance.pipeline.context import Answer, CallContext
from appliance.pipeline.flow import serve_chat
from appliance.pipeline.models import model_with_adapters, tier_model
from appliance.pipeline.prepare import prepare_chat
from appliance.server.services import Services
from appliance.wire.decode import decode_body
from appliance.wire.messages import error_envelope, messages_wire
from appliance.wire.messages_input import CountTokensRequest, MessagesRequest, to_chat

# Served as a chat request: the request log and the model policy know it as chat.
MESSAGES = Endpoint("chat", "msg_", MessagesRequest, "chat", trace_auth=True, trace_body=False)
ANTHROPIC_ERRORS = handlers(error_envelope)


@post("/v1/messages", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def create_message(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, MESSAGES)
    return await reply(ctx, _respond(ctx, body))


async def _respond(ctx: CallContext, body: MessagesRequest) -> Answer:
    chat = to_chat(body)
    return await serve_chat(ctx.answering(messages_wire, chat.stream), chat)


@post("/v1/messages/count_tokens", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def count_tokens(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """The prompt's tokens as the model that would answer reads them: its chat template over the
    system prompt, the turns and the tools (a routed alias counts with its first tier)."""
    principal = await authenticate(request, services)
    chat = to_chat(decode_body(await request.body(), CountTokensRequest).asked())
    route = services.settings.route(chat.model)
    model = tier_model(services, route.tiers[0])[0] if route is not None else model_with_adapters(services, chat.model, None)[0]
    # Rendering and tokenizing a prompt of up to the body limit is work: it counts as a request.
    with services.gate.request_only(principal):
        prepared = await prepare_chat(chat, model, services.settings.defaults, "count_tokens")
    return {"input_tokens": prepared.request.prompt_length}


ROUTES = [create_message, count_tokens]
