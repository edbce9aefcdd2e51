"""The loaded fleet: each alias with its settings, engine and chat template."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from appliance.config.settings import LocalModel, ModelSettings, Settings
from appliance.fleet.change import FleetChange, adapter_swap
from appliance.fleet.files import package_file, resolve, sha256
from appliance.fleet.manager import ModelManager, total_ram
from appliance.prompt.chat import render_prompt, vocabulary_prompt, vocabulary_tokens
from appliance.prompt.template import ChatTemplate, TemplateError, close_render_threads, render_threads, template_of
from engines.interface import AdapterInUse, Capabilities, Engine, EngineError
from engines.vocabulary import Vocabulary

log = logging.getLogger("appliance.fleet.registry")


@dataclass(frozen=True)
class LoadedModel:
    settings: ModelSettings
    engine: Engine
    template: ChatTemplate | None

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, tuple[int, ...]]:
        """The prompt text and tokens for these messages; callers' text never becomes a control
        token (appliance/prompt/chat.py). Raises TemplateError."""
        if self.template is None:
            raise TemplateError(f"the model '{self.settings.alias}' has no chat template")
        text, tokens = vocabulary_prompt(self.template, self.engine, messages, tools)
        return text, tuple(tokens)

    async def chat_prompt_async(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                                effort: str | None = None) -> tuple[str, tuple[int, ...]]:
        """chat_prompt with the template rendered off the event loop (its bound is seconds). The
        tokens are read on the loop, where a replaced model's engine cannot be closed under them.
        `effort`: the request's reasoning effort ("none" renders with the template's reasoning switch off,
        TemplateError if it has none; see ChatTemplate.with_effort)."""
        if self.template is None:
            raise TemplateError(f"the model '{self.settings.alias}' has no chat template")
        template = self.template.with_effort(effort)
        text, spans = await asyncio.get_running_loop().run_in_executor(
            render_threads(), functools.partial(render_prompt, template, messages, self.engine.control_tokens(), tools))
        return text, tuple(vocabulary_tokens(self.engine, text, spans))

    def prefix_scope(self, tenant: str | None) -> str:
        """The engine's prefix scope for a request on `tenant`'s behalf: a tenant reuses only its
        own prefixes, unless the model's prefix_sharing is "all". The server's own requests (None:
        cache sweeps) take "", the scope no tenant's request has under "tenant"."""
        if tenant is None or self.settings.prefix_sharing == "all":
            return ""
        return f"tenant:{tenant}"


def engine_for(model: ModelSettings) -> str:
    """`auto` is MLX on Apple silicon (faster there) and llama.cpp everywhere else."""
    if model.engine != "auto":
        return model.engine
    return "mlx" if sys.platform == "darwin" and platform.machine() == "arm64" else "llamacpp"


def build_engine(model: ModelSettings, settings: Settings) -> Engine:
    if model.engine == "openai":
        return _build_upstream(model, settings)
    if engine_for(model) == "mlx":
        return _build_mlx(model, settings)
    path = resolve(model, settings.server.data_dir, allow_download=True)
    if model.engine == "onnx":
        return _build_onnx(model, settings, path)
    from appliance.fleet.memory import gpu_layers_for
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
            prefills_per_step=model.prefills_per_step,
            threads=model.threads,
            max_queue=settings.server.max_queue,
            batch_invariant=model.batch_invariant,
            kv_type=model.kv_cache_type,
            kv_type_v=model.kv_cache_type_v,
            kv_tokens=model.kv_tokens or 0,
            embeddings=model.kind == "embedding",
            pooling=model.pooling,
            prefix_cache=model.prefix_cache,
            prefix_host_bytes=model.prefix_cache_host_mb << 20,
            speculation=model.speculation_mode,
            draft_path=draft_path,
            speculation_max_tokens=model.speculation_max_tokens,
            speculation_fixed_tokens=model.speculation_fixed_tokens,
            adapters=tuple((a.name, a.path, a.scale) for a in model.adapters),
            gpu_layers=gpu_layers_for(model, path),
        )
    )


def _onnx_config(model: ModelSettings, settings: Settings, path: Path) -> Any:
    from engines.onnx.engine import OnnxConfig

    tokenizer = package_file(model.tokenizer_package_file) if model.tokenizer_package_file else model.tokenizer
    assert tokenizer is not None  # checked when the config was parsed
    if not tokenizer.is_file():
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: tokenizer: no file at {tokenizer}")
    return OnnxConfig(path, tokenizer, model.context_length, model.batch_tokens, model.threads, settings.server.max_queue, model.pooling)


