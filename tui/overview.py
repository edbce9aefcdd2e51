"""The overview's figures, as pure functions of /metrics scrapes and GET /admin/budgets: rates
between two scrapes, TTFT at the precision its histogram has, and the series the charts draw."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tui.money import money


@dataclass(frozen=True)
class Sample:
    """One scrape of /metrics, reduced to what the overview needs."""

    at: float
    requests: float
    errors: float
    completion_tokens: float
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), model answers only
    ttft_sum_s: float
    ttft_count: float
    slots_busy: dict[str, float]
    slots_total: dict[str, float]
    queue: dict[str, float]
    cache: dict[str, float]
    cache_saved_verified: float
    cache_request_cost: float
    spend_usd: float = 0.0


def parse_metrics(text: str, at: float) -> Sample:
    requests = errors = tokens = saved_verified = request_cost = ttft_sum = ttft_count = spend = 0.0
    buckets: dict[float, float] = {}
    busy: dict[str, float] = {}
    total: dict[str, float] = {}
    queue: dict[str, float] = {}
    cache: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name == "appliance_http_responses_total" and labels.get("route", "").startswith("/v1/"):
                # Every answer to a client, refusals before any model included; not the TUI's own polls.
                requests += value
                if labels.get("status_class") in ("4xx", "5xx"):
                    errors += value
            elif name == "appliance_completion_tokens_total":
                tokens += value
            elif name == "appliance_time_to_first_token_seconds_bucket":
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
            elif name == "appliance_time_to_first_token_seconds_sum":
                ttft_sum += value
            elif name == "appliance_time_to_first_token_seconds_count":
                ttft_count += value
            elif name == "appliance_slots_busy":
                busy[labels["model"]] = value
            elif name == "appliance_slots_total":
                total[labels["model"]] = value
            elif name == "appliance_queue_depth":
                queue[labels["model"]] = value
            elif name == "appliance_cache_lookups_total":
                cache[labels["result"]] = value
            elif name == "appliance_cache_saved_usd_total" and labels.get("state") == "verified":
                saved_verified += value
            elif name == "appliance_cache_request_cost_usd_total":
                request_cost += value
            elif name == "appliance_spend_usd_total":
                spend += value
    ttft = tuple(sorted(buckets.items()))  # the server leaves cache hits out: this is the model's TTFT
    return Sample(at, requests, errors, tokens, ttft, ttft_sum, ttft_count, busy, total, queue, cache, saved_verified, request_cost, spend)


def quantile_bucket(buckets: tuple[tuple[float, float], ...], q: float) -> tuple[float, float] | None:
    """The bucket (lower, upper] that a histogram's q-quantile falls in: all a histogram knows of
    it. The rank is found as Prometheus' `histogram_quantile` finds it, without its interpolation,
    which would show a value never measured (one request in the 2.5-5 s bucket is not "3,750 ms").
    `buckets` are (upper bound, cumulative count), ending with +Inf, the first starting at 0; None
    when there is nothing to tell from."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] == 0 or not 0 <= q <= 1:
        return None
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    return (0.0 if b == 0 else buckets[b - 1][0]), buckets[b][0]


def _seconds(s: float) -> tuple[str, str]:
    return (f"{s:g}", "s") if s >= 1 else (f"{s * 1000:g}", "ms")


def bucket_text(bounds: tuple[float, float] | None) -> str:
    """A TTFT bucket as it reads: `2.5–5 s`, `100–250 ms`, `500 ms–1 s`, `≤10 ms`, `>60 s`; `–` for none."""
    if bounds is None:
        return "–"
    low, high = bounds
    if high == math.inf:
        return ">{} {}".format(*_seconds(low))
    if low <= 0:
        return "≤{} {}".format(*_seconds(high))
    (a, unit_a), (b, unit_b) = _seconds(low), _seconds(high)
    return f"{a}–{b} {unit_b}" if unit_a == unit_b else f"{a} {unit_a}–{b} {unit_b}"


