"""What each screen shows, as pure functions of the admin API's answers: no IO, no widgets, so they
are tested with plain values."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    """One scrape of /metrics, reduced to what the overview needs."""

    at: float
    requests: float
    errors: float
    completion_tokens: float
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), model answers only
    slots_busy: dict[str, float]
    slots_total: dict[str, float]
    queue: dict[str, float]
    cache: dict[str, float]
    cache_saved_verified: float
    cache_request_cost: float


def parse_metrics(text: str, at: float) -> Sample:
    requests = errors = tokens = saved_verified = request_cost = 0.0
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
            elif name == "appliance_slots_busy":
                busy[labels["model"]] = value
            elif name == "appliance_slots_total":
                total[labels["model"]] = value
            elif name == "appliance_queue_depth":
                queue[labels["model"]] = value
            elif name == "appliance_cache_lookups_total":
                cache[labels["result"]] = value
            elif name == "appliance_cache_saved_nanousd_total" and labels.get("state") == "verified":
                saved_verified += value
            elif name == "appliance_cache_request_cost_nanousd_total":
                request_cost += value
    ttft = tuple(sorted(buckets.items()))  # the server leaves cache hits out: this is the model's TTFT
    return Sample(at, requests, errors, tokens, ttft, busy, total, queue, cache, saved_verified, request_cost)


def quantile(buckets: tuple[tuple[float, float], ...], q: float) -> float | None:
    """The q-quantile of a histogram as Prometheus' `histogram_quantile` estimates it: linear
    inside the bucket the rank falls in (the first bucket starts at 0), the highest finite bound
    when it falls in +Inf. `buckets` are (upper bound, cumulative count), ending with +Inf; None
    when there is nothing to estimate from."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] == 0 or math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rank = q * buckets[-1][1]
    b = next((i for i, (_, count) in enumerate(buckets[:-1]) if count >= rank), len(buckets) - 1)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    end, count = buckets[b]
    if b == 0 and end <= 0:
        return end
    start = 0.0
    if b > 0:
        start, below = buckets[b - 1]
        count, rank = count - below, rank - below
    return start + (end - start) * (rank / count)


def usd(amount: float) -> str:
    """Money at the precision it has: cents from a dollar up, three significant digits below,
    and micro-dollars (µ$) under a tenth of a cent, where a request's cost usually lies."""
    sign, amount = ("-" if amount < 0 else ""), abs(amount)
    if amount < 1:
        amount = float(f"{amount:.3g}")  # rounded first, so 0.9996 is shown as $1.00, not $1.000
    if amount == 0:
        return "$0"
    if amount >= 1:
        return f"{sign}${amount:,.2f}"
    unit, value = ("$", amount) if amount >= 0.001 else ("µ$", amount * 1e6)
    decimals = max(0, 2 - math.floor(math.log10(value)))
    return f"{sign}{unit}{value:.{decimals}f}"