def _build_onnx(model: ModelSettings, settings: Settings, path: Path) -> Engine:
    from engines.onnx.engine import OnnxEngine

    try:
        return OnnxEngine(_onnx_config(model, settings, path))
    except EngineError as exc:
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: {exc}") from None


def _digest(path: Path) -> str:
    """A file's sha256, hashed once while it is unchanged (a model loaded on demand asks at every load)."""
    stat = path.stat()
    return _digest_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest_of(path: str, size: int, mtime_ns: int) -> str:
    return sha256(Path(path))


def mlx_folder(model: ModelSettings, settings: Settings) -> tuple[Path, Path | None]:
    """An MLX folder as given, or a GGUF converted once into the data directory (no second
    download); and the GGUF whose vocabulary it shares, when known."""
    from engines.mlx.convert import ConversionError, gguf_to_mlx, source_of

    if model.path is not None and model.path.is_dir():
        return model.path, source_of(model.path)  # a folder the appliance converted or quantized names its GGUF
    source = resolve(model, settings.server.data_dir, allow_download=True)
    folder = settings.server.data_dir / "mlx" / f"{source.stem}-{_digest(source)[:12]}"
    if not (folder / "config.json").is_file():
        log.info("converting %s for MLX into %s", source.name, folder)
        try:
            gguf_to_mlx(source, folder)
        except ConversionError as exc:
            raise RuntimeError(f"{settings.file}: model {model.alias!r}: {exc}") from None
    return folder, source  # the same vocabulary token for token: grammars and seeds run llama.cpp's sampler on it


def _mlx_config(model: ModelSettings, settings: Settings) -> Any:
    """The engine's config; the folder converted from its GGUF when it must be."""
    try:
        from engines.mlx.engine import MlxConfig
    except ImportError as exc:
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: the MLX engine is not installed here ({exc.name})") from None
    if model.kind != "chat" or model.speculation_mode == "prompt_lookup":
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: the MLX engine serves chat models, and speculates with a draft model only")
    folder, vocabulary = mlx_folder(model, settings)
    draft = None
    if model.speculation_mode == "draft":
        draft_settings = settings.model(model.draft_model or "")
        assert draft_settings is not None  # checked when the config was parsed
        draft, _ = mlx_folder(draft_settings, settings)
    cache_bytes = model.prefix_cache_host_mb << 20 if model.prefix_cache else 0
    return MlxConfig(folder, model.slots, model.context_length, settings.server.max_queue, cache_bytes, vocabulary=vocabulary,
                     adapters=tuple((a.name, a.path, a.scale) for a in model.adapters), draft=draft,
                     draft_max_tokens=model.speculation_max_tokens, draft_fixed_tokens=model.speculation_fixed_tokens)


def _build_mlx(model: ModelSettings, settings: Settings) -> Engine:
    config = _mlx_config(model, settings)
    from engines.mlx.engine import MlxEngine

    try:
        return MlxEngine(config)
    except EngineError as exc:  # an adapter that does not fit the model, a draft with another vocabulary
        raise RuntimeError(f"{settings.file}: model {model.alias!r}: {exc}") from None


def _build_upstream(model: ModelSettings, settings: Settings) -> Engine:
    from engines.upstream.engine import Upstream, UpstreamConfig, UpstreamEngine
    from engines.upstream.policy import BreakerPolicy, RetryPolicy

    upstreams = []
    for u in model.upstreams:
        key = None
        if u.api_key_env is not None:
            key = os.environ.get(u.api_key_env)
            if not key:
                raise RuntimeError(f"{settings.file}: model {model.alias!r}: api_key_env: the environment variable {u.api_key_env} is not set")
        upstreams.append(Upstream(u.name, u.base_url, u.model, key))
    t = model.upstream
    return UpstreamEngine(UpstreamConfig(
        alias=model.alias, upstreams=tuple(upstreams), context_length=model.context_length,
        connect_timeout_s=t.connect_timeout_s, read_timeout_s=t.read_timeout_s,
        retry=RetryPolicy(t.max_retries, t.retry_backoff_s), breaker=BreakerPolicy(t.breaker_failures, t.breaker_cooldown_s),
        health_interval_s=t.health_interval_s,
    ))


