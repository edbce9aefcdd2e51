"""What a new config changes in the running fleet: the pure decision behind applying a config
without a restart.

The models and the routes change while the server runs; every other section (the server's address,
auth, budgets, limits, the cache, tracing, guardrails) is read once at start, so a change there is
named for the operator and takes effect at the next start.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from appliance.settings import ModelSettings, Settings

# Sections that change while the server runs; `defaults` is already folded into each model.
HOT_SECTIONS = frozenset({"file", "models", "routes", "defaults"})


@dataclass(frozen=True)
class FleetChange:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # served again from new settings: their running requests finish first
    routes_changed: bool = False
    restart_sections: tuple[str, ...] = ()  # changed in the file, applied at the next start

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.routes_changed)

    def view(self) -> dict[str, object]:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed),
                "routes_changed": self.routes_changed, "restart_needed_for": list(self.restart_sections)}


def _served(settings: Settings) -> dict[str, ModelSettings]:
    return {m.alias: m for m in settings.models if m.kind != "draft"}


def fleet_change(old: Settings, new: Settings, read_at_start: Settings | None = None) -> FleetChange:
    """Models are compared whole: any setting that differs serves the model again. A model whose
    draft model changed is changed too, since the draft is loaded inside it. The sections read
    once are compared with the file as it was read at start (`read_at_start`, before `serve
    --port` and the like; `old` when not given)."""
    before, after = _served(old), _served(new)
    changed = {a for a in before.keys() & after.keys() if before[a] != after[a]}
    for alias in before.keys() & after.keys():
        draft = after[alias].draft_model if after[alias].speculation_mode == "draft" else None
        if draft is not None and old.model(draft) != new.model(draft):
            changed.add(alias)
    start = read_at_start or old
    restart = [f.name for f in fields(Settings) if f.name not in HOT_SECTIONS and getattr(start, f.name) != getattr(new, f.name)]
    # The semantic cache holds its embedder model from start (its vectors are that model's).
    embedder = old.cache.embedder if old.cache.enabled else None
    if embedder in changed:
        changed.discard(embedder)
        restart.append(f"models.{embedder} (the cache's embedder)")
    return FleetChange(
        added=tuple(a for a in after if a not in before),
        removed=tuple(a for a in before if a not in after),
        changed=tuple(a for a in after if a in changed),
        routes_changed=old.routes != new.routes,
        restart_sections=tuple(restart),
    )


def running_settings(old: Settings, new: Settings, change: FleetChange) -> Settings:
    """The settings the server runs on after applying `new`: its models and routes, and the
    sections read at start as they were (a model held from start, as it was)."""
    held = {m.alias: m for m in old.models if f"models.{m.alias} (the cache's embedder)" in change.restart_sections}
    models = tuple(held.get(m.alias, m) for m in new.models)
    return replace(old, models=models, routes=new.routes, defaults=new.defaults)
