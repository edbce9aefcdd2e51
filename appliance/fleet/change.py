"""What a new config changes in the running fleet: the pure decision behind applying a config
without a restart.

The models and the routes change while the server runs; every other section (the server's address,
auth, budgets, limits, the cache, tracing, guardrails) is read once at start, so a change there is
named for the operator and takes effect at the next start.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

import msgspec

from appliance.config.settings import AdapterSettings, LocalModel, ModelSettings, Settings, UpstreamModel

# Sections that change while the server runs; `defaults` is already folded into each model.
HOT_SECTIONS = frozenset({"file", "models", "routes", "defaults"})


@dataclass(frozen=True)
class FleetChange:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # served again from new settings: their running requests finish first
    adapters: tuple[str, ...] = ()  # only their adapters differ: the running model swaps them
    routes_changed: bool = False
    restart_sections: tuple[str, ...] = ()  # changed in the file, applied at the next start

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.adapters or self.routes_changed)

    def view(self) -> dict[str, object]:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed),
                "adapters_changed": list(self.adapters),
                "routes_changed": self.routes_changed, "restart_needed_for": list(self.restart_sections)}


def _served(settings: Settings) -> dict[str, ModelSettings]:
    return {m.alias: m for m in settings.models if m.kind != "draft"}


@dataclass(frozen=True)
class AdapterSwap:
    """What a running model does to serve another set of adapters."""

    unload: tuple[str, ...]
    load: tuple[AdapterSettings, ...]  # new ones, and ones replacing another file or scale of the same name


def adapter_swap(old: ModelSettings, new: ModelSettings) -> AdapterSwap | None:
    """The swap from `old`'s adapters to `new`'s; None when the two differ in more than their
    adapters (the model is served again), or are not local models (upstream ones have none)."""
    if not (isinstance(old, LocalModel) and isinstance(new, LocalModel)) or msgspec.structs.replace(old, adapters=new.adapters) != new:
        return None
    before, after = {a.name: a for a in old.adapters}, {a.name: a for a in new.adapters}
    return AdapterSwap(unload=tuple(n for n in before if n not in after),
                       load=tuple(a for n, a in after.items() if before.get(n) != a))


def fleet_change(old: Settings, new: Settings, read_at_start: Settings | None = None) -> FleetChange:
    """Models are compared whole: any setting that differs serves the model again, except the
    adapters alone, which the running model swaps (a distilled adapter registered beside its
    student). A model whose draft model changed is changed too, since the draft is loaded inside it. The sections read
    once are compared with the file as it was read at start (`read_at_start`, before `serve
    --port` and the like; `old` when not given)."""
    before, after = _served(old), _served(new)
    differ = {a for a in before.keys() & after.keys() if before[a] != after[a]}
    swapped = {a for a in differ if adapter_swap(before[a], after[a]) is not None}
    changed = differ - swapped
    for alias in before.keys() & after.keys():
        draft = after[alias].draft_model if after[alias].speculation_mode == "draft" else None
        if draft is not None and old.model(draft) != new.model(draft):
            changed.add(alias)
    swapped -= changed
    start = read_at_start or old
    restart = [f.name for f in fields(Settings) if f.name not in HOT_SECTIONS and getattr(start, f.name) != getattr(new, f.name)]
    # The semantic cache holds its embedder model from start (its vectors are that model's).
    embedder = old.cache.embedder if old.cache.enabled else None
    if embedder in changed or embedder in swapped:
        changed.discard(embedder)
        swapped.discard(embedder)
        restart.append(f"models.{embedder} (the cache's embedder)")
    return FleetChange(
        added=tuple(a for a in after if a not in before),
        removed=tuple(a for a in before if a not in after),
        changed=tuple(a for a in after if a in changed),
        adapters=tuple(a for a in after if a in swapped),
        routes_changed=old.routes != new.routes,
        restart_sections=tuple(restart),
    )


def running_settings(old: Settings, new: Settings, change: FleetChange) -> Settings:
    """The settings the server runs on after applying `new`: its models and routes, and the
    sections read at start as they were (a model held from start, as it was)."""
    held = {m.alias: m for m in old.models if f"models.{m.alias} (the cache's embedder)" in change.restart_sections}
    models = tuple(held.get(m.alias, m) for m in new.models)
    return replace(old, models=models, routes=new.routes, defaults=new.defaults)


def key_destinations(settings: Settings) -> set[tuple[str, str]]:
    """(environment variable, origin) for every upstream server the settings send a key to."""
    out = set()
    for m in settings.models:
        if isinstance(m, UpstreamModel):
            for u in m.upstreams:
                if u.api_key_env is not None:
                    parts = urlsplit(u.base_url)
                    out.add((u.api_key_env, f"{parts.scheme}://{parts.netloc}".lower()))
    return out


def new_key_destinations(old: Settings, new: Settings) -> list[str]:
    """Keys `new` would send to a server `old` never sent them to. An admin edit may not make
    one: a key the owner put in the environment goes only where the owner's file sends it."""
    return sorted(f"{env} to {origin}" for env, origin in key_destinations(new) - key_destinations(old))
