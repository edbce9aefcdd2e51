"""The model a request names, of the kind its endpoint serves, and the LoRA adapters it asks for on it;
and a route's tier as the model and adapter it runs."""

from __future__ import annotations

from typing import Any

from appliance.config.settings import split_tier
from appliance.fleet.registry import LoadedModel
from appliance.pipeline.errors import APIError, invalid
from appliance.server.services import Services


def resolve_model(services: Services, alias: str, kind: str) -> LoadedModel:
    model = services.registry.get(alias)
    if model is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    if model.settings.kind != kind:
        raise invalid(f"The model '{alias}' is an {model.settings.kind} model and does not serve this endpoint.", "model")
    return model


def model_with_adapters(services: Services, alias: str, chosen: list[Any] | None) -> tuple[LoadedModel, tuple[tuple[str, float], ...]]:
    """The model a request names, and its LoRA adapters: `<alias>:<adapter>` and/or the `adapters`
    field, each at its configured scale unless the request gives one."""
    base, _, named = alias.partition(":")
    by_name = bool(named) and services.registry.get(alias) is None  # `<alias>:<adapter>`
    model = resolve_model(services, base if by_name else alias, "chat")
    wanted: list[tuple[str, float | None]] = [(named, None)] if by_name else []
    wanted += [(a.name, a.scale) for a in chosen or []]
    if not wanted:
        return model, ()
    loaded = {a.name: a for a in model.engine.adapters()}
    out: list[tuple[str, float]] = []
    for name, scale in wanted:
        info = loaded.get(name)
        if info is None:
            raise APIError(404, f"The model '{model.settings.alias}' has no adapter '{name}'.", param="model" if name == named else "adapters",
                           code="model_not_found")
        if any(name == n for n, _ in out):
            raise invalid(f"The adapter '{name}' is named twice.", "adapters")
        if scale is not None and not -10.0 <= scale <= 10.0:
            raise invalid("An adapter's scale must be between -10 and 10.", "adapters")
        out.append((name, info.scale if scale is None else scale))
    return model, tuple(out)


def tier_model(services: Services, tier: str) -> tuple[LoadedModel, tuple[tuple[str, float], ...]]:
    """A route's tier: its model, and the LoRA adapter a distilled tier ("alias:adapter") runs with, at its configured scale."""
    alias, adapter = split_tier(tier)
    model = services.registry.get(alias)
    assert model is not None  # settings checked the tiers
    if adapter is None:
        return model, ()
    scale = next((a.scale for a in model.engine.adapters() if a.name == adapter), 1.0)
    return model, ((adapter, scale),)
