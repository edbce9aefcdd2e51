"""The admin API for loaded models: what each is doing, and its LoRA adapters, loaded and unloaded
at runtime without reloading the base model. Adapters loaded here last until a restart; declare
them in models.toml to keep them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, delete, get, put

from appliance.api.admin_routes import _admin
from appliance.api.common import decode_body
from appliance.api.errors import APIError, invalid
from appliance.registry import LoadedModel
from appliance.services import Services
from appliance.settings import ADAPTER_NAME
from engines.base import EngineError, UnknownAdapter


class AdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    scale: float = 1.0


def _loaded(services: Services, alias: str) -> LoadedModel:
    model = services.registry.get(alias)
    if model is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    if not hasattr(model.engine, "adapters"):
        raise invalid(f"The model '{alias}' runs on an engine without adapters.", "model")
    return model


def _model_view(model: LoadedModel) -> dict[str, Any]:
    s = model.settings
    stats = model.engine.stats()
    return {
        "alias": s.alias, "engine": model.engine.name, "kind": s.kind, "tier": s.tier, "context_length": model.engine.context_length,
        "slots_total": stats.slots_total, "slots_busy": stats.slots_busy, "queue_depth": stats.queue_depth,
        "speculation": s.speculation_mode, "draft_model": s.draft_model, "prefix_cache": s.prefix_cache,
        "prefix": dataclasses.asdict(stats.prefix) if stats.prefix else None,
        "speculation_stats": dataclasses.asdict(stats.speculation) if stats.speculation else None,
        "adapters": [dataclasses.asdict(a) for a in model.engine.adapters()] if hasattr(model.engine, "adapters") else [],
    }


@get("/admin/models")
async def list_loaded_models(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    return {"models": [_model_view(m) for m in services.registry.all()]}


@get("/admin/models/{alias:str}/adapters")
async def list_adapters(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    await _admin(request, services)
    return {"adapters": [dataclasses.asdict(a) for a in _loaded(services, alias).engine.adapters()]}


@put("/admin/models/{alias:str}/adapters/{name:str}", status_code=200)
async def load_adapter(request: Request[Any, Any, Any], services: Services, alias: str, name: str) -> dict[str, Any]:
    await _admin(request, services)
    model = _loaded(services, alias)
    body: AdapterBody = decode_body(await request.body(), AdapterBody)
    if not ADAPTER_NAME.match(name):
        raise invalid("An adapter's name takes letters, digits, '.', '_' or '-' (no ':'), up to 64 characters.", "name")
    if not -10.0 <= body.scale <= 10.0:
        raise invalid("scale must be between -10 and 10.", "scale")
    path = Path(body.path).expanduser()
    if not path.is_file():
        raise invalid(f"There is no file {path} on the server.", "path")
    try:
        info = await model.engine.load_adapter(name, path.resolve(), body.scale)
    except EngineError as exc:
        raise APIError(409 if "serving requests" in str(exc) else 400, str(exc), param="path", code="adapter_not_loaded") from None
    return {"adapter": dataclasses.asdict(info)}


@delete("/admin/models/{alias:str}/adapters/{name:str}", status_code=200)
async def unload_adapter(request: Request[Any, Any, Any], services: Services, alias: str, name: str) -> dict[str, Any]:
    await _admin(request, services)
    model = _loaded(services, alias)
    try:
        await model.engine.unload_adapter(name)
    except UnknownAdapter as exc:
        raise APIError(404, str(exc), param="name", code="adapter_not_found") from None
    except EngineError as exc:
        raise APIError(409, str(exc), param="name", code="adapter_in_use") from None
    return {"unloaded": name}


ROUTES = [list_loaded_models, list_adapters, load_adapter, unload_adapter]
