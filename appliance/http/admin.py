"""The admin API: keys and budgets. Every route needs an admin key (or an open principal the
config makes admin). Scripts, the CLI's remote use and the TUI all go through these."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, delete, get, post, put

from appliance.http.prologue import authenticate
from appliance.pipeline.errors import APIError, invalid
from appliance.server.services import Services
from appliance.store.keys import KeyStore, LastAdminKey
from appliance.store.ledger import Ledger, LedgerError
from appliance.wire.decode import decode_body
from policy.budgets import GLOBAL_NAME, LEVELS, PERIODS, nanos_from_usd, usd
from policy.identity import KeyRecord


class BudgetBody(msgspec.Struct, forbid_unknown_fields=True):
    level: str
    usd: float
    period: str
    name: str = GLOBAL_NAME


class ResetBody(msgspec.Struct, forbid_unknown_fields=True):
    level: str
    name: str = GLOBAL_NAME
    period: str | None = None  # default: the period of the level's budget


class KeyBody(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    app: str
    user: str
    role: str
    admin: bool = False
    expires_in_s: float | None = None


async def _admin(request: Request[Any, Any, Any], services: Services) -> None:
    services.gate.require_admin(await authenticate(request, services))


def confined(text: str, roots: tuple[Path, ...]) -> Path | None:
    """`text` with `~` and every symlink resolved, if that lies inside one of `roots`; a relative
    path starts at the first root. None for anything else, looked at no further."""
    try:
        path = Path(text).expanduser()
        path = (path if path.is_absolute() else roots[0] / path).resolve()
        return path if any(path.is_relative_to(root.resolve()) for root in roots) else None
    except (OSError, RuntimeError, ValueError):  # a NUL byte, an unknown ~user, a symlink loop
        return None


def server_path(services: Services, text: str, param: str) -> Path:
    """A path the admin API was given, confined to the data directory and [server] model_dirs. The
    refusal reads the same whether or not the file exists, so the API cannot probe the machine."""
    path = confined(text, services.settings.server.api_path_roots)
    if path is None:
        raise path_not_allowed(param)
    return path


def path_not_allowed(param: str) -> APIError:
    return APIError(403, f"{param} must name a file inside the server's data directory or a folder in [server] model_dirs.",
                    type="permission_error", param=param, code="path_not_allowed")


def _check_level(level: str, name: str) -> str:
    if level not in LEVELS:
        raise invalid(f"'{level}' is not a level: expected one of {', '.join(LEVELS)}.", "level")
    if level == "global":
        return GLOBAL_NAME
    if not name or name == GLOBAL_NAME:
        raise invalid(f"A {level} budget needs the {level}'s name.", "name")
    return name


def _budgets_view(services: Services) -> Any:
    now = time.time()

    def read(db: Any) -> dict[str, Any]:
        ledger = Ledger(db)
        budgets = [
            {
                "level": b.level, "name": b.name, "period": b.period, "window": b.window, "limit_usd": usd(b.limit_nanos),
                "spent_usd": usd(b.spent_nanos), "held_usd": usd(b.held_nanos),
                "remaining_usd": usd(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos)),
            }
            for b in ledger.budgets(now)
        ]
        reservations = [{**r, "amount_usd": usd(int(r.pop("amount_nanos")))} for r in ledger.reservations()]  # type: ignore[arg-type]
        # Spend is kept for every user, tenant and app, with a budget or without: who spends most, by period.
        top = {
            f"top_spenders_{'today' if period == 'day' else 'month'}": {
                level: [{"name": name, "spent_usd": usd(spent)} for name, spent in ledger.top_spenders(level, period, now)]
                for level in ("user", "tenant", "app")
            }
            for period in ("day", "month")
        }
        # Everyone's spend (the global row is kept with or without a global budget): what the top lists leave out.
        spent = {f"spent_{'today' if period == 'day' else 'month'}_usd": usd(ledger.spent("global", "", period, now)[0])
                 for period in ("day", "month")}
        return {"budgets": budgets, "reservations": reservations, **top, **spent}

    return services.store.run(read)


@get("/admin/budgets")
async def get_budgets(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    return await _budgets_view(services)


@put("/admin/budgets", status_code=200)
async def put_budget(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    body: BudgetBody = decode_body(await request.body(), BudgetBody)
    name = _check_level(body.level, body.name)
    if body.period not in PERIODS:
        raise invalid(f"'{body.period}' is not a period: expected one of {', '.join(PERIODS)}.", "period")
    if not body.usd >= 0:
        raise invalid("A budget must be zero or more dollars.", "usd")
    now = time.time()
    await services.store.run(lambda db: Ledger(db).set_limit(body.level, name, nanos_from_usd(body.usd), body.period, now))
    return await _budgets_view(services)


@delete("/admin/budgets/{level:str}/{name:str}", status_code=200)
async def delete_budget(request: Request[Any, Any, Any], services: Services, level: str, name: str) -> dict[str, Any]:
    await _admin(request, services)
    name = _check_level(level, name)
    if not await services.store.run(lambda db: Ledger(db).remove_limit(level, name)):
        raise APIError(404, f"There is no budget for {level} '{name}'.", type="not_found_error", code="budget_not_found")
    return await _budgets_view(services)


@post("/admin/budgets/reset", status_code=200)
async def reset_budget(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    body: ResetBody = decode_body(await request.body(), ResetBody)
    name = _check_level(body.level, body.name)
    now = time.time()

    def reset(db: Any) -> int:
        ledger = Ledger(db)
        period = body.period or next((b.period for b in ledger.budgets(now) if (b.level, b.name) == (body.level, name)), None)
        if period not in PERIODS:
            raise LedgerError(f"give a period ({', '.join(PERIODS)}): {body.level} '{name}' has no budget to take it from")
        return ledger.reset_spend(body.level, name, period, now)

    try:
        written_off = await services.store.run(reset)
    except LedgerError as exc:
        raise invalid(str(exc), "period") from None
    return {"written_off_usd": usd(written_off), **(await _budgets_view(services))}


@get("/admin/ledger/check")
async def check_ledger(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    problems = await services.store.run(lambda db: Ledger(db).imbalances())
    return {"balanced": not problems, "problems": problems}


def _key_view(record: KeyRecord) -> dict[str, Any]:
    return {
        "id": record.id, "tenant": record.tenant, "app": record.app, "user": record.user, "role": record.role,
        "admin": record.admin, "created_at": record.created_at, "expires_at": record.expires_at, "revoked_at": record.revoked_at,
    }


@get("/admin/keys")
async def list_keys(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    principal = await authenticate(request, services)
    services.gate.require_admin(principal)
    records = await services.store.run(lambda db: KeyStore(db).all())
    # `caller`: the key this request came with (None in open mode), so a client can tell its own row.
    return {"keys": [_key_view(r) for r in records], "caller": principal.key_id}


@post("/admin/keys", status_code=201)
async def create_key(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    body: KeyBody = decode_body(await request.body(), KeyBody)
    now = time.time()
    if body.expires_in_s is not None and body.expires_in_s <= 0:
        raise invalid("expires_in_s must be positive.", "expires_in_s")
    expires = now + body.expires_in_s if body.expires_in_s is not None else None
    try:
        record, secret = await services.store.run(lambda db: KeyStore(db).create(
            user=body.user, tenant=body.tenant, app=body.app, role=body.role, admin=body.admin, now=now, expires_at=expires))
    except ValueError as exc:
        raise invalid(str(exc)) from None
    return {**_key_view(record), "secret": secret}


@delete("/admin/keys/{key_id:str}", status_code=200)
async def revoke_key(request: Request[Any, Any, Any], services: Services, key_id: str) -> dict[str, Any]:
    await _admin(request, services)
    now = time.time()
    try:
        revoked = await services.store.run(lambda db: KeyStore(db).revoke(key_id, now))
    except LastAdminKey as exc:
        raise APIError(409, str(exc), param="key_id", code="last_admin_key") from None
    if not revoked:
        raise APIError(404, f"There is no active key {key_id}.", type="not_found_error", code="key_not_found")
    services.gate.forget_key(key_id)
    return {"id": key_id, "revoked_at": now}


@get("/admin/auth/failures")
async def auth_failures(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    services.gate.flush_failures()  # the store runs calls in order: the read below sees what was counted
    return {"failures": await services.store.run(lambda db: KeyStore(db).failures())}


@get("/admin/traces")
async def list_traces(request: Request[Any, Any, Any], services: Services, limit: int = 50, name: str | None = None) -> dict[str, Any]:
    await _admin(request, services)
    from appliance.store.traces import recent_traces

    return {"traces": await services.store.run(lambda db: recent_traces(db, max(1, min(limit, 1000)), name))}


@get("/admin/traces/{trace_id:str}")
async def get_trace(request: Request[Any, Any, Any], services: Services, trace_id: str) -> dict[str, Any]:
    await _admin(request, services)
    from appliance.store.traces import trace_tree

    tree = await services.store.run(lambda db: trace_tree(db, trace_id.lower()))
    if tree is None:
        raise APIError(404, f"There is no stored trace {trace_id} (traces are kept {services.settings.tracing.retention_days:g} days).",
                       type="not_found_error", code="trace_not_found")
    return tree


ROUTES = [list_traces, get_trace, get_budgets, put_budget, delete_budget, reset_budget, check_ledger, list_keys, create_key, revoke_key, auth_failures]
