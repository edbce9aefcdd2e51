"""What the HTTP layer needs, built once by the app factory and handed to handlers."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from appliance.answer_cache.service import SemanticCache
from appliance.config.settings import Settings
from appliance.fleet.embedders import OnDemand, bundled_minilm
from appliance.fleet.registry import LoadedModel, Registry
from appliance.pipeline.gate import Gate
from appliance.server.jobs import JobRunner
from appliance.server.metrics import Metrics
from appliance.server.tracing import Tracing
from appliance.store.request_log import RequestLogWriter
from appliance.store.worker import StoreWorker
from policy.budgets import Price

log = logging.getLogger("appliance")


@dataclass
class Services:
    settings: Settings
    registry: Registry
    metrics: Metrics
    request_log: RequestLogWriter
    started_at: int
    store: StoreWorker
    gate: Gate
    cache: SemanticCache
    tracing: Tracing
    jobs: JobRunner = field(default_factory=JobRunner)  # quantize and pull, from the admin API
    # The learned router's embedder when the cache has none of the same name: loaded on first use.
    router_embedder: OnDemand = field(default_factory=lambda: OnDemand(bundled_minilm))
    read_at_start: Settings | None = None  # the config file as read at start, before `serve --port` and the like
    config_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one change to the running fleet at a time (appliance/fleet/reconfigure.py)

    def end_streams(self) -> None:
        """The server's grace period is running out: every engine ends its requests with a 503
        error event, so each response still ends in a form a client can parse."""
        log.warning("shutdown grace period ending: ending the requests still running")
        for model in self.registry.all():
            model.engine.abort_all("The server is shutting down; retry the request.")


def price_of(model: LoadedModel) -> Price:
    return Price.of(model.settings)
