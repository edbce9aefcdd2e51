"""Typed settings parsed once from `models.toml`.

Each key is declared once, as a field of a frozen struct (fields.py, models.py, sections.py): type, default, bounds and a
one-line description. The reader, `appliance config check`, the writer (appliance/config/writer.py)
and the reference (docs/config.md, `appliance config docs`) all read these declarations
(appliance/config/schema.py). What one key cannot say alone (one source per model, a draft model
that exists) is checked in `parse_settings` after. Every error names the file and the dotted key.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config.fields import NAME, NAME_RULE, table_at
from appliance.config.models import (
    AdapterSettings,
    LocalModel,
    ModelSettings,
    UpstreamModel,
    model_type,
    names_template_file,
    read_models,
)
from appliance.config.paths import default_data_dir
from appliance.config.schema import ConfigError, Where, check_known, decode
from appliance.config.sections import (
    BUNDLED_EMBEDDERS,
    AuthSettings,
    BudgetSettings,
    CacheSettings,
    Defaults,
    DistillSettings,
    GuardrailSettings,
    LimitSettings,
    RouteSettings,
    ServerSettings,
    TracingSettings,
    read_cache,
    read_limits,
    read_routes,
)
from policy.limits import LimitRule
from policy.router import split_tier

log = logging.getLogger("appliance")

# The whole file's types, read from one place (each declared in fields.py, models.py or sections.py).
__all__ = [
    "NAME", "NAME_RULE", "SECTIONS", "AdapterSettings", "AuthSettings", "BudgetSettings", "CacheSettings", "ConfigError", "Defaults",
    "DistillSettings", "GuardrailSettings", "LimitSettings", "LocalModel", "ModelSettings", "RouteSettings", "ServerSettings", "Settings",
    "TracingSettings", "UpstreamModel", "config_to_serve", "find_config", "load_settings", "names_template_file", "parse_settings", "split_tier", "table_type",
]


@dataclass(frozen=True)
class Section:
    """A top-level key of models.toml: a table, or an array of tables."""

    name: str
    types: tuple[type, ...]
    array: bool = False


SECTIONS = (
    Section("server", (ServerSettings,)), Section("defaults", (Defaults,)), Section("models", (LocalModel, UpstreamModel), array=True),
    Section("auth", (AuthSettings,)), Section("budgets", (BudgetSettings,)), Section("limits", (LimitSettings,), array=True),
    Section("cache", (CacheSettings,)), Section("tracing", (TracingSettings,)), Section("routes", (RouteSettings,), array=True),
    Section("guardrails", (GuardrailSettings,)), Section("distill", (DistillSettings,)),
)


def table_type(section: str, table: dict[str, Any]) -> type:
    """The struct that declares one table of a section: a [[models]] table is an upstream model
    when its engine is "openai", a local one otherwise."""
    types = next(s.types for s in SECTIONS if s.name == section)
    return model_type(table) if section == "models" else types[0]


@dataclass(frozen=True)
class Settings:
    file: Path
    server: ServerSettings
    defaults: Defaults
    models: tuple[ModelSettings, ...]
    auth: AuthSettings = field(default_factory=AuthSettings)
    budgets: BudgetSettings = field(default_factory=BudgetSettings)
    limits: tuple[LimitRule, ...] = ()
    cache: CacheSettings = field(default_factory=CacheSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    routes: tuple[RouteSettings, ...] = ()
    guardrails: GuardrailSettings = field(default_factory=GuardrailSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)

    @property
    def guard_pii(self) -> str:
        return self.guardrails.pii

    @property
    def guard_judge_model(self) -> str | None:
        return self.guardrails.judge_model

    @property
    def guard_judge_action(self) -> str:
        return self.guardrails.judge_action

    @property
    def guard_judge_threshold(self) -> float:
        return self.guardrails.judge_threshold

    def route(self, alias: str) -> RouteSettings | None:
        return next((r for r in self.routes if r.alias == alias), None)

    def model(self, alias: str) -> ModelSettings | None:
        return next((m for m in self.models if m.alias == alias), None)


def parse_settings(text: str, file: str = "models.toml", base: Path | None = None) -> Settings:
    """Parse config text; raises ConfigError naming `file` and the key at fault."""
    where = Where(file, base or Path(file).resolve().parent)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "(syntax)", str(exc)) from None
    check_known(raw, frozenset(s.name for s in SECTIONS), "", where)
    models = read_models(raw, where)

    def table(cls: type, name: str) -> Any:
        return decode(cls, table_at(raw, name, where), name, where)

    settings = Settings(
        file=Path(file), server=table(ServerSettings, "server"), defaults=table(Defaults, "defaults"), models=models,
        auth=table(AuthSettings, "auth"), budgets=table(BudgetSettings, "budgets"), limits=read_limits(raw, where),
        cache=read_cache(raw, where), tracing=table(TracingSettings, "tracing"), routes=read_routes(raw, models, where),
        guardrails=table(GuardrailSettings, "guardrails"), distill=table(DistillSettings, "distill"),
    )
    # The judges answer through a grammar, which only a local model takes.
    judge = settings.guardrails.judge_model
    if judge is not None and (not isinstance(target := settings.model(judge), LocalModel) or target.kind != "chat"):
        raise where.fail("guardrails.judge_model", f"{judge!r} is not the alias of a local chat model in this file (the judge answers through a grammar)")
    cache = settings.cache
    if cache.enabled and cache.embedder not in BUNDLED_EMBEDDERS:
        target = settings.model(cache.embedder)
        if target is None or target.kind != "embedding":
            shipped = ", ".join(f'"{name}"' for name in BUNDLED_EMBEDDERS)
            raise where.fail("cache.embedder", f"{cache.embedder!r} is neither {shipped} nor the alias of a model of kind \"embedding\"")
    if cache.enabled and cache.embedder == "e5-small":
        # E5's cosines are compressed: unrelated questions reach 0.80 (with MiniLM, 0.3), so MiniLM's floor admits anything.
        for key, value in (("similarity_threshold", cache.similarity_threshold), ("judge_band", cache.judge_band)):
            if value < 0.8:
                raise where.fail(f"cache.{key}", f"{value} is below the cosines of unrelated questions with embedder \"e5-small\" "
                                 "(about 0.80); 0.86 keeps 99% of rewordings (docs/performance/cache.md)")
    if cache.enabled and cache.judge_model is not None:
        target = settings.model(cache.judge_model)
        if target is None or target.kind != "chat":
            raise where.fail("cache.judge_model", f"{cache.judge_model!r} is not the alias of a chat model in this file")
        if isinstance(target, UpstreamModel):
            raise where.fail("cache.judge_model", f"{cache.judge_model!r} runs upstream; the judge answers through a grammar, so it must be a local model")
    return settings


def load_settings(path: Path) -> Settings:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), "(file)", f"cannot read: {exc.strerror}") from None
    return parse_settings(text, str(path), path.resolve().parent)


def config_to_serve(explicit: Path | None) -> Path:
    """find_config's, where `serve` starts: on a first start with no config anywhere (an install
    from the wheel, by pipx or uv), the bundled one is copied into the data directory to edit."""
    path = find_config(explicit)
    if explicit is None and not os.environ.get("APPLIANCE_CONFIG") and not path.exists():
        bundled = importlib.resources.files("appliance").joinpath("data/models.toml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bundled.read_text())
        log.info("no models.toml here or in %s: wrote the bundled one there (%s); edit it to add models", path.parent, path)
    return path


def find_config(explicit: Path | None) -> Path:
    """`--config`, else APPLIANCE_CONFIG, else ./models.toml, else the one in the data directory."""
    if explicit is not None:
        return explicit
    if os.environ.get("APPLIANCE_CONFIG"):
        return Path(os.environ["APPLIANCE_CONFIG"])
    local = Path("models.toml")
    if local.is_file():
        return local
    return default_data_dir() / "models.toml"