def window(buckets_now: tuple[tuple[float, float], ...], buckets_then: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    then = dict(buckets_then)
    return tuple((b, c - then.get(b, 0.0)) for b, c in buckets_now)


@dataclass(frozen=True)
class Overview:
    requests_per_s: float
    tokens_per_s: float
    errors_per_s: float
    ttft_p50: tuple[float, float] | None  # the bucket each quantile falls in
    ttft_p95: tuple[float, float] | None
    ttft_mean_s: float | None  # exact: the histogram's sum over its count, since the last scrape
    models: list[tuple[str, str, int]]  # (model, "busy/total", queue)
    queue: int
    hit_rate: float | None  # since the server started
    recent_hit_rate: float | None  # since the last scrape; None without a lookup since
    verified_cost_hit_rate: float | None
    spend_per_min_usd: float
    spend_today_usd: float | None
    global_limit_usd: float | None
    global_period: str | None


def overview(now: Sample, then: Sample | None, budgets: dict[str, Any] | None) -> Overview:
    dt = (now.at - then.at) if then is not None else 0.0
    rate = (lambda a, b: max(0.0, (a - b) / dt)) if then is not None and dt > 0 else (lambda a, b: 0.0)
    recent = window(now.ttft_buckets, then.ttft_buckets) if then is not None else now.ttft_buckets
    if not recent or recent[-1][1] == 0:
        recent = now.ttft_buckets  # nothing new: show since start
    # The mean is the window's alone (None without a new answer, which the chart reads as "as before").
    ttft_sum, ttft_count = now.ttft_sum_s, now.ttft_count
    if then is not None:
        ttft_sum, ttft_count = ttft_sum - then.ttft_sum_s, ttft_count - then.ttft_count
    hits, misses = now.cache.get("hit", 0.0), now.cache.get("miss", 0.0)
    new_hits = hits - then.cache.get("hit", 0.0) if then is not None else 0.0
    new_lookups = new_hits + misses - then.cache.get("miss", 0.0) if then is not None else 0.0
    spend = limit = period = None
    if budgets is not None:
        spend = budgets.get("spent_today_usd")
        for b in budgets.get("budgets", []):
            if b["level"] == "global":
                limit, period, spend = b["limit_usd"], b["period"], b["spent_usd"]
    models = [(m, f"{int(now.slots_busy.get(m, 0))}/{int(now.slots_total.get(m, 0))}", int(now.queue.get(m, 0)))
              for m in sorted(now.slots_total)]
    return Overview(
        requests_per_s=rate(now.requests, then.requests if then else 0),
        tokens_per_s=rate(now.completion_tokens, then.completion_tokens if then else 0),
        errors_per_s=rate(now.errors, then.errors if then else 0),
        ttft_p50=quantile_bucket(recent, 0.5), ttft_p95=quantile_bucket(recent, 0.95),
        ttft_mean_s=ttft_sum / ttft_count if ttft_count > 0 else None,
        models=models, queue=int(sum(now.queue.values())),
        hit_rate=hits / (hits + misses) if hits + misses else None,
        recent_hit_rate=new_hits / new_lookups if new_lookups > 0 else None,
        verified_cost_hit_rate=now.cache_saved_verified / now.cache_request_cost if now.cache_request_cost else None,
        spend_per_min_usd=rate(now.spend_usd, then.spend_usd if then else 0) * 60,
        spend_today_usd=spend, global_limit_usd=limit, global_period=period,
    )


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:,.0f} ms"


def overview_lines(o: Overview) -> list[str]:
    """The headline figures, above the charts."""
    spend = (f"spend {money(o.spend_today_usd or 0)} of the global {money(o.global_limit_usd)} per {o.global_period}"
             if o.global_limit_usd is not None else f"spend today {money(o.spend_today_usd or 0)} (no global budget)")
    return [
        f"requests/s {o.requests_per_s:6.2f}   tokens/s {o.tokens_per_s:7.1f}   errors/s {o.errors_per_s:5.2f}",
        f"TTFT p50 {bucket_text(o.ttft_p50)}   p95 {bucket_text(o.ttft_p95)}",
        f"cache hit rate {pct(o.hit_rate)}   cost-weighted verified hit rate {pct(o.verified_cost_hit_rate)}",
        spend,
    ]


def model_lines(o: Overview) -> list[str]:
    return ["model                     slots  queue", *[f"{m:<24} {busy:>6} {queue:>6}" for m, busy, queue in o.models]]


# The charts: (key, label), in the order they are drawn.
CHARTS = (("tokens", "tokens/s"), ("ttft", "TTFT mean"), ("queue", "queue"), ("spend", "spend/min"), ("hits", "cache hits"))


@dataclass(frozen=True)
class Series:
    """The last `keep` scrapes of each chart. A scrape that has nothing to measure (no lookup
    since the last one) repeats the value before it, so an idle server draws a flat line, not a drop."""

    tokens: tuple[float, ...] = ()
    ttft: tuple[float, ...] = ()
    queue: tuple[float, ...] = ()
    spend: tuple[float, ...] = ()
    hits: tuple[float, ...] = ()
    keep: int = 60

    def add(self, o: Overview) -> Series:
        def more(values: tuple[float, ...], value: float | None) -> tuple[float, ...]:
            if value is None and not values:
                return values
            return (values + (values[-1] if value is None else value,))[-self.keep:]

        hit_rate = o.recent_hit_rate if o.recent_hit_rate is not None or self.hits else o.hit_rate  # the first: since start
        return replace(self, tokens=more(self.tokens, o.tokens_per_s), ttft=more(self.ttft, o.ttft_mean_s), queue=more(self.queue, o.queue),
                       spend=more(self.spend, o.spend_per_min_usd), hits=more(self.hits, hit_rate))

    def charts(self) -> list[tuple[str, tuple[float, ...], str]]:
        """(key, values to draw, the latest as text) per chart; no values to draw until there are two."""
        now = {"tokens": lambda v: f"{v:.1f}", "ttft": ms, "queue": lambda v: f"{v:.0f}", "spend": money, "hits": pct}
        shown = []
        for key, _ in CHARTS:
            values: tuple[float, ...] = getattr(self, key)
            shown.append((key, values if len(values) >= 2 else (), now[key](values[-1]) if values else "–"))
        return shown
