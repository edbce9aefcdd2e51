"""Every error leaves the API in its protocol's envelope: OpenAI's {"error": {message, type, param,
code}} (appliance/wire/openai.py) unless a route names another (Anthropic's, for /v1/messages),
through `handlers(envelope)`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from appliance.http.headers import request_id_of
from appliance.pipeline.errors import APIError
from appliance.wire.openai import error_envelope
from engines.interface import SHUTDOWN_RETRY_AFTER_S, SHUTTING_DOWN

log = logging.getLogger("appliance.api")


Envelope = Callable[[APIError], dict[str, Any]]


def error_response(error: APIError, envelope: Envelope = error_envelope) -> Response[bytes]:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else {}
    if error.trace_id is not None:
        headers["x-trace-id"] = error.trace_id
    return Response(msgspec.json.encode(envelope(error)), status_code=error.status, media_type="application/json", headers=headers)


def handlers(envelope: Envelope = error_envelope) -> dict[type[Exception], Callable[[Request, Any], Response[bytes]]]:
    """The exception handlers that answer in one protocol's envelope: the app's (OpenAI's), or a route's own."""
    return {APIError: lambda request, exc: error_response(refused(request, exc), envelope),
            HTTPException: lambda _, exc: error_response(from_http(exc), envelope),
            Exception: lambda _, exc: error_response(unexpected(exc), envelope)}


def refused(request: Request, exc: APIError) -> APIError:
    # Operators see every refusal, not only the failures: one line, never the request's content.
    log.info("%s %s -> %d %s: %s (request %s)", request.method, request.url.path, exc.status, exc.code or exc.type, exc.message[:200],
             request_id_of(request.scope))
    return exc


_HTTP_TYPES = {404: ("not_found_error", None), 405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large")}


def from_http(exc: HTTPException) -> APIError:
    status = exc.status_code
    kind, code = _HTTP_TYPES.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    message = exc.detail or "error"
    if status == 413:
        message = f"The request body is too large: {exc.detail}"
    return APIError(status, message, type=kind, code=code)


def unexpected(exc: Exception) -> APIError:
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, "The server had an error while processing your request.", type="server_error")


def envelope_when_cut(app: Any) -> Any:
    """An ASGI wrapper: a request cancelled before its response began (the server's grace period
    ran out while it waited) answers 503 in the envelope, where uvicorn would send a plain-text 500."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            error = APIError(503, "The server is shutting down; retry the request.", type="server_error", code=SHUTTING_DOWN,
                             retry_after_s=SHUTDOWN_RETRY_AFTER_S)
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", str(SHUTDOWN_RETRY_AFTER_S).encode()),
                                    (b"x-request-id", request_id_of(scope).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": msgspec.json.encode(error_envelope(error))})

    return wrapped
