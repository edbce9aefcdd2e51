"""What every API route starts with, written once: who is calling, and the typed body.

A model endpoint (chat, completions, responses, embeddings) opens with `begin`: the call's id and
its trace, authentication, the body decoded as its Endpoint says, and the CallContext the pipeline
works on; it closes with `reply`: the pipeline's Answer as a response carrying the trace's id,
and on any failure the trace told why and ended. The admin routes use `authenticate` and
`decode_body` alone."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from litestar import Request, Response
from litestar.response import Stream

from appliance.http.headers import call_notes, new_request_id, remember_principal
from appliance.pipeline.context import Answer, CallContext
from appliance.server.services import Services
from appliance.server.tracing import RequestTrace
from appliance.wire.decode import decode_body
from policy.identity import Principal

B = TypeVar("B")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Endpoint(Generic[B]):
    """What differs between the model endpoints' prologues."""

    operation: str  # the trace's operation (GenAI's name: chat, text_completion, embeddings)
    id_prefix: str  # the call's id starts so: `chatcmpl-`, `resp_`
    body: type[B]  # the request body's struct (appliance/wire/schemas.py)
    endpoint: str  # what the pipeline, the request log and the metrics call it: chat, completion, embeddings
    trace_auth: bool = False  # authentication is a span of its own
    trace_body: bool = True  # the trace is named after the model the body asks for, with its settings


async def begin(request: Request[Any, Any, Any], services: Services, endpoint: Endpoint[B]) -> tuple[CallContext, B]:
    """The call's id and trace, who is calling, the typed body: the context the pipeline works on.
    A refusal here is traced and ends the trace."""
    request_id = new_request_id(request, endpoint.id_prefix)
    trace = RequestTrace(services.tracing, endpoint.operation, request.headers, request__id=request_id)
    try:
        with trace.child("auth") if endpoint.trace_auth else contextlib.nullcontext():
            principal = await authenticate(request, services)
        trace.annotate(tenant=principal.tenant, app=principal.app, user=principal.user, role=principal.role, key__id=principal.key_id)
        body = decode_body(await request.body(), endpoint.body)
        if endpoint.trace_body:
            trace.requested(body)
    except BaseException as exc:
        trace.fail(exc)
        raise
    return CallContext(services, principal, request_id, trace, endpoint.endpoint, request.receive, request.headers.get("cache-control"),
                       notes=call_notes(request.scope)), body


async def reply(ctx: CallContext, work: Awaitable[Answer]) -> Response[Any]:
    """The pipeline's answer as a response that names its trace; a failure is traced and ends the
    trace (a stream that outlives the handler ends it itself)."""
    try:
        answer = await work
    except BaseException as exc:
        ctx.trace.fail(exc)
        raise
    return response(answer, ctx.trace.trace_id)


def response(answer: Answer, trace_id: str | None) -> Response[Any]:
    """A JSON body or an SSE stream, naming its trace (`x-trace-id`) so a caller can find it."""
    headers = answer.headers if trace_id is None else {**answer.headers, "x-trace-id": trace_id}
    if isinstance(answer.body, bytes):
        return Response(answer.body, media_type="application/json", headers=headers)
    return Stream(answer.body, media_type=answer.media_type, headers={**SSE_HEADERS, **headers})


async def authenticate(request: Request[Any, Any, Any], services: Services) -> Principal:
    client = request.client.host if request.client else None
    principal = await services.gate.authenticate(credentials(request.headers), client, request.url.path)
    remember_principal(request.scope, principal)  # the response's rate-limit headers are this caller's
    return principal


def credentials(headers: Any) -> str | None:
    """The caller's key: OpenAI's `Authorization: Bearer`, or Anthropic's `x-api-key` (its SDK and
    Claude Code send the key so), read as the same bearer key."""
    authorization = headers.get("authorization")
    key = headers.get("x-api-key")
    return f"Bearer {key}" if authorization is None and key else authorization
