"""The Litestar app factory: routes, error envelopes, and the lifecycle of what it serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Scope

from appliance import __version__
from appliance.answer_cache.service import SemanticCache
from appliance.http import admin, cache, distill, embeddings, fleet, messages, models, ollama, openai, responses
from appliance.http.prologue import authenticate
from appliance.http.errors import handlers
from appliance.http.headers import response_headers
from appliance.config.settings import Settings
from appliance.fleet.registry import Registry
from appliance.pipeline.gate import Gate
from appliance.server.metrics import Metrics
from appliance.server.services import Services
from appliance.server.tracing import Tracing
from appliance.store.db import connect, database_path, migrate
from appliance.store.request_log import RequestLogWriter
from appliance.store.worker import StoreWorker

log = logging.getLogger("appliance")


@get("/health", sync_to_thread=False)
def health(services: Services) -> dict[str, Any]:
    loaded = {}
    for m in services.registry.all():
        stats = m.engine.stats()
        loaded[m.settings.alias] = {"slots_total": stats.slots_total, "slots_busy": stats.slots_busy, "queue_depth": stats.queue_depth}
        if stats.upstreams:
            loaded[m.settings.alias]["upstreams"] = {u.name: {"breaker": u.breaker, "healthy": u.healthy} for u in stats.upstreams}
    return {"status": "ok", "version": __version__, "uptime_s": round(time.time() - services.started_at, 3), "models": loaded}


@get("/metrics")
async def metrics(request: Request[Any, Any, Any], services: Services) -> Response[bytes]:
    if services.settings.server.metrics_auth == "admin":
        services.gate.require_admin(await authenticate(request, services))
    return Response(services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


_ERROR_STATUS = "appliance.error_status"  # in the scope's state, between an error's start and its body


def count_responses(metrics_: Metrics) -> Callable[[Message, Scope], Awaitable[None]]:
    """Counts every response as it leaves, refusals raised before any model was known and paths no
    route took included; an error is counted with its body, whose envelope names the code. Async:
    Litestar would run a sync hook on a worker thread, once for every chunk of every stream."""

    async def hook(message: Message, scope: Scope) -> None:
        if message["type"] == "http.response.start":
            if message["status"] < 400:
                metrics_.count_response(scope.get("path_template"), message["status"])
            else:
                scope["state"][_ERROR_STATUS] = message["status"]
        elif message["type"] == "http.response.body" and _ERROR_STATUS in scope["state"]:
            metrics_.count_response(scope.get("path_template"), scope["state"].pop(_ERROR_STATUS), message.get("body", b""))

    return hook


def build_services(settings: Settings, registry: Registry, read_at_start: Settings | None = None) -> Services:
    db_path = database_path(settings.server.data_dir)
    db = connect(db_path)
    try:
        migrate(db)
    finally:
        db.close()
    metrics_ = Metrics(lambda: {m.settings.alias: m.engine.stats() for m in registry.all()})
    store = StoreWorker(db_path, synchronous=settings.server.sqlite_synchronous)
    gate = Gate(settings, store, metrics_)
    tracing = Tracing(settings.tracing, db_path, settings.server.sqlite_synchronous, join_callers=settings.auth.mode == "open")
    answers = SemanticCache(settings.cache, db_path, registry, metrics_, settings.server.sqlite_synchronous, tracing)
    return Services(settings, registry, metrics_, RequestLogWriter(db_path, settings.server.request_log_days * 86400), int(time.time()), store, gate, answers, tracing,
                    read_at_start=read_at_start)


def create_app(services: Services) -> Litestar:
    async def startup() -> None:
        await services.registry.start()  # upstream engines open their connections and health checks
        await services.gate.start()  # releases leases a crashed predecessor left behind
        await services.cache.start()

    async def shutdown() -> None:
        # Joining model threads blocks; keep the loop free to finish what is still streaming.
        await services.cache.close()  # its sweeps use the engines: stop them first
        await asyncio.to_thread(services.jobs.close)
        await asyncio.to_thread(services.router_embedder.close)
        await asyncio.to_thread(services.registry.close)
        await services.gate.close()
        await asyncio.to_thread(services.store.close)  # writes the settlements still queued
        await asyncio.to_thread(services.request_log.close)
        await asyncio.to_thread(services.tracing.close)  # exports the spans still buffered

    return Litestar(
        route_handlers=[
            health, metrics,
            *openai.ROUTES, *embeddings.ROUTES, *responses.ROUTES, *messages.ROUTES, *admin.ROUTES, *cache.ROUTES, *models.ROUTES, *fleet.ROUTES,
            *distill.ROUTES, *ollama.ROUTES,
        ],
        dependencies={"services": Provide(lambda: services, sync_to_thread=False)},
        exception_handlers=handlers(),
        request_max_body_size=services.settings.server.max_body_bytes,
        before_send=[response_headers(services.gate), count_responses(services.metrics)],
        on_startup=[startup],
        on_shutdown=[shutdown],
        openapi_config=OpenAPIConfig(title="appliance", version=__version__),
        logging_config=None,
    )
