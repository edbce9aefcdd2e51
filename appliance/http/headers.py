"""Response headers every API response carries, added in one place as the response starts:
`x-request-id` (the id the ledger, the request log and the trace know the call by) and, for a
caller under a rate limit, OpenAI's `x-ratelimit-*` headers.

A route makes its call's id with `new_request_id` (it is also the body's `id`); a response that
no route named (a 404, an admin call) gets a `req_` id of its own, made once per HTTP request. A
caller's own `X-Request-Id` / `X-Client-Request-Id` never becomes ours: ids key budget
reservations and traces, and a caller must not pick one that another request already holds. It
is kept on the trace as `appliance.client_request_id` instead (`tracing.client_request_id`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from litestar.datastructures import MutableScopeHeaders
from litestar.types import Message, Scope

from appliance.pipeline.gate import Gate
from policy.identity import Principal
from policy.rate_headers import rate_limit_headers

_REQUEST_ID = "appliance.request_id"
_PRINCIPAL = "appliance.principal"
_NOTES = "appliance.notes"


def _state(scope: Any) -> dict[str, Any]:
    return scope.setdefault("state", {})


def new_request_id(request: Any, prefix: str) -> str:
    """The id of the call this request makes (`chatcmpl-…`, `resp_…`), named once and sent back as `x-request-id`."""
    request_id = f"{prefix}{uuid.uuid4().hex}"
    _state(request.scope)[_REQUEST_ID] = request_id
    return request_id


def request_id_of(scope: Any) -> str:
    """This HTTP request's id: the route's, or a `req_` one made now and kept for its response."""
    state = _state(scope)
    if _REQUEST_ID not in state:
        state[_REQUEST_ID] = f"req_{uuid.uuid4().hex}"
    return str(state[_REQUEST_ID])


def remember_principal(scope: Any, principal: Principal) -> None:
    _state(scope)[_PRINCIPAL] = principal


def principal_of(scope: Any) -> Principal | None:
    return _state(scope).get(_PRINCIPAL)


def call_notes(scope: Any) -> dict[str, Any]:
    """What the pipeline learns of this request's call, for its access log line."""
    notes: dict[str, Any] = _state(scope).setdefault(_NOTES, {})
    return notes


def response_headers(gate: Gate) -> Callable[[Message, Scope], Awaitable[None]]:
    """A `before_send` hook. Rate-limit headers go on `/v1/` responses to an authenticated caller
    with a limit, as the buckets stand when the response starts (after this call's own charge, and
    for a non-streamed answer after its settlement); a 429 carries them too."""

    async def hook(message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start":
            return
        headers = MutableScopeHeaders.from_message(message)
        headers["x-request-id"] = request_id_of(scope)
        if scope.get("path", "").startswith("/v1/messages"):
            headers["request-id"] = request_id_of(scope)  # where Anthropic's SDK reads the id to quote
        principal = principal_of(scope)
        if principal is not None and scope.get("path", "").startswith("/v1/"):
            for name, value in rate_limit_headers(gate.limiter.states(principal, time.time())).items():
                headers[name] = value

    return hook
