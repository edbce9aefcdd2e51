"""The access log: one line per HTTP request on the `appliance.access` logger, written when the
response has ended (a stream's last byte, or the client gone), so it carries what the call cost.
It names the request id, the caller (tenant, app, user, key id), the model and its tokens, the
cache's and the route's outcome, the status and the latency; never a prompt, a header or a key.

Polls ([server] access_log = "calls": reads of /health, /metrics and /admin) are left out, as the
console and monitors make them every few seconds. With log_format = "json" each line's fields are
the JSON object's keys (appliance/server/log_format.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http.headers import call_notes, principal_of, request_id_of

log = logging.getLogger("appliance.access")
_POLLED = ("/health", "/metrics", "/admin")
# The order fields are written in; a missing one is left out.
_FIELDS = ("request_id", "status", "method", "path", "ms", "tenant", "app", "user", "key_id", "route", "model", "tiers",
           "prompt_tokens", "completion_tokens", "cache", "outcome")


def polled(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and any(path == p or path.startswith(p + "/") for p in _POLLED)


def entry(scope: Scope, status: int | None, seconds: float) -> dict[str, Any]:
    """The line's fields, from what the request's scope holds once its response has ended."""
    principal = principal_of(scope)
    fields: dict[str, Any] = {
        "request_id": request_id_of(scope),
        # No response started: the client left first, or the app failed before answering.
        "status": status if status is not None else "cut",
        "method": scope.get("method", ""),
        "path": scope.get("path", ""),  # without its query string
        "ms": round(seconds * 1000, 1),
    }
    if principal is not None:
        fields.update(tenant=principal.tenant, app=principal.app, user=principal.user, key_id=principal.key_id)
    notes = dict(call_notes(scope))
    if "status" in notes:  # the call's own outcome (ok, cache_hit, cancelled, …), beside HTTP's status
        notes["outcome"] = notes.pop("status")
    fields.update(notes)
    return {k: fields[k] for k in _FIELDS if fields.get(k) is not None}


def line(fields: dict[str, Any]) -> str:
    """`<id> <status> <method> <path> <ms> ms key=value …`: the fixed part first, for a person's eye."""
    head = f"{fields['request_id']} {fields['status']} {fields['method']} {fields['path']} {fields['ms']} ms"
    rest = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("request_id", "status", "method", "path", "ms"))
    return f"{head} {rest}".rstrip()


def access_logged(app: ASGIApp, mode: str) -> ASGIApp:
    """`app`, with a line logged for each HTTP request `mode` asks for ("calls", "all", "off")."""
    if mode == "off":
        return app

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (mode == "calls" and polled(scope.get("method", ""), scope.get("path", ""))):
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:
            fields = entry(scope, status, time.perf_counter() - started)
            log.info(line(fields), extra={"fields": fields})

    return logged
