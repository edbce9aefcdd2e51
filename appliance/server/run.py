"""Running the app under uvicorn: load the fleet first, then serve; on SIGINT/SIGTERM uvicorn
stops accepting, drains in-flight requests for the grace period, then the app closes its engines."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from appliance.config.settings import ServerSettings, Settings
from appliance.http.errors import envelope_when_cut
from appliance.fleet.files import ModelFileError
from appliance.fleet.registry import Registry
from appliance.prompt.template import TemplateError
from appliance.server.access_log import access_logged
from appliance.server.app import build_services, create_app
from appliance.server.log_format import use_format
from appliance.server.http_protocol import ConnectionLimits, guarded_protocol
from engines.interface import EngineError

log = logging.getLogger("appliance")
MAX_HEAD_BYTES = 16 * 1024  # a request line and its headers; h11's own default, stated where it is enforced


def connection_limits(server: ServerSettings) -> ConnectionLimits:
    return ConnectionLimits(header_timeout_s=server.header_timeout_s, body_timeout_s=server.body_timeout_s,
                            max_connections=server.max_connections, max_head_bytes=MAX_HEAD_BYTES)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As uvicorn binds its own socket: a stopped server's connections in TIME_WAIT do not hold
        # the port, while a server still listening on it does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def open_beyond_loopback(settings: Settings) -> bool:
    """No key is asked for, and the server listens where other machines may reach it."""
    if settings.auth.mode != "open":
        return False
    host = settings.server.host.strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name (or "" for every address): it may resolve beyond this machine
        return True


def startup_lines(settings: Settings, registry: Registry) -> list[str]:
    """What an operator reads at start: where it listens, who may call, which files it uses, what it serves."""
    server, auth = settings.server, settings.auth
    host = f"[{server.host}]" if ":" in server.host else server.host
    if auth.mode == "open":
        who = auth.open_principal
        caller = (f"auth: open: every request is user {who.user!r} of tenant {who.tenant!r}, role {who.role!r}"
                  f"{', an admin' if who.admin else ''}, without a key")
    else:
        caller = "auth: keys: every request needs a key (`appliance keys create`)"
    models = ", ".join(f"{m.settings.alias} ({m.settings.kind}, {m.settings.engine})" for m in registry.all())
    return [
        f"serving http://{host}:{server.port}: OpenAI /v1, Anthropic /v1/messages, Ollama /api, the admin API /admin/* (appliance tui)",
        caller,
        f"config: {Path(settings.file).resolve()}; data: {Path(server.data_dir).resolve()}; "
        f"logs: {server.log_format}, access log {server.access_log}",
        f"models: {models}",
    ]


class _Server(uvicorn.Server):
    """uvicorn cuts the streams still open when the grace period ends (`incomplete chunked`). Just
    before that, every engine ends its requests with a 503 error event, so each stream closes as a
    client can parse it (the error in the envelope, usage, [DONE]) and is settled as usual."""

    def __init__(self, config: uvicorn.Config, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_deadline = on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = float(self.config.timeout_graceful_shutdown or 0)
        deadline = asyncio.get_running_loop().call_later(max(0.0, grace - min(1.0, grace / 4)), self._on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def serve(settings: Settings, read_at_start: Settings | None = None) -> int:
    """`read_at_start`: the config file's settings before the command line's overrides."""
    server = settings.server
    use_format(server.log_format)
    if open_beyond_loopback(settings):
        who = settings.auth.open_principal
        log.warning("[auth] mode = \"open\" in %s and the server listens on %s, beyond this machine: anyone who reaches it "
                    "calls the API without a key, as user %r%s; set mode = \"keys\" or host = \"127.0.0.1\"",
                    settings.file, server.host, who.user, " with admin rights" if who.admin else "")
    if server.port and not port_free(server.host, server.port):
        print(f"error: {server.host}:{server.port} is already in use (set [server] port in {settings.file} or pass --port)", file=sys.stderr)
        return 1
    try:
        registry = Registry.load(settings)
    except (ModelFileError, EngineError, TemplateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    services = build_services(settings, registry, read_at_start)
    app = access_logged(envelope_when_cut(create_app(services)), server.access_log)
    config = uvicorn.Config(
        # log_config=None: uvicorn's lines go through the root logger, in the server's one format.
        app, host=server.host, port=server.port, log_level="info", access_log=False, log_config=None,
        timeout_graceful_shutdown=int(server.shutdown_grace_s), lifespan="on",
        http=guarded_protocol(connection_limits(server)), timeout_keep_alive=server.keep_alive_s,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    for text in startup_lines(settings, registry):
        log.info("%s", text)
    _Server(config, services.end_streams).run()
    return 0
