"""Running the app under uvicorn: load the fleet first, then serve; on SIGINT/SIGTERM uvicorn
stops accepting, drains in-flight requests for the grace period, then the app closes its engines."""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from appliance.app import build_services, create_app
from appliance.model_files import ModelFileError
from appliance.registry import Registry
from appliance.settings import Settings
from engines.base import EngineError

log = logging.getLogger("appliance")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def serve(settings: Settings) -> int:
    server = settings.server
    if server.port and not port_free(server.host, server.port):
        print(f"error: {server.host}:{server.port} is already in use (set [server] port in {settings.file} or pass --port)", file=sys.stderr)
        return 1
    try:
        registry = Registry.load(settings)
    except (ModelFileError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app = create_app(build_services(settings, registry))
    config = uvicorn.Config(
        app, host=server.host, port=server.port, log_level="info", access_log=False,
        timeout_graceful_shutdown=int(server.shutdown_grace_s), lifespan="on",
    )
    log.info("serving %d model(s) on http://%s:%d/v1", len(registry.all()), server.host, server.port)
    uvicorn.Server(config).run()
    return 0