def template_for(model: ModelSettings, vocabulary: Vocabulary) -> ChatTemplate | None:
    """A local chat model's template, compiled and tried within its bounds (else TemplateError)."""
    if model.kind != "chat" or getattr(vocabulary, "takes_messages", False):
        return None
    return template_of(model.chat_template, vocabulary)


def load_model(model: ModelSettings, settings: Settings, engine: Engine | None = None, template: ChatTemplate | None = None) -> LoadedModel:
    """The model with its template; `engine`: one made already (a model loaded on demand), and
    `template`: its template, compiled already."""
    engine = engine or build_engine(model, settings)
    template = template or template_for(model, engine)
    if engine.takes_messages:
        log.info("loaded %s (upstream: %s)", model.alias, ", ".join(u.base_url for u in model.upstreams))
    else:
        log.info("loaded %s (%s, %d slots x %d tokens)", model.alias, model.engine, model.slots, engine.context_length)
    return LoadedModel(model, engine, template)


def loads_on_demand(model: ModelSettings, settings: Settings) -> bool:
    """A local model may load on demand (its vocabulary loads alone); an upstream holds nothing here."""
    return isinstance(model, LocalModel) and model.kind != "draft" and not model.loads_at_start(settings.server)


def standby(model: LocalModel, settings: Settings) -> tuple[Vocabulary, Capabilities]:
    """Blocking: what a model loaded on demand keeps while it is not loaded: its vocabulary (its
    files downloaded or converted now, not on a first request) and what its engine will serve."""
    if engine_for(model) == "mlx":
        config = _mlx_config(model, settings)
        from engines.mlx.engine import MlxEngine
        from engines.mlx.vocabulary import MlxVocabulary

        return MlxVocabulary(config.path), MlxEngine.capabilities(grammar_vocabulary=config.vocabulary is not None)
    path = resolve(model, settings.server.data_dir, allow_download=True)
    if model.engine == "onnx":
        from engines.onnx.engine import OnnxEngine
        from engines.onnx.vocabulary import OnnxVocabulary

        return OnnxVocabulary(_onnx_config(model, settings, path).tokenizer), OnnxEngine.capabilities()
    from engines.llamacpp.engine import LlamaCppEngine
    from engines.llamacpp.vocabulary import LlamaVocabulary

    return LlamaVocabulary.of_file(path), LlamaCppEngine.capabilities(embeddings=model.kind == "embedding")


def _need_or_zero(model: ModelSettings, settings: Settings, budget: int | None) -> int:
    try:
        return memory_need(model, settings)
    except Exception:
        if budget is not None:
            raise
        return 0


def _check_pinned_fit(settings: Settings, model: ModelSettings, need: int, held: int, budget: int | None) -> None:
    """A model that is never unloaded must fit beside the others that never are."""
    if budget is not None and held + need > budget:
        raise EngineError(f"{settings.file}: model {model.alias!r} is loaded at start (preload) and needs about "
                          f"{need / 2**30:.2f} GiB; with the models loaded before it that is more than [server] "
                          f"memory_budget ({budget / 2**30:.2f} GiB)")


def memory_need(model: ModelSettings, settings: Settings) -> int:
    """Estimated bytes of a local model loaded (with its draft); a file's size when it cannot be estimated; 0 upstream."""
    if not isinstance(model, LocalModel):
        return 0  # an upstream holds nothing here
    from appliance.fleet.memory import ModelShapeError, estimate, mlx_estimate, model_estimate, onnx_memory

    if engine_for(model) == "mlx":
        folder, _ = mlx_folder(model, settings)
        need = mlx_estimate(folder, model.slots, model.context_length).total
        if model.speculation_mode == "draft":
            draft = settings.model(model.draft_model or "")
            assert draft is not None  # checked when the config was parsed
            need += mlx_estimate(mlx_folder(draft, settings)[0], 1, model.context_length).total  # it drafts for one request at a time
        return need
    path = resolve(model, settings.server.data_dir, allow_download=True)
    if model.engine == "onnx":
        return onnx_memory(path.stat().st_size, model.batch_tokens, model.context_length).total
    try:
        need = model_estimate(model, path).total
        if model.speculation_mode == "draft":
            draft = settings.model(model.draft_model or "")
            assert draft is not None  # checked when the config was parsed
            need += estimate(resolve(draft, settings.server.data_dir, allow_download=True), model.slots, model.context_length,
                             model.kv_cache_type).total
        return need
    except ModelShapeError as exc:
        log.warning("%s: its memory cannot be estimated (%s); counting its file's size", model.alias, exc)
        return path.stat().st_size