def window(buckets_now: tuple[tuple[float, float], ...], buckets_then: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    then = dict(buckets_then)
    return tuple((b, c - then.get(b, 0.0)) for b, c in buckets_now)


@dataclass(frozen=True)
class Overview:
    requests_per_s: float
    tokens_per_s: float
    errors_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    models: list[tuple[str, str, int]]  # (model, "busy/total", queue)
    hit_rate: float | None
    verified_cost_hit_rate: float | None
    spend_today_usd: float | None
    global_limit_usd: float | None
    global_period: str | None


def overview(now: Sample, then: Sample | None, budgets: dict[str, Any] | None) -> Overview:
    dt = (now.at - then.at) if then is not None else 0.0
    rate = (lambda a, b: max(0.0, (a - b) / dt)) if then is not None and dt > 0 else (lambda a, b: 0.0)
    recent = window(now.ttft_buckets, then.ttft_buckets) if then is not None else now.ttft_buckets
    if not recent or recent[-1][1] == 0:
        recent = now.ttft_buckets  # nothing new: show since start
    hits, misses = now.cache.get("hit", 0.0), now.cache.get("miss", 0.0)
    spend = limit = period = None
    if budgets is not None:
        top = budgets.get("top_spenders_today", {}).get("tenant", [])
        spend = sum(t["spent_usd"] for t in top)
        for b in budgets.get("budgets", []):
            if b["level"] == "global":
                limit, period, spend = b["limit_usd"], b["period"], b["spent_usd"]
    models = [(m, f"{int(now.slots_busy.get(m, 0))}/{int(now.slots_total.get(m, 0))}", int(now.queue.get(m, 0)))
              for m in sorted(now.slots_total)]
    return Overview(
        requests_per_s=rate(now.requests, then.requests if then else 0),
        tokens_per_s=rate(now.completion_tokens, then.completion_tokens if then else 0),
        errors_per_s=rate(now.errors, then.errors if then else 0),
        ttft_p50_s=quantile(recent, 0.5), ttft_p95_s=quantile(recent, 0.95), models=models,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        verified_cost_hit_rate=now.cache_saved_verified / now.cache_request_cost if now.cache_request_cost else None,
        spend_today_usd=spend, global_limit_usd=limit, global_period=period,
    )


@dataclass(frozen=True)
class BudgetNode:
    label: str
    detail: str
    children: list[BudgetNode] = field(default_factory=list)


def budget_tree(budgets: dict[str, Any]) -> BudgetNode:
    """global → tenants → apps → users, each with spend against its limit; reservations in flight."""
    by_level: dict[str, list[dict[str, Any]]] = {}
    for b in budgets.get("budgets", []):
        by_level.setdefault(b["level"], []).append(b)

    def line(b: dict[str, Any]) -> str:
        held = f" (+{usd(b['held_usd'])} held)" if b["held_usd"] else ""
        return f"{usd(b['spent_usd'])} of {usd(b['limit_usd'])} per {b['period']}{held}"

    glob = next(iter(by_level.get("global", [])), None)
    root = BudgetNode("global", line(glob) if glob else "no limit")
    for level in ("tenant", "app", "user"):
        group = BudgetNode(f"{level}s", f"{len(by_level.get(level, []))} with a limit")
        group.children.extend(BudgetNode(b["name"], line(b)) for b in by_level.get(level, []))
        root.children.append(group)
    reservations = budgets.get("reservations", [])
    flight = BudgetNode("in flight", f"{len(reservations)} reservation{'s' if len(reservations) != 1 else ''}")
    flight.children.extend(BudgetNode(r["request_id"], f"{r['tenant']}/{r['user']} {usd(r['amount_usd'])}") for r in reservations[:20])
    root.children.append(flight)
    return root


def key_rows(keys: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(k["id"], k["tenant"], k["app"], k["user"], k["role"], "admin" if k["admin"] else "",
             "revoked" if k["revoked_at"] else "active") for k in keys.get("keys", [])]


def trace_rows(traces: dict[str, Any], status: str = "all", text: str = "") -> list[tuple[str, ...]]:
    """Newest first; `status` all|ok|error, `text` matched against tenant and model."""
    rows = []
    for t in traces.get("traces", []):
        attributes = t["attributes"]
        if status == "error" and not t["error"] or status == "ok" and t["error"]:
            continue
        tenant, model = str(attributes.get("appliance.tenant", "")), str(attributes.get("appliance.model", ""))
        if text and text.lower() not in f"{tenant} {model}".lower():
            continue
        rows.append((t["trace_id"], t["name"], tenant, model, str(attributes.get("appliance.cache.result", "")),
                     f"{t['duration_ms']:.0f} ms", "error" if t["error"] else "ok"))
    return rows


def timeline(tree: dict[str, Any], width: int = 40) -> list[str]:
    """A trace's spans as indented bars on one time axis."""
    spans: list[tuple[int, dict[str, Any]]] = []

    def walk(nodes: list[dict[str, Any]], depth: int) -> None:
        for node in nodes:
            spans.append((depth, node))
            walk(node["children"], depth + 1)

    walk(tree["spans"], 0)
    if not spans:
        return []
    start = min(n["start_ns"] for _, n in spans)
    end = max(n["start_ns"] + n["duration_ms"] * 1e6 for _, n in spans)
    total = max(1.0, end - start)
    lines = []
    for depth, node in spans:
        left = int((node["start_ns"] - start) / total * width)
        length = max(1, int(node["duration_ms"] * 1e6 / total * width))
        bar = " " * left + "█" * min(length, width - left)
        lines.append(f"{'  ' * depth}{node['name']:<{24 - 2 * depth}} {bar:<{width}} {node['duration_ms']:8.1f} ms"
                     + (" ✗" if node["error"] else ""))
    return lines


CACHE_COLUMNS = ("bucket", "tenant", "role", "model", "entries", "hits", "verified", "consistent", "rejected", "stale")


def cache_rows(stats: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(b["bucket"][:12], b["tenant"], b["role"], b["model"], str(b["entries"]), str(b["hits"] or 0),
             str(b["verified"] or 0), str(b.get("consistent") or 0), str(b["rejected"] or 0), str(b["stale"] or 0))
            for b in stats.get("buckets", [])]


def false_hit_line(stats: dict[str, Any], most: int = 4) -> str:
    """The cache's promise and its own estimate by language, most traps first, in one 80-column
    line: "false hits ≤2.0%, est. en 1.2% pt 0.5%, others exact only" (a language it cannot
    promise anything for serves exact repeats only)."""
    rows = sorted(stats.get("false_hit_bound", {}).items(), key=lambda kv: -kv[1]["traps"])
    if not rows:
        return "false hits: no bound (thresholds decide)"
    shown = [f"{lang} {r['estimate']:.1%}" for lang, r in rows if r["open"]][:most]
    if not shown:
        return f"false hits ≤{rows[0][1]['bound']:.1%}: exact repeats only (too few known near misses)"
    return f"false hits ≤{rows[0][1]['bound']:.1%}, est. " + " ".join(shown) + ", others exact only"


def sparkline(values: list[float], width: int = 30) -> str:
    bars = "▁▂▃▄▅▆▇█"
    values = values[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1)))] for v in values)


