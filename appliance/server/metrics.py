"""Prometheus metrics, one registry per app so tests can build several apps in one process."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engines.interface import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800)
# A small model on a GPU samples a token in a few milliseconds; a large one on a CPU in a second.
_TOKEN_GAP_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
UNMATCHED_ROUTE = "unmatched"  # a request no route took (404, 405): one label value, whatever its path


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, EngineStats]]) -> None:
        # A `_created` series beside every counter and histogram doubles what a scrape holds and
        # what an operator reads; Prometheus has no use for it.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("appliance_requests", "API requests by model, endpoint and outcome", ["model", "endpoint", "status"], registry=r)
        self.http_responses = Counter("appliance_http_responses", "Every HTTP response, refusals included, by route template, status class "
                                      "and the error envelope's code, else its type (\"\" for success)", ["route", "status_class", "code"], registry=r)
        self.finish_reasons = Counter("appliance_finish_reasons", "Generations the engine ended, by why (stop, length, error, cancelled)",
                                      ["model", "reason"], registry=r)
        self.queue_seconds = Histogram("appliance_request_queue_time_seconds", "Time a request waited before its first step on the engine",
                                       ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram("appliance_inter_token_latency_seconds", "Time between two sampled tokens of one request",
                                             ["model"], buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("appliance_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.cached_prompt_tokens = Counter("appliance_prompt_tokens_cached", "Prompt tokens served from a slot's KV instead of recomputed", ["model"], registry=r)
        self.completion_tokens = Counter("appliance_completion_tokens", "Completion tokens generated", ["model"], registry=r)
        self.ttft = Histogram("appliance_time_to_first_token_seconds", "Time from arrival to the first token", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("appliance_request_duration_seconds", "Time from arrival to the last token", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Histogram("appliance_decode_tokens_per_second", "Per-request decode rate after the first token", ["model"], buckets=_RATE_BUCKETS, registry=r)
        self.auth_failures = Counter("appliance_auth_failures", "Requests refused for a missing, wrong, revoked or expired key", ["reason"], registry=r)
        self.rate_limited = Counter("appliance_rate_limited", "Requests refused by a rate limit, by the level that refused", ["level", "what"], registry=r)
        self.budget_refused = Counter("appliance_budget_refused", "Requests refused because a budget could not cover them", ["level"], registry=r)
        # Money in dollars, as operators read it (Prometheus' base-unit rule); the ledger keeps exact nano-dollars.
        self.spend_usd = Counter("appliance_spend_usd", "Settled spend in dollars", ["model"], registry=r)
        self.leases_expired = Counter("appliance_budget_leases_expired", "Reservations released by the reaper after their lease ran out", registry=r)
        self.reservations_open = Gauge("appliance_budget_reservations_open", "Budget reservations held by requests in flight in this process", registry=r)
        self.cache_lookups = Counter("appliance_cache_lookups", "Cacheable requests by outcome (hit, miss) and the uncacheable (bypass)", ["result"], registry=r)
        self.cache_saved_usd = Counter("appliance_cache_saved_usd", "What hits saved in dollars (the original call's cost), by the entry's state", ["state"], registry=r)
        self.cache_request_cost_usd = Counter("appliance_cache_request_cost_usd", "Cost in dollars of every cacheable request: misses as charged, hits as the call they replaced", registry=r)
        self.cache_false_hits = Counter("appliance_cache_false_hits", "Hits reported bad through feedback", registry=r)
        self.cache_judge_calls = Counter("appliance_cache_judge_calls", "Borderline candidates sent to the equivalence judge", registry=r)
        self.cache_sweeps = Counter("appliance_cache_sweep_checks", "Entries re-asked by refresh sweeps, by outcome", ["outcome"], registry=r)
        self.route_answers = Counter("appliance_route_answers", "Routed requests by route and the model that answered (or default)", ["route", "model"], registry=r)
        self.route_escalations = Counter("appliance_route_escalations", "Routed attempts that failed validation, by model and reason", ["model", "reason"], registry=r)
        self.route_injection_flags = Counter("appliance_route_injection_flags", "Routed requests whose text tried to steer the router or pose as the system", registry=r)
        self.guard_pii = Counter("appliance_guard_pii", "Requests with personal data found, by kind and what was done", ["kind", "action"], registry=r)
        self.guard_injection = Counter("appliance_guard_injection_flags", "Requests with text posing as instructions to the system", registry=r)
        self.guard_judge_calls = Counter("appliance_guard_judge_calls", "Unsure inputs sent to the guardrail's LLM judge, by verdict", ["verdict"], registry=r)
        self.guard_judge_cost_usd = Counter("appliance_guard_judge_cost_usd", "What the guardrail judge's calls cost, in dollars", registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_response(self, route: str | None, status: int, body: bytes = b"") -> None:
        code = error_code(body) if status >= 400 else ""
        self.http_responses.labels(route or UNMATCHED_ROUTE, f"{status // 100}xx", code).inc()


class _Error(msgspec.Struct):
    code: str | None = None
    type: str | None = None


class _Envelope(msgspec.Struct):
    error: _Error


def error_code(body: bytes) -> str:
    """The `code` of an OpenAI error envelope, else its `type` (many 400s name only a param); ""
    when the body is not an envelope."""
    try:
        error = msgspec.json.decode(body, type=_Envelope).error
        code = error.code or error.type or ""
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return code[:64]  # an upstream's code is passed through: keep a stray one from bloating the series


class _EngineCollector:
    """Slots and queues are read from the engines at scrape time, never copied."""

    def __init__(self, engine_stats: Callable[[], dict[str, EngineStats]]) -> None:
        self._stats = engine_stats

    def collect(self):  # type: ignore[no-untyped-def]
        loaded = GaugeMetricFamily("appliance_model_loaded", "1 when the model is in memory (or served upstream), 0 when it loads on its next request",
                                   labels=["model"])
        busy = GaugeMetricFamily("appliance_slots_busy", "Slots generating or prefilling", labels=["model"])
        total = GaugeMetricFamily("appliance_slots_total", "Slots configured", labels=["model"])
        queue = GaugeMetricFamily("appliance_queue_depth", "Requests waiting for a slot", labels=["model"])
        prompt = CounterMetricFamily("appliance_prefix_prompt_tokens", "Prompt tokens admitted to the engine", labels=["model"])
        reused = CounterMetricFamily("appliance_prefix_reused_tokens", "Prompt tokens whose KV was reused, by where it came from: the slot itself, a copy from another slot, host RAM", labels=["model", "source"])
        ratio = GaugeMetricFamily("appliance_prefix_cache_hit_ratio", "Prompt tokens reused / prompt tokens, since the model loaded", labels=["model"])
        host_bytes = GaugeMetricFamily("appliance_prefix_host_bytes", "Bytes of KV held in host RAM for evicted prefixes", labels=["model"])
        host_entries = GaugeMetricFamily("appliance_prefix_host_entries", "Sequences held in host RAM", labels=["model"])
        host_saves = CounterMetricFamily("appliance_prefix_host_saves", "Evicted sequences saved to host RAM", labels=["model"])
        host_evictions = CounterMetricFamily("appliance_prefix_host_evictions", "Host-RAM sequences dropped to stay under the limit", labels=["model"])
        swapped = CounterMetricFamily("appliance_kv_swapped_requests", "Requests set aside in host RAM because the shared KV pool "
                                      "(kv_tokens) ran out", labels=["model"])
        drafted = CounterMetricFamily("appliance_speculation_drafted_tokens", "Drafted tokens sent for verification", labels=["model"])
        accepted = CounterMetricFamily("appliance_speculation_accepted_tokens", "Drafted tokens the target model agreed with", labels=["model"])
        acceptance = GaugeMetricFamily("appliance_speculation_acceptance_rate", "Accepted / drafted tokens since the model loaded", labels=["model"])
        up_state = GaugeMetricFamily("appliance_upstream_breaker_state", "1 for the state each upstream's circuit breaker is in", labels=["model", "upstream", "state"])
        up_healthy = GaugeMetricFamily("appliance_upstream_healthy", "1 when the upstream's last health check answered", labels=["model", "upstream"])
        up_outstanding = GaugeMetricFamily("appliance_upstream_outstanding", "Requests in flight to the upstream", labels=["model", "upstream"])
        up_requests = CounterMetricFamily("appliance_upstream_attempts", "Attempts sent to the upstream, retries included", labels=["model", "upstream"])
        up_failures = CounterMetricFamily("appliance_upstream_failures", "Failed attempts by kind", labels=["model", "upstream", "kind"])
        up_retries = CounterMetricFamily("appliance_upstream_retries", "Attempts retried before any token was streamed", labels=["model", "upstream"])
        up_refused = CounterMetricFamily("appliance_upstream_refused", "Requests failed fast by an open breaker, without a connection", labels=["model", "upstream"])
        kv_usage = GaugeMetricFamily("appliance_kv_cache_usage_ratio", "Fraction of KV cells held by requests in flight (cached prefixes "
                                     "of idle slots count as free, as vLLM counts its evictable blocks)", labels=["model"])
        for alias, stats in self._stats().items():
            for u in stats.upstreams:
                for state in ("closed", "open", "half_open"):
                    up_state.add_metric([alias, u.name, state], 1.0 if u.breaker == state else 0.0)
                up_healthy.add_metric([alias, u.name], 1.0 if u.healthy else 0.0)
                up_outstanding.add_metric([alias, u.name], u.outstanding)
                up_requests.add_metric([alias, u.name], u.requests)
                for kind, count in u.failures:
                    up_failures.add_metric([alias, u.name, kind], count)
                up_retries.add_metric([alias, u.name], u.retries)
                up_refused.add_metric([alias, u.name], u.refused)
            if stats.speculation is not None:
                drafted.add_metric([alias], stats.speculation.drafted)
                accepted.add_metric([alias], stats.speculation.accepted)
                acceptance.add_metric([alias], stats.speculation.acceptance_rate)
            loaded.add_metric([alias], 1.0 if stats.loaded else 0.0)
            busy.add_metric([alias], stats.slots_busy)
            total.add_metric([alias], stats.slots_total)
            queue.add_metric([alias], stats.queue_depth)
            if stats.kv_usage is not None:
                kv_usage.add_metric([alias], stats.kv_usage)
            p = stats.prefix
            if p is None:
                continue
            prompt.add_metric([alias], p.prompt_tokens)
            for source, value in (("slot", p.reused_in_slot), ("copy", p.reused_by_copy), ("host", p.reused_from_host)):
                reused.add_metric([alias, source], value)
            ratio.add_metric([alias], p.hit_ratio)
            host_bytes.add_metric([alias], p.host_bytes)
            host_entries.add_metric([alias], p.host_entries)
            host_saves.add_metric([alias], p.host_saves)
            host_evictions.add_metric([alias], p.host_evictions)
            swapped.add_metric([alias], p.swapped_out)
        yield from (loaded, busy, total, queue, kv_usage, prompt, reused, ratio, host_bytes, host_entries, host_saves, host_evictions, swapped, drafted, accepted, acceptance,
                    up_state, up_healthy, up_outstanding, up_requests, up_failures, up_retries, up_refused)
