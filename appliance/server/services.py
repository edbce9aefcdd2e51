"""What the HTTP layer needs, built once by the app factory and handed to handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from appliance.answer_cache import SemanticCache
from appliance.pipeline.prepare import Prepared
from appliance.config.settings import Settings
from appliance.fleet.embedders import OnDemand, bundled_minilm
from appliance.fleet.registry import LoadedModel, Registry
from appliance.gate import Gate
from appliance.server.jobs import JobRunner
from appliance.server.metrics import Metrics
from appliance.server.tracing import Tracing
from appliance.store.request_log import RequestLogWriter, RequestRecord
from appliance.store.worker import StoreWorker
from engines.interface import FinishEvent
from policy.budgets import Price
from policy.identity import Principal

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

    def record(
        self, prepared: Prepared, model: LoadedModel, endpoint: str, started: float, finish: FinishEvent | None, status: str | None,
        principal: Principal | None = None, completion_tokens: int | None = None, cost_nanos: int | None = None,
    ) -> None:
        """Metrics and the request log for one finished (or abandoned) generation."""
        alias = model.settings.alias
        now = time.time()
        if finish is not None:
            status = status or ("ok" if finish.reason in ("stop", "length") else finish.reason)
        status = status or "error"
        m = self.metrics
        m.requests.labels(alias, endpoint, status).inc()
        prompt_tokens = finish.usage.prompt_tokens if finish is not None else prepared.request.prompt_length
        if completion_tokens is None:
            completion_tokens = finish.usage.completion_tokens if finish else 0
        # A cache hit replays a stored answer: no model computed a first token or generated a token.
        hit = status == "cache_hit"
        ttft = finish.time_to_first_token_s if finish is not None and not hit else None
        m.prompt_tokens.labels(alias).inc(prompt_tokens)
        if not hit:
            m.completion_tokens.labels(alias).inc(completion_tokens)
        if finish is not None:
            m.cached_prompt_tokens.labels(alias).inc(finish.usage.cached_prompt_tokens)
            if ttft is not None:
                m.ttft.labels(alias).observe(ttft)
                decode_time = finish.total_time_s - ttft
                if completion_tokens > 1 and decode_time > 0:
                    m.tokens_per_second.labels(alias).observe((completion_tokens - 1) / decode_time)
            if finish.queue_time_s is not None:
                m.queue_seconds.labels(alias).observe(finish.queue_time_s)
            if finish.inter_token_s:
                gaps = m.inter_token_seconds.labels(alias)
                for gap in finish.inter_token_s:
                    gaps.observe(gap)
        m.request_seconds.labels(alias).observe(now - started)
        if status != "cache_hit":  # a hit replays a stored answer: the engine ended nothing
            m.finish_reasons.labels(alias, finish.reason if finish is not None else "cancelled").inc()
        self.request_log.record(
            RequestRecord(
                id=prepared.request.id,
                created_at=started,
                endpoint=endpoint,
                model=alias,
                status=status,
                finish_reason=finish.reason if finish else None,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                ttft_ms=None if ttft is None else ttft * 1000,
                total_ms=(now - started) * 1000,
                error=finish.error if finish else None,
                tenant=principal.tenant if principal else None,
                app=principal.app if principal else None,
                user=principal.user if principal else None,
                key_id=principal.key_id if principal else None,
                cost_nanos=price_of(model).cost(prompt_tokens, completion_tokens) if cost_nanos is None else cost_nanos,
            )
        )


def price_of(model: LoadedModel) -> Price:
    return Price.per_million(model.settings.price_input_per_mtok, model.settings.price_output_per_mtok)