@dataclass
class _Made:
    """A model made ready off the event loop, put into service by `serve` (on the loop)."""

    settings: ModelSettings
    need: int
    engine: Engine | None = None  # loaded in full
    standby: tuple[Vocabulary, Capabilities] | None = None  # or only its vocabulary, for a model loaded on demand
    template: ChatTemplate | None = None

    def serve(self, settings: Settings, manager: ModelManager, *, pinned: bool) -> LoadedModel:
        if self.engine is not None:
            manager.add(self.settings, self.need, self.engine)
            return load_model(self.settings, settings, self.engine, self.template)
        from appliance.fleet.on_demand import OnDemandEngine

        assert isinstance(self.settings, LocalModel) and self.standby is not None
        return load_model(self.settings, settings, OnDemandEngine(self.settings, *self.standby, manager, self.need, pinned=pinned),
                          self.template)

    def discard(self) -> None:
        if self.engine is not None:
            self.engine.close()
        elif self.standby is not None:
            self.standby[0].close()


def _make(model: ModelSettings, settings: Settings, need: int, *, on_demand: bool) -> _Made:
    """Blocking: the model's file resolved (downloaded when it must be) and its engine loaded, or,
    for one loaded on demand, only its vocabulary."""
    if on_demand:
        assert isinstance(model, LocalModel)
        made = _Made(model, need, standby=standby(model, settings))
    else:
        made = _Made(model, need, engine=build_engine(model, settings))
    # Its template too, before the fleet switches to it: a refused one leaves the fleet as it was.
    try:
        made.template = template_for(model, made.engine or made.standby[0])  # type: ignore[index]
    except BaseException as exc:
        made.discard()
        if isinstance(exc, TemplateError):
            raise type(exc)(f"{settings.file}: model {model.alias!r}: chat_template: {exc}") from None
        raise
    return made


