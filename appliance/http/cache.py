"""Cache feedback for callers, and the cache's admin endpoints (stats per bucket, search,
invalidate, mark entries, run a sweep, add labelled near misses, the measures)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, get, post

from appliance.http.prologue import authenticate
from appliance.pipeline.errors import APIError, invalid
from appliance.server.services import Services
from appliance.store import kept_answers
from appliance.store.answer_entries import LabelledTrap, TrapsFull
from appliance.wire.decode import decode_body
from policy.budgets import usd


class FeedbackBody(msgspec.Struct, forbid_unknown_fields=True):
    response_id: str
    rating: Literal["good", "bad"]


class InvalidateBody(msgspec.Struct, forbid_unknown_fields=True):
    bucket: str | None = None
    tenant: str | None = None
    prompt_version: str | None = None


# Bounds on what an operator may add in one call: the pairs are embedded and scored before the reply.
MAX_TRAPS = 5000
MAX_TRAP_CHARS = 2000


class TrapPair(msgspec.Struct, forbid_unknown_fields=True):
    cached: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRAP_CHARS)]
    asked: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRAP_CHARS)]


class TrapsBody(msgspec.Struct, forbid_unknown_fields=True):
    """Pairs of questions that need different answers (a near miss: a negation, another entity,
    number or scope), in any language; for every tenant, or one."""
    pairs: Annotated[list[TrapPair], msgspec.Meta(min_length=1, max_length=MAX_TRAPS)]
    tenant: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


class MarkBody(msgspec.Struct, forbid_unknown_fields=True):
    state: Literal["verified", "rejected", "stale"]


def _ready(services: Services) -> None:
    if not services.cache.ready:
        raise APIError(409, "The semantic cache is disabled in this server's config.", code="cache_disabled")


@post("/v1/cache/feedback", status_code=200)
async def feedback(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """good: the answer behind this response is verified; bad: it is rejected, never served again,
    nor trained on where distillation keeps the caller's answers (then also with the cache off)."""
    principal = await authenticate(request, services)
    collecting = principal.tenant in services.settings.distill.tenants
    if not collecting:
        _ready(services)
    body: FeedbackBody = decode_body(await request.body(), FeedbackBody)
    result = await services.cache.feedback(body.response_id, body.rating, principal.tenant) if services.cache.ready else None
    kept = collecting and await services.store.run(lambda db: kept_answers.rate(db, principal.tenant, body.response_id, body.rating))
    if result is None and not kept:
        raise APIError(404, f"No cached or stored answer of yours has the response id '{body.response_id}'.",
                       type="not_found_error", param="response_id", code="response_not_found")
    entry_id, was_hit = result if result is not None else (None, False)
    return {"entry_id": entry_id, "was_hit": was_hit, "state": "verified" if body.rating == "good" else "rejected"}


async def _admin(request: Request[Any, Any, Any], services: Services) -> None:
    services.gate.require_admin(await authenticate(request, services))
    _ready(services)


def _entry(e: Any) -> dict[str, Any]:
    return {"id": e.id, "bucket": e.bucket, "tenant": e.tenant, "role": e.role, "model": e.model, "question": e.question,
            "answer": e.answer, "state": e.state, "hits": e.hits, "created_at": e.created_at, "cost_usd": usd(e.cost_nanos),
            "response_id": e.response_id}


@get("/admin/cache")
async def cache_stats(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    m = services.metrics

    def total(counter: Any) -> float:
        return sum(sample.value for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total"))

    lookups = {r: m.cache_lookups.labels(r)._value.get() for r in ("hit", "miss", "bypass")}
    saved_verified = m.cache_saved_usd.labels("verified")._value.get()
    all_cost = m.cache_request_cost_usd._value.get()
    cacheable = lookups["hit"] + lookups["miss"]
    return {
        "since_start": {
            "lookups": lookups,
            "hit_rate": lookups["hit"] / cacheable if cacheable else None,
            "cost_weighted_verified_hit_rate": saved_verified / all_cost if all_cost else None,
            "saved_usd": total(m.cache_saved_usd),
            "false_hits_reported": m.cache_false_hits._value.get(),
            "judge_calls": m.cache_judge_calls._value.get(),
            "sweep_checks": {o: m.cache_sweeps.labels(o)._value.get() for o in ("agreed", "drifted")},
        },
        # Per language: the share of near misses the cache may serve, and its own estimate of the share it does.
        "false_hit_bound": services.cache.bounds.summary(),
        "buckets": await services.cache.admin(lambda store: store.stats()),
    }


@get("/admin/cache/entries")
async def search_entries(request: Request[Any, Any, Any], services: Services, q: str = "", tenant: str | None = None) -> dict[str, Any]:
    await _admin(request, services)
    entries = await services.cache.admin(lambda store: store.search(q, tenant))
    return {"entries": [_entry(e) for e in entries]}


@post("/admin/cache/entries/{entry_id:int}", status_code=200)
async def mark_entry(request: Request[Any, Any, Any], services: Services, entry_id: int) -> dict[str, Any]:
    await _admin(request, services)
    body: MarkBody = decode_body(await request.body(), MarkBody)
    changed = await services.cache.admin(lambda store: store.set_state(entry_id, body.state, "admin"))
    if not changed:
        raise APIError(404, f"No entry {entry_id} whose state can change (a rejected entry stays rejected).",
                       type="not_found_error", code="entry_not_found")
    return {"id": entry_id, "state": body.state}


@post("/admin/cache/invalidate", status_code=200)
async def invalidate(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    body: InvalidateBody = decode_body(await request.body(), InvalidateBody)
    if body.bucket is None and body.tenant is None and body.prompt_version is None:
        raise invalid("Give a bucket, a tenant or a prompt_version to invalidate.", "bucket")
    count = await services.cache.admin(lambda store: store.invalidate(bucket=body.bucket, tenant=body.tenant, prompt_version=body.prompt_version))
    return {"invalidated": count}


@post("/admin/cache/traps", status_code=200)
async def add_traps(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Labelled near misses, counted in the error bound of their language: how a team whose language
    the appliance ships too few traps for opens its cache to more than exact repeats."""
    await _admin(request, services)
    body: TrapsBody = decode_body(await request.body(), TrapsBody)
    same = next((i for i, p in enumerate(body.pairs) if p.cached.strip() == p.asked.strip()), None)
    if same is not None:
        raise invalid("A near miss needs two different questions; these are the same.", f"pairs[{same}]")
    try:
        added = await services.cache.add_traps([LabelledTrap(body.tenant or "", p.cached, p.asked) for p in body.pairs])
    except TrapsFull as exc:
        raise APIError(409, f"No pair was added: {exc}.", param="pairs", code="traps_full") from None
    return {"added": added, "false_hit_bound": services.cache.bounds.summary()}


@post("/admin/cache/sweep", status_code=200)
async def sweep(request: Request[Any, Any, Any], services: Services, limit: int = 8) -> dict[str, Any]:
    await _admin(request, services)
    return await services.cache.sweep(limit)


ROUTES = [feedback, cache_stats, search_entries, mark_entry, invalidate, add_traps, sweep]
