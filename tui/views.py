"""What each screen shows, as pure functions of the admin API's answers: no IO, no widgets, so they
are tested with plain values. (The overview's figures are in tui/overview.py.)"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from rich.cells import cell_len
from rich.text import Text

from policy.budgets import LEVELS, PERIODS
from tui.money import money, typed_usd


def fit(headers: tuple[str, ...], rows: list[tuple[str, ...]], width: int, shrink: tuple[int, ...]) -> list[tuple[str, ...]]:
    """The rows with the cells of the `shrink` columns (the first named, first) cut, ending in `…`,
    until the table is at most `width` wide as a DataTable draws it (a space each side of every
    cell). A column is never cut below its header: past that the table stays wider."""
    widths = [max([cell_len(h), *(cell_len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    excess = sum(widths) + 2 * len(widths) - width
    for i in shrink:
        cut = min(max(excess, 0), widths[i] - cell_len(headers[i]))
        if cut > 0:
            widths[i] -= cut
            excess -= cut
    return [tuple(_cut(cell, widths[i]) for i, cell in enumerate(row)) for row in rows]


def _cut(text: str, width: int) -> str:
    if cell_len(text) <= width:
        return text
    cut = Text(text)
    cut.truncate(width, overflow="ellipsis")
    return cut.plain


@dataclass(frozen=True)
class BudgetNode:
    label: str
    detail: str
    children: list[BudgetNode] = field(default_factory=list)
    edit: str = ""  # what `e` on this row puts in the budget prompt


def budget_tree(budgets: dict[str, Any]) -> BudgetNode:
    """global → tenants, apps, users, each with spend against its limit, and those without a limit
    that spent today (the server's top spenders); reservations in flight."""
    by_level: dict[str, list[dict[str, Any]]] = {}
    for b in budgets.get("budgets", []):
        by_level.setdefault(b["level"], []).append(b)
    spenders = budgets.get("top_spenders_today", {})

    def line(b: dict[str, Any]) -> str:
        held = f" (+{money(b['held_usd'])} held)" if b["held_usd"] else ""
        return f"{money(b['spent_usd'])} of {money(b['limit_usd'])} per {b['period']}{held}"

    def edit(b: dict[str, Any]) -> str:
        return f"{b['level']} {'-' if b['level'] == 'global' else b['name']} {typed_usd(b['limit_usd'])} {b['period']}"

    glob = next(iter(by_level.get("global", [])), None)
    root = BudgetNode("global", line(glob) if glob else "no limit", edit=edit(glob) if glob else "global - ")
    for level in ("tenant", "app", "user"):
        limited = by_level.get(level, [])
        free = [s for s in spenders.get(level, []) if s["name"] not in {b["name"] for b in limited}]
        detail = f"{len(limited)} with a limit" + (f", {len(free)} more spending today" if free else "")
        group = BudgetNode(f"{level}s", detail, edit=f"{level} ")
        group.children.extend(BudgetNode(b["name"], line(b), edit=edit(b)) for b in limited)
        group.children.extend(BudgetNode(s["name"], f"{money(s['spent_usd'])} today, no limit", edit=f"{level} {s['name']} ") for s in free)
        root.children.append(group)
    reservations = budgets.get("reservations", [])
    flight = BudgetNode("in flight", f"{len(reservations)} reservation{'s' if len(reservations) != 1 else ''}")
    flight.children.extend(BudgetNode(r["request_id"], f"{r['tenant']}/{r['user']} {money(r['amount_usd'])}") for r in reservations[:20])
    root.children.append(flight)
    return root


@dataclass(frozen=True)
class BudgetEdit:
    level: str
    name: str
    usd: float
    period: str


def budget_args(text: str) -> BudgetEdit | str:
    """`LEVEL NAME USD PERIOD` (NAME `-`, or left out, for global) as a BudgetEdit, or what is
    wrong with it in one line."""
    words = text.split()
    if words[:1] == ["global"] and len(words) == 3:
        words.insert(1, "-")
    if len(words) != 4:
        return "write LEVEL NAME USD PERIOD, e.g. tenant acme 5 day (global - 100 month)"
    level, name, amount, period = words
    if level not in LEVELS:
        return f"'{level}' is not a level: write user, tenant, app or global"
    if period not in PERIODS:
        return f"'{period}' is not a period: write day, month or total"
    try:
        usd = Decimal(amount.removeprefix("$").replace(",", ""))
    except InvalidOperation:
        usd = Decimal("NaN")
    if not usd.is_finite() or usd < 0:
        return f"'{amount}' is not an amount of dollars: write e.g. 5 or 0.25"
    return BudgetEdit(level, "*" if level == "global" else name, float(usd), period)


def key_rows(keys: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(k["id"], k["tenant"], k["app"], k["user"], k["role"], "admin" if k["admin"] else "",
             "revoked" if k["revoked_at"] else "active") for k in keys.get("keys", [])]


TRACE_COLUMNS = ("trace", "call", "tenant", "model", "cache", "time", "status")
TRACE_SHRINK = (3, 2, 6, 1)  # model, tenant, status, call: the detail below shows each in full
TRACE_ID_SHOWN = 8  # a trace's first characters: Enter opens it by its whole id


def error_reason(attributes: dict[str, Any]) -> str:
    """Why a span failed, from what the server records: `error.type`, the HTTP status and, when a
    span carries one, the message."""
    reason = str(attributes.get("error.type") or "no error.type recorded")
    if status := attributes.get("http.response.status_code"):
        reason += f" (HTTP {status})"
    if message := attributes.get("error.message") or attributes.get("exception.message"):
        reason += f": {message}"
    return reason


def elapsed(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s" if ms < 10_000 else f"{ms / 1000:.0f} s"


def trace_rows(traces: dict[str, Any], status: str = "all", text: str = "") -> list[tuple[str, tuple[str, ...]]]:
    """(trace id, cells), newest first; `status` all|ok|error, `text` matched against tenant and model.
    A failed call's status says why (`✗ model_not_found`)."""
    rows = []
    for t in traces.get("traces", []):
        attributes = t["attributes"]
        if status == "error" and not t["error"] or status == "ok" and t["error"]:
            continue
        tenant = str(attributes.get("appliance.tenant", ""))
        model = str(attributes.get("appliance.model") or attributes.get("gen_ai.request.model", ""))  # a refused call: what it asked for
        if text and text.lower() not in f"{tenant} {model}".lower():
            continue
        call = str(attributes.get("gen_ai.operation.name") or t["name"].split(" ")[0])
        outcome = f"✗ {attributes.get('error.type') or 'error'}" if t["error"] else "ok"
        rows.append((t["trace_id"], (t["trace_id"][:TRACE_ID_SHOWN], call, tenant, model, str(attributes.get("appliance.cache.result", "")),
                                     elapsed(t["duration_ms"]), outcome)))
    return rows


def trace_filter_line(status: str, text: str, shown: int, total: int) -> str:
    """What the traces table is filtered by, for as long as it is, and how to undo it."""
    if status == "all" and not text:
        return f"all {total} traces · f errors or ok only · t tenant or model text"
    said = [{"error": "errors only", "ok": "ok only"}.get(status, "")] + ([f"tenant or model has '{text}'"] if text else [])
    return f"{shown} of {total} traces: {', '.join(s for s in said if s)} · c clears"


def timeline(tree: dict[str, Any], width: int = 40) -> list[str]:
    """A trace's spans as indented bars on one time axis, then why each failed span failed."""
    spans: list[tuple[int, dict[str, Any]]] = []

    def walk(nodes: list[dict[str, Any]], depth: int) -> None:
        for node in nodes:
            spans.append((depth, node))
            walk(node["children"], depth + 1)

    walk(tree["spans"], 0)
    if not spans:
        return []
    # Whole nanoseconds: a float sum with a start near 2e18 is off by hundreds of them, and a bar by a cell.
    start = min(n["start_ns"] for _, n in spans)
    end = max(n["start_ns"] + round(n["duration_ms"] * 1e6) for _, n in spans)
    total = max(1, end - start)
    lines = [f"✗ {node['name']}: {error_reason(node['attributes'])}" for _, node in spans if node["error"]]
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


ENTRY_COLUMNS = ("id", "state", "hits", "tenant", "question", "answer")
ENTRY_SHRINK = (5, 4, 3)  # the answer, the question, then the tenant give up room


def entry_rows(entries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Cache entries found by a search: whose they are and how each answer starts, so two tenants'
    identical questions read apart."""
    return [(str(e["id"]), e["state"], str(e["hits"]), e["tenant"], " ".join(e["question"].split()), " ".join(e["answer"].split()))
            for e in entries]


def false_hit_line(stats: dict[str, Any], most: int = 4) -> str:
    """The cache's promise and its own estimate by language, most traps first, in one 80-column
    line: "false hits ≤2.0%, est. en 1.2% pt 0.5%, others exact only" (a language it cannot
    promise anything for serves exact repeats only)."""
    rows = sorted(stats.get("false_hit_bound", {}).items(), key=lambda kv: -kv[1]["traps"])
    if not rows:
        return "false hits: no bound (thresholds decide)"
    # A judge with a cut of its own in some language: the estimate is of the two together.
    judged = " +judge" if any((r.get("judge") or {}).get("cut") is not None for _, r in rows) else ""
    shown = [f"{lang} {r['estimate']:.1%}" for lang, r in rows if r["open"]][:most - bool(judged)]
    if not shown:
        return f"false hits ≤{rows[0][1]['bound']:.1%}: exact repeats only (too few known near misses)"
    return f"false hits ≤{rows[0][1]['bound']:.1%}{judged}, est. " + " ".join(shown) + ", others exact only"


# The models table: what `appliance ps` prints, with the engine and kind from GET /admin/models.
MODEL_COLUMNS = ("model", "engine", "kind", "loaded", "MiB", "slots", "queue", "idle", "unloads in")
MODEL_SHRINK = (0, 1)  # the alias (whole in the slot lines below, and in what x asks), then the engine
KINDS = {"embedding": "embed"}  # short enough that "unloads in" fits at 80 columns with two models


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
        return FleetRow(m["alias"], False, (m["alias"], m["engine"], KINDS.get(m["kind"], m["kind"]), "–", "–", slots, str(m["queue_depth"]),
                                            "–", "–"))
    queued = r["queue_depth"] + r["waiting_for_load"]  # requests waiting for the model to load are queued too
    slots = f"{r['slots_busy']}/{r['slots_total']}"
    return FleetRow(r["alias"], r["retired"], (r["alias"], m["engine"], KINDS.get(m["kind"], m["kind"]), residency(r), mib(r["memory_bytes"]),
                                               slots, str(queued), duration(r["idle_s"]), unloads_in(r)))


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
