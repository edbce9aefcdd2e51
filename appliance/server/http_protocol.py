"""The HTTP/1.1 connection under the app: uvicorn's h11 protocol with the bounds it lacks. uvicorn
waits for ever on a request head or body that trickles in, accepts every connection, and answers a
malformed request in plain text; a client holding many such connections holds as many file
descriptors. Here a head and a body each have a deadline, open connections a cap, and every refusal
at this layer is OpenAI's JSON envelope, as the app's own are."""

from __future__ import annotations

import asyncio
import http
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.pipeline.errors import APIError
from appliance.wire.openai import error_envelope

log = logging.getLogger("appliance")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_head_bytes: int


@dataclass(frozen=True)
class Clock:
    """What a connection is waiting for and since when (monotonic seconds)."""

    part: str | None  # "head", "body" or None: nothing is awaited from the client
    since: float | None = None

    def deadline(self, limits: ConnectionLimits) -> float | None:
        if self.part is None or self.since is None:
            return None
        return self.since + (limits.header_timeout_s if self.part == "head" else limits.body_timeout_s)


def next_clock(clock: Clock, their_state: object, idle_between_requests: bool, now: float) -> Clock:
    """The clock after the client's h11 state moved: a head is awaited while the state is IDLE (from
    the connection's opening, or from the first byte of a kept-alive connection's next request, since
    uvicorn's keep-alive timer owns an idle connection between requests), a body while it is SEND_BODY
    (from the end of the head). A clock already running keeps its start: a trickle does not reset it."""
    if their_state is h11.IDLE:
        if idle_between_requests:
            return Clock(None)
        return clock if clock.part == "head" else Clock("head", now)
    if their_state is h11.SEND_BODY:
        return clock if clock.part == "body" else Clock("body", now)
    return Clock(None)


def refusal_bytes(error: APIError, retry_after_s: int | None = None) -> bytes:
    """A whole response that closes its connection, in the envelope the app's errors use."""
    body = msgspec.json.encode(error_envelope(error))
    head = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def malformed(exc: h11.RemoteProtocolError | None, max_head_bytes: int) -> APIError:
    """What h11 refused, said as the API says it. h11's own words name the fault; they may quote the
    caller's bytes, which the JSON body escapes."""
    if exc is not None and exc.error_status_hint == 431:
        return APIError(431, f"The request's head (its line and headers) is over {max_head_bytes} bytes.",
                        param="headers", code="request_head_too_large")
    said = str(exc)[:200] if exc is not None else "unreadable"
    return APIError(400, f"The request is not valid HTTP/1.1 ({said}); a header may not hold CR, LF or NUL.",
                    param="headers" if "header" in said.lower() else None, code="invalid_http_request")


class _Throttled:
    """One log line a minute at most for a kind of refusal: an attack must not flood the log."""

    def __init__(self, what: str) -> None:
        self.what, self.count, self.last = what, 0, -1e9

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= 60.0:
            log.warning("%s (%d since the server started)", self.what, self.count)
            self.last = now


class _Connection(h11.Connection):
    """h11's connection, keeping the error it raised (uvicorn drops it before answering), and holding
    a whole head to the size limit: h11 applies it only to a head still incomplete, so one that
    arrives in a single read could be far larger."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers) > self.max_head_bytes:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class under these limits (uvicorn makes one per connection)."""
    refused = _Throttled(f"refused connections beyond [server] max_connections = {limits.max_connections}")
    timed_out = _Throttled("closed connections whose request head or body arrived too slowly ([server] header_timeout_s, body_timeout_s)")

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _Connection(limits.max_head_bytes)
            self.clock = Clock(None)
            self.timer: asyncio.TimerHandle | None = None
            self.timer_at: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                refused()
                self._refuse(APIError(503, f"The server has {limits.max_connections} connections open, its limit; retry shortly.",
                                      type="server_error", code="too_many_connections"), retry_after_s=1)
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # h11 refused the request itself (the app never sees it): the envelope is written here.
            self._refuse(malformed(self.conn.error, limits.max_head_bytes))

        def _watch(self) -> None:
            if self.transport.is_closing():
                self._arm(None)
                return
            self.clock = next_clock(self.clock, self.conn.their_state, self.timeout_keep_alive_task is not None, time.monotonic())
            self._arm(self.clock.deadline(limits))

        def _arm(self, at: float | None) -> None:
            if at == self.timer_at:
                return  # the usual case on each chunk of a trickle: the deadline stands
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = at
            self.timer = None if at is None else self.loop.call_later(max(0.0, at - time.monotonic()), self._expire)

        def _expire(self) -> None:
            self.timer = self.timer_at = None
            part = self.clock.part
            if part is None or self.transport.is_closing():
                return
            timed_out()
            key, limit = ("header_timeout_s", limits.header_timeout_s) if part == "head" else ("body_timeout_s", limits.body_timeout_s)
            self._refuse(APIError(408, f"The request's {part} did not arrive within {limit:g} s ([server] {key}); the connection is closed.",
                                  code="request_timeout"))

        def _refuse(self, error: APIError, retry_after_s: int | None = None) -> None:
            self._arm(None)
            # A response already begun (or sent, the body still arriving) leaves room only for the close.
            answerable = self.conn.our_state is h11.IDLE or self.conn.our_state is h11.SEND_RESPONSE
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # whatever the app sends after this goes nowhere
                self.cycle.message_event.set()
            if answerable:
                self.transport.write(refusal_bytes(error, retry_after_s))
            self.transport.close()

    return GuardedH11Protocol