class Registry:
    def __init__(self, models: dict[str, LoadedModel], manager: ModelManager, settings: Settings) -> None:
        self._models = models
        self.manager = manager  # which models are in memory
        self.settings = settings  # the fleet it serves
        manager.build = lambda model: build_engine(model, self.settings)  # a draft model as the running config names it
        self._preloads: set[Any] = set()  # tasks loading pinned models added while running

    @classmethod
    def load(cls, settings: Settings) -> Registry:
        loaded: dict[str, LoadedModel] = {}
        if any(m.engine == "llamacpp" and m.batch_invariant for m in settings.models):
            from engines.llamacpp.kernels import choose_matmul_kernels

            choose_matmul_kernels(invariant=True)  # for the whole process, before any model computes
        server = settings.server
        budget = server.memory_budget.bytes_of(total_ram()) if server.memory_budget is not None else None
        manager = ModelManager(budget, server.load_timeout_s, lambda m: build_engine(m, settings))
        try:
            for model in settings.models:
                if model.kind == "draft":
                    continue
                on_demand = loads_on_demand(model, settings)
                need = _need_or_zero(model, settings, budget)
                if not on_demand:  # checked before loading it
                    _check_pinned_fit(settings, model, need, sum(e.need for e in manager.entries() if e.pinned), budget)
                made = _make(model, settings, need, on_demand=on_demand)
                loaded[model.alias] = made.serve(settings, manager, pinned=False)
                if on_demand:
                    log.info("%s loads on its first request (about %.0f MiB)", model.alias, made.need / 2**20)
        except BaseException:
            for done in loaded.values():
                done.engine.close()
            manager.close()
            raise
        return cls(loaded, manager, settings)

    async def apply(self, settings: Settings, change: FleetChange) -> None:
        """Serves `settings`: added and changed models are made first, off the loop (files resolved,
        engines or vocabularies loaded), then the fleet switches at once; the replaced and removed
        models finish their requests and unload. When a model cannot be made, raises and leaves the
        fleet as it was."""
        import asyncio

        budget = self.manager.budget
        going = set(change.removed) | set(change.changed)
        pinned_held = sum(e.need for e in self.manager.entries() if e.pinned and e.retired is None and e.settings.alias not in going)
        made: dict[str, tuple[_Made, bool]] = {}
        try:
            for alias in (*change.added, *change.changed):
                model = settings.model(alias)
                assert model is not None
                # A local model, preloaded or not, goes through the manager: a preloaded one loads once
                # the model it replaces has finished its requests, when the budget needs its room.
                on_demand = isinstance(model, LocalModel)
                pinned = not on_demand or model.loads_at_start(settings.server)
                need = await asyncio.to_thread(_need_or_zero, model, settings, budget)
                if pinned:
                    _check_pinned_fit(settings, model, need, pinned_held, budget)
                    pinned_held += need
                item = await asyncio.to_thread(_make, model, settings, need, on_demand=on_demand)
                made[alias] = (item, on_demand and pinned)
                if item.engine is not None:
                    await item.engine.start()
        except BaseException:
            for item, _ in made.values():
                await asyncio.to_thread(item.discard)
            raise
        from appliance.fleet.on_demand import OnDemandEngine, apply_swap

        async def swap_to(loaded: LoadedModel, old: LocalModel, new: LocalModel) -> None:
            swap = adapter_swap(old, new)
            assert swap is not None  # fleet_change's decision
            if isinstance(loaded.engine, OnDemandEngine):
                await loaded.engine.swap_adapters(swap, new.adapters)
            else:  # loaded at start for good
                await apply_swap(loaded.engine, swap, old.adapters)
                entry = self.manager.entry(new.alias)
                if entry is not None:
                    entry.settings = new

        # Models whose adapters alone changed keep their base loaded and swap the adapters; one whose
        # engine refuses (an adapter to replace is serving requests) is served again instead.
        swapped: dict[str, tuple[LoadedModel, LocalModel]] = {}
        try:
            for alias in change.adapters:
                loaded, old, model = self._models[alias], self.settings.model(alias), settings.model(alias)
                assert isinstance(old, LocalModel) and isinstance(model, LocalModel)
                try:
                    await swap_to(loaded, old, model)
                    swapped[alias] = (replace(loaded, settings=model), old)
                except AdapterInUse as exc:
                    log.info("%s: serving it again for its new adapters: %s", alias, exc)
                    need = await asyncio.to_thread(_need_or_zero, model, settings, budget)
                    made[alias] = (await asyncio.to_thread(_make, model, settings, need, on_demand=True),
                                   model.loads_at_start(settings.server))
                    going.add(alias)
        except BaseException:
            for alias, (loaded, old) in swapped.items():  # back to the adapters the file had
                try:
                    await swap_to(loaded, loaded.settings, old)  # type: ignore[arg-type]
                except EngineError as exc:  # the error being raised is the one the caller needs
                    log.error("%s: its earlier adapters could not be put back: %s", alias, exc)
            for item, _ in made.values():
                await asyncio.to_thread(item.discard)
            raise
        # From here on nothing awaits: no request sees half of a fleet.
        self._models.update({alias: loaded for alias, (loaded, _) in swapped.items()})
        for alias in going:
            old = self._models.pop(alias)  # its vocabulary closes with it; a full engine, when the manager unloads it
            self.manager.retire(alias, old.engine.close if isinstance(old.engine, OnDemandEngine) else lambda: None)
        for alias, (item, pinned) in made.items():
            self._models[alias] = item.serve(settings, self.manager, pinned=pinned)
            if pinned:
                task = asyncio.create_task(self._preload(alias))
                self._preloads.add(task)
                task.add_done_callback(self._preloads.discard)
        self.settings = settings

    async def _preload(self, alias: str) -> None:
        entry = self.manager.entry(alias)
        if entry is None:
            return
        try:
            await self.manager.preload(entry)
        except Exception as exc:  # shown in ps and /admin/models/loaded as the entry's error
            log.error("%s: preloading failed: %s", alias, exc)

    def get(self, alias: str) -> LoadedModel | None:
        return self._models.get(alias)

    def aliases(self) -> frozenset[str]:
        return frozenset(self._models)

    def all(self) -> list[LoadedModel]:
        return list(self._models.values())

    async def start(self) -> None:
        for model in self._models.values():
            await model.engine.start()
        await self.manager.start()

    def close(self) -> None:
        for task in list(self._preloads):
            task.cancel()
        self.manager.close()  # the engines loaded on demand, and those retired
        close_render_threads()  # no request renders a prompt any more
        for model in self._models.values():
            model.engine.close()  # those loaded at start; an on-demand model's vocabulary