# The models table: what `appliance ps` prints, with the engine and kind from GET /admin/models.
MODEL_COLUMNS = ("model", "engine", "kind", "loaded", "MiB", "slots", "queue", "idle", "unloads in")


@dataclass(frozen=True)
class FleetRow:
    """A row of the models table: a configured model, or an old version of one (replaced or
    removed) finishing its requests, which the keys do not act on."""

    alias: str
    retired: bool
    cells: tuple[str, ...]


def mib(n: int | None) -> str:
    return "–" if not n else f"{n / 2**20:.0f}"


def duration(s: float | None) -> str:
    """Seconds as the fewest characters that still read well: 45s, 9m05s, 2h10m."""
    if s is None:
        return "–"
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def residency(m: dict[str, Any]) -> str:
    if m["retired"]:
        return "retiring"  # the old version of a replaced or removed model, ending its requests
    return "loading" if m["loading"] else "yes" if m["loaded"] else "no"


def unloads_in(m: dict[str, Any]) -> str:
    """When a loaded model unloads: never (preloaded, or keep_alive -1), after its keep_alive
    once idle, or when its running requests end."""
    if m["retired"]:
        return "when idle"
    if not m["loaded"]:
        return "–"
    if m["preload"] or m["keep_alive_s"] is None:
        return "never"
    return "when idle" if m["unloads_in_s"] is None else duration(m["unloads_in_s"])


def fleet_rows(models: dict[str, Any], loaded: dict[str, Any]) -> list[FleetRow]:
    """GET /admin/models (engine, kind) and GET /admin/models/loaded (residency, memory, slots,
    queue: the rows `appliance ps` prints) merged by alias, in the server's order; old versions
    finishing their requests last. The two answers are not one snapshot: a model in one only
    shows what that one knows until the next poll."""
    configured = {m["alias"]: m for m in models["models"]}
    resident = {m["alias"]: m for m in loaded["models"] if not m["retired"]}
    rows = [_fleet_row(configured.get(alias) or resident[alias], resident.get(alias))
            for alias in [*configured, *(a for a in resident if a not in configured)]]
    rows.extend(_fleet_row(r, r) for r in loaded["models"] if r["retired"])
    return rows


def _fleet_row(m: dict[str, Any], r: dict[str, Any] | None) -> FleetRow:
    """`m` gives the engine and kind; `r`, its row in /admin/models/loaded, the rest as `appliance ps` shows it."""
    if r is None:
        slots = f"{m['slots_busy']}/{m['slots_total']}"
        return FleetRow(m["alias"], False, (m["alias"], m["engine"], m["kind"], "–", "–", slots, str(m["queue_depth"]), "–", "–"))
    queued = r["queue_depth"] + r["waiting_for_load"]  # requests waiting for the model to load are queued too
    slots = f"{r['slots_busy']}/{r['slots_total']}"
    return FleetRow(r["alias"], r["retired"], (r["alias"], m["engine"], m["kind"], residency(r), mib(r["memory_bytes"]), slots, str(queued),
                                               duration(r["idle_s"]), unloads_in(r)))


def memory_line(loaded: dict[str, Any]) -> str:
    """The memory the loaded models take against the budget that unloads idle ones to make room."""
    used, budget = loaded["loaded_bytes"], loaded["memory_budget_bytes"]
    return f"memory in use: {used / 2**20:.0f} MiB" + (f" of a {budget / 2**20:.0f} MiB budget" if budget else " (no budget)")


def add_model_args(text: str) -> tuple[str, str | None, str | None] | None:
    """`PATH [ALIAS] [like MODEL]` as (path, alias, like); None when it is not that shape. Quotes
    keep a path with spaces in one piece."""
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    like = None
    if len(words) >= 3 and words[-2] == "like":
        words, like = words[:-2], words[-1]
    if len(words) not in (1, 2):
        return None
    return words[0], words[1] if len(words) == 2 else None, like


