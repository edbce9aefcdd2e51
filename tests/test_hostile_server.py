"""The hostile-client suite, at the HTTP connection and at the admin keys: clients that trickle a
request's head or body, open more connections than the server can hold, or send headers HTTP
forbids; and an admin revoking the last admin key. Against the real server in keys mode, over raw
sockets where an HTTP client would refuse to misbehave."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import h11
import httpx
import pytest

from appliance.server.http_protocol import Clock, ConnectionLimits, next_clock
from policy.identity import KeyRecord, leaves_no_admin
from tests.conftest import CHAT_MODEL, ROOT, Server, start_server, stop_server
from tests.test_gate_api import admin_call, new_key
from tests.test_hostile import hostile_config

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 60


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    config = hostile_config().replace("[server]\n", f"[server]\nheader_timeout_s = {HEADER_TIMEOUT_S}\nbody_timeout_s = {BODY_TIMEOUT_S}\n"
                                                    f"max_connections = {MAX_CONNECTIONS}\n")
    server = start_server(tmp_path_factory.mktemp("hostile-server"), config)
    yield {"server": server, "admin": new_key(server, "ops", user="root", admin=True), "member": new_key(server, "victims", user="mallory")}
    stop_server(server)


def connect(server: Server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def answer(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it closed saying nothing)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def envelope(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] and "code" in error and "param" in error, error
    return status, error


def health_answers_within(server: Server, seconds: float) -> None:
    started = time.monotonic()
    assert httpx.get(f"{server.base_url}/health", timeout=seconds).status_code == 200
    assert time.monotonic() - started < seconds


def test_trickled_and_silent_heads_are_closed_after_the_header_timeout_while_health_answers(guarded: dict[str, Any]) -> None:
    """40 clients trickle a header line every half second and never end the head; 10 more send
    nothing. Each gets a 408 in the envelope once header_timeout_s has passed, and its connection
    closes, while /health answers within a second throughout."""
    server = guarded["server"]
    trickling = [connect(server) for _ in range(40)]
    silent = [connect(server) for _ in range(10)]
    opened = time.monotonic()
    for sock in trickling:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    try:
        while time.monotonic() - opened < HEADER_TIMEOUT_S - 0.5:
            for sock in trickling:
                sock.sendall(b"X-Slow: a\r\n")
            health_answers_within(server, 1.0)
            time.sleep(0.5)
        for sock in trickling + silent:
            status, error = envelope(answer(sock, timeout=HEADER_TIMEOUT_S + 3))
            assert (status, error["code"]) == (408, "request_timeout") and "header_timeout_s" in error["message"]
        assert time.monotonic() - opened < HEADER_TIMEOUT_S + 3
        health_answers_within(server, 1.0)
    finally:
        for sock in trickling + silent:
            sock.close()


def test_a_trickled_body_is_closed_after_the_body_timeout(guarded: dict[str, Any]) -> None:
    """The head arrives whole; the body a byte every half second. The request gets a 408 once
    body_timeout_s has passed since the head, nothing reaches the model, and the server goes on."""
    server = guarded["server"]
    body = json.dumps({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}).encode()
    sock = connect(server)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {guarded['member']}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        sent = time.monotonic()
        sock.settimeout(0.05)
        for byte in body[:-1]:
            with contextlib.suppress(OSError):
                sock.sendall(bytes([byte]))
            with contextlib.suppress(TimeoutError):
                if sock.recv(1, socket.MSG_PEEK):
                    break  # the server has answered
            if time.monotonic() - sent > BODY_TIMEOUT_S + 3:
                break
            time.sleep(0.45)
        status, error = envelope(answer(sock, timeout=3))
        assert (status, error["code"]) == (408, "request_timeout") and "body_timeout_s" in error["message"]
        assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - sent < BODY_TIMEOUT_S + 3
    finally:
        sock.close()
    assert server.wait_idle()["slots_busy"] == 0
    health_answers_within(server, 1.0)
    assert "Traceback" not in server.log.read_text()


def test_connections_beyond_the_cap_are_refused_at_once_and_the_cap_frees_up(guarded: dict[str, Any]) -> None:
    server = guarded["server"]
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # each connection is counted as the server's loop accepts it
        extra = [connect(server) for _ in range(10)]
        for sock in extra:
            status, error = envelope(answer(sock, timeout=2))
            assert (status, error["code"]) == (503, "too_many_connections")
            sock.close()
        for sock in held[:5]:  # those within the cap are still open and served
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer(sock, timeout=5).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    health_answers_within(server, 1.0)


BAD_HEADERS = {
    "NUL": b"X-Bad: a\x00b\r\n",
    "CR": b"X-Bad: a\rb\r\n",
    "LF": b"X-Bad: a\nb\r\n",
    "CR in a name": b"X-B\rad: a\r\n",
    "no colon": b"X-Bad a\r\n",
}


@pytest.mark.parametrize("line", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_a_header_http_forbids_gets_the_envelope(guarded: dict[str, Any], line: bytes) -> None:
    sock = connect(guarded["server"])
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + line + b"Content-Length: 0\r\n\r\n")
        status, error = envelope(answer(sock, timeout=5))
    finally:
        sock.close()
    assert (status, error["code"], error["param"]) == (400, "invalid_http_request", "headers"), error
    assert error["type"] == "invalid_request_error"


def test_a_head_over_the_limit_gets_the_envelope(guarded: dict[str, Any]) -> None:
    sock = connect(guarded["server"])
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        status, error = envelope(answer(sock, timeout=5))
    finally:
        sock.close()
    assert (status, error["code"]) == (431, "request_head_too_large")


def test_the_last_active_admin_key_is_refused_by_the_api_and_the_cli_may_revoke_it(guarded: dict[str, Any]) -> None:
    """Runs last here: it leaves the server with no admin key."""
    server, first = guarded["server"], guarded["admin"]

    def key_id(secret: str) -> str:
        return admin_call(server, secret, "GET", "/admin/keys").json()["caller"]

    first_id = key_id(first)
    refused = admin_call(server, first, "DELETE", f"/admin/keys/{first_id}")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("last_admin_key", "key_id") and "appliance keys revoke" in error["message"]
    assert admin_call(server, first, "GET", "/admin/keys").status_code == 200  # it still works

    # With a second admin key, the first may go; then the second is the last.
    second = admin_call(server, first, "POST", "/admin/keys", json={"tenant": "ops", "app": "a", "user": "two", "role": "dev", "admin": True}).json()["secret"]
    assert admin_call(server, second, "DELETE", f"/admin/keys/{first_id}").status_code == 200
    second_id = key_id(second)
    assert admin_call(server, second, "DELETE", f"/admin/keys/{second_id}").status_code == 409
    member_id = next(k["id"] for k in admin_call(server, second, "GET", "/admin/keys").json()["keys"] if k["user"] == "mallory")
    assert admin_call(server, second, "DELETE", f"/admin/keys/{member_id}").status_code == 200  # other keys go as before

    # On the machine, the CLI revokes it, and says what that leaves.
    done = subprocess.run([sys.executable, "-m", "appliance.cli.main", "keys", "revoke", second_id, "--config", str(server.home.parent / "models.toml")],
                          cwd=ROOT, env={**os.environ, "APPLIANCE_HOME": str(server.home)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "last active admin key" in done.stderr
    time.sleep(0.6)  # the hostile config trusts a checked key for 0.5 s
    assert admin_call(server, second, "GET", "/admin/keys").status_code == 401


# -- the pure parts -------------------------------------------------------------------------------

NOW = 1000.0


def key(kid: str, *, admin: bool = True, revoked: float | None = None, expires: float | None = None) -> KeyRecord:
    return KeyRecord(kid, "u", "t", "a", "dev", admin, 0.0, expires, revoked)


@pytest.mark.parametrize(("target", "keys", "last"), [
    ("a", [key("a")], True),
    ("a", [key("a"), key("b")], False),
    ("a", [key("a"), key("b", revoked=NOW - 1)], True),  # a revoked admin key is no admin key
    ("a", [key("a"), key("b", expires=NOW - 1)], True),  # nor an expired one
    ("a", [key("a"), key("b", admin=False)], True),
    ("m", [key("a"), key("m", admin=False)], False),  # a member key is never the last admin key
    ("a", [key("a", revoked=NOW - 1)], False),  # already revoked: there is nothing to keep
])
def test_the_last_admin_key_is_the_only_active_admin(target: str, keys: list[KeyRecord], last: bool) -> None:
    assert leaves_no_admin(next(k for k in keys if k.id == target), keys, NOW) is last


LIMITS = ConnectionLimits(header_timeout_s=10.0, body_timeout_s=60.0, max_connections=8, max_head_bytes=16384)


def test_the_connection_clock() -> None:
    opened = next_clock(Clock(None), h11.IDLE, False, 1.0)
    assert opened == Clock("head", 1.0) and opened.deadline(LIMITS) == 11.0
    assert next_clock(opened, h11.IDLE, False, 5.0) == opened  # a trickle does not reset it
    body = next_clock(opened, h11.SEND_BODY, False, 6.0)
    assert body == Clock("body", 6.0) and body.deadline(LIMITS) == 66.0
    assert next_clock(body, h11.SEND_BODY, False, 9.0) == body
    assert next_clock(body, h11.DONE, False, 9.0) == Clock(None)  # the app has it all: no deadline
    assert next_clock(Clock(None), h11.IDLE, True, 20.0) == Clock(None)  # idle between requests: keep-alive's
    assert next_clock(Clock(None), h11.IDLE, False, 21.0) == Clock("head", 21.0)  # the next request's first byte
