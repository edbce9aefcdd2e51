"""The loaded fleet: each alias with its settings, engine and chat template."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from appliance.chat_template import CHATML, ChatTemplate
from appliance.model_files import resolve
from appliance.settings import ModelSettings, Settings
from engines.base import Engine

log = logging.getLogger("appliance.registry")


@dataclass(frozen=True)
class LoadedModel:
    settings: ModelSettings
    engine: Engine
    template: ChatTemplate | None


def build_engine(model: ModelSettings, settings: Settings) -> Engine:
    path = resolve(model, settings.server.data_dir, allow_download=True)
    engine_kind = "llamacpp" if model.engine == "auto" else model.engine
    if engine_kind != "llamacpp":
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: engine {model.engine!r} is not available in this build")
    from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine

    draft_path = None
    if model.speculation_mode == "draft":
        draft = settings.model(model.draft_model or "")
        assert draft is not None  # checked when the config was parsed
        draft_path = resolve(draft, settings.server.data_dir, allow_download=True)

    return LlamaCppEngine(
        LlamaCppConfig(
            path=path,
            slots=model.slots,
            context_length=model.context_length,
            batch_tokens=model.batch_tokens,
            threads=model.threads,
            max_queue=settings.server.max_queue,
            batch_invariant=model.batch_invariant,
            kv_type=model.kv_cache_type,
            kv_type_v=model.kv_cache_type_v,
            embeddings=model.kind == "embedding",
            prefix_cache=model.prefix_cache,
            prefix_host_bytes=model.prefix_cache_host_mb << 20,
            speculation=model.speculation_mode,
            draft_path=draft_path,
            speculation_max_tokens=model.speculation_max_tokens,
            speculation_fixed_tokens=model.speculation_fixed_tokens,
            adapters=tuple((a.name, a.path, a.scale) for a in model.adapters),
        )
    )


def load_model(model: ModelSettings, settings: Settings) -> LoadedModel:
    engine = build_engine(model, settings)
    template = None
    if model.kind == "chat":
        source = model.chat_template or engine.chat_template() or CHATML
        template = ChatTemplate(source, engine.special_tokens())
    log.info("loaded %s (%s, %d slots x %d tokens)", model.alias, model.engine, model.slots, engine.context_length)
    return LoadedModel(model, engine, template)


class Registry:
    def __init__(self, models: dict[str, LoadedModel]) -> None:
        self._models = models

    @classmethod
    def load(cls, settings: Settings) -> Registry:
        loaded: dict[str, LoadedModel] = {}
        try:
            for model in settings.models:
                if model.kind != "draft":
                    loaded[model.alias] = load_model(model, settings)
        except BaseException:
            for done in loaded.values():
                done.engine.close()
            raise
        return cls(loaded)

    def get(self, alias: str) -> LoadedModel | None:
        return self._models.get(alias)

    def aliases(self) -> frozenset[str]:
        return frozenset(self._models)

    def all(self) -> list[LoadedModel]:
        return list(self._models.values())

    def close(self) -> None:
        for model in self._models.values():
            model.engine.close()
