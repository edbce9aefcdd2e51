"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}. A request is
translated into the chat request the server already serves (guards, router, cache, budgets,
traces and the call itself are chat's, through appliance/pipeline/flow.py and call.py) and answered in the
Responses wire format; stored responses live in SQLite under the caller's tenant."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from litestar import Request, Response, delete, get, post

from appliance.http.prologue import Endpoint, authenticate, begin, reply
from appliance.pipeline.context import Answer, CallContext
from appliance.pipeline.errors import APIError
from appliance.pipeline.flow import serve_chat
from appliance.pipeline.prepare import Prepared
from appliance.server.services import Services
from appliance.store import responses as store
from appliance.wire.responses import Echo, ResponsesWire, Save
from appliance.wire.responses_input import Message, renamed, to_chat
from appliance.wire.schemas import ResponsesRequest

log = logging.getLogger("appliance.api")

# Served as a chat request: the request log and the model policy know it as chat.
RESPONSES = Endpoint("responses", "resp_", ResponsesRequest, "chat", trace_auth=True, trace_body=False)


def _not_found(response_id: str) -> APIError:
    # As OpenAI answers, and the same for another tenant's response: it is as absent.
    return APIError(404, f"Response with id '{response_id}' not found.")


def kept_s(services: Services) -> float:
    return services.settings.server.responses_days * 86400


def _saver(services: Services, tenant: str) -> Save:
    """Stores a finished response on the store's thread, in order: a GET that follows sees it."""

    def save(response: dict[str, Any], conversation: list[Message]) -> None:
        def logged(done: Future[None]) -> None:
            if done.exception() is not None:
                log.error("could not store response %s: %s", response["id"], done.exception())

        services.store.submit(lambda db: store.save(db, tenant, response, conversation, kept_s(services))).add_done_callback(logged)

    return save


@post("/v1/responses", status_code=200)
async def create_response(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, RESPONSES)
    return await reply(ctx, _respond(ctx, body))


async def _respond(ctx: CallContext, body: ResponsesRequest) -> Answer:
    """The previous response's conversation, the request as chat, the Responses wire; chat's pipeline."""
    services, principal = ctx.services, ctx.principal
    history: list[Message] = []
    if body.previous_response_id is not None:
        previous_id = body.previous_response_id
        stored = await services.store.run(lambda db: store.load(db, principal.tenant, previous_id, kept_s(services)))
        if stored is None:
            # OpenAI's answer for an unknown (or another tenant's) previous response: 400, naming the field.
            raise APIError(400, f"Previous response with id '{previous_id}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = stored.conversation
    chat, turns = to_chat(body, history)
    defaults = services.settings.defaults
    echo = Echo.of(body, defaults.temperature if body.temperature is None else body.temperature,
                   defaults.top_p if body.top_p is None else body.top_p)
    save = _saver(services, principal.tenant) if body.store else None

    def wire_for(prepared: Prepared, model: str, created: int) -> ResponsesWire:
        return ResponsesWire(prepared, model, created, echo, turns, save)

    try:
        return await serve_chat(ctx.answering(wire_for, chat.stream), chat)
    except APIError as exc:
        raise renamed(exc) from None


@get("/v1/responses/{response_id:str}")
async def retrieve_response(request: Request[Any, Any, Any], services: Services, response_id: str) -> dict[str, Any]:
    principal = await authenticate(request, services)
    stored = await services.store.run(lambda db: store.load(db, principal.tenant, response_id, kept_s(services)))
    if stored is None:
        raise _not_found(response_id)
    return stored.response


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request[Any, Any, Any], services: Services, response_id: str) -> dict[str, Any]:
    principal = await authenticate(request, services)
    if not await services.store.run(lambda db: store.delete(db, principal.tenant, response_id)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@post("/v1/responses/compact")
async def compact_response(request: Request[Any, Any, Any], services: Services) -> None:
    # Said plainly: without this route the path reads as a response id and answers 405.
    await authenticate(request, services)
    raise APIError(404, "Compaction (POST /v1/responses/compact) is not served by this server.", code="not_found")


ROUTES = [create_response, compact_response, retrieve_response, delete_response]