def adapter_rows(models: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(m["alias"], a["name"], f"{a['scale']:g}", str(a["active_requests"]), a["path"])
            for m in models["models"] for a in m["adapters"]]


def train_args(words: list[str]) -> tuple[str, str, str | None, str | None] | None:
    """`STUDENT DATA [NAME] [at HH:MM]` as (student, data, name, start_at); None when it is not that shape."""
    start_at = None
    if len(words) >= 4 and words[-2] == "at":
        words, start_at = words[:-2], words[-1]
    if len(words) not in (2, 3):
        return None
    return words[0], words[1], words[2] if len(words) == 3 else None, start_at


def running_job(jobs: dict[str, Any]) -> dict[str, Any] | None:
    """The job a stop request would end: the one running (the server runs one at a time)."""
    return next((j for j in jobs["jobs"] if j["state"] == "running"), None)


def progress_bar(fraction: float | None, width: int = 20) -> str:
    """A text bar; an unknown total shows as a moving-free placeholder."""
    if fraction is None:
        return "·" * width
    filled = round(max(0.0, min(fraction, 1.0)) * width)
    return "█" * filled + "░" * (width - filled)


def job_lines(jobs: dict[str, Any], width: int = 20) -> list[str]:
    lines = []
    for j in jobs["jobs"]:
        if j.get("unit", "bytes") == "bytes":
            size = f"{j['done_bytes'] / 1e6:.0f} MB" + (f" of ~{j['total_bytes'] / 1e6:.0f} MB" if j.get("total_bytes") else "")
        else:  # a training job counts steps
            size = f"{j['done']}" + (f" of {j['total']}" if j.get("total") else "") + f" {j['unit']}"
        pct = "" if j["fraction"] is None else f" {j['fraction']:.0%}"
        lines.append(f"{j['kind']:<9}{j['state']:<8}{progress_bar(j['fraction'], width)}{pct}  {j['description']}  {size}")
        if j["message"]:
            lines.append(f"         {j['message']}")
    return lines


_SLOT_MARKS = {"idle": "·", "prefill": "P", "decode": "D", "waiting": "W"}


def slot_lines(models: dict[str, Any], loaded: dict[str, Any] | None = None) -> list[str]:
    """One line per model: each slot's state (· idle, P prefill, D decode, W waiting for another
    slot's prefix), how full the KV cache is, the prompt tokens the prefix cache served and the
    drafted tokens accepted; "not loaded" for a model loaded on demand that is not (`loaded`:
    GET /admin/models/loaded). Columns as wide as this fleet needs, to stay inside 80."""
    absent = {m["alias"] for m in (loaded or {}).get("models", []) if not m["retired"] and not m["loaded"]}
    width = max((len(m["alias"]) for m in models["models"]), default=0)
    marks_width = max((len(m.get("slots", [])) for m in models["models"]), default=0)
    lines = []
    for m in models["models"]:
        if m["alias"] in absent:
            lines.append(f"{m['alias']:<{width}}  not loaded")
        elif m.get("upstreams"):
            # A model on other servers: each upstream's breaker, health and requests in flight.
            parts = [f"{u['name']} {u['breaker'].replace('_', '-')}{'' if u['healthy'] else ' unhealthy'} {u['outstanding']} in flight"
                     for u in m["upstreams"]]
            lines.append(f"{m['alias']:<{width}}  upstream {'; '.join(parts)}")
        else:
            marks = "".join(_SLOT_MARKS.get(s["state"], "?") for s in m.get("slots", []))
            capacity = m.get("kv_capacity_tokens") or 0
            used = f"{m.get('kv_used_tokens', 0) / capacity:.0%}" if capacity else "–"
            lines.append(f"{m['alias']:<{width}}  slots {marks:<{marks_width}}  KV {used} of {capacity} tokens{_reuse(m)}")
    return lines


def _reuse(m: dict[str, Any]) -> str:
    """What the prefix cache and speculation saved, once there is something to count."""
    prefix, spec, said = m.get("prefix") or {}, m.get("speculation_stats") or {}, ""
    if prefix.get("prompt_tokens"):
        reused = sum(prefix.get(k, 0) for k in ("reused_in_slot", "reused_by_copy", "reused_from_host"))
        said += f"  prefix hit {reused / prefix['prompt_tokens']:.0%}"
    if spec.get("drafted"):
        said += f"  drafts accepted {spec['accepted'] / spec['drafted']:.0%}"
    return said
