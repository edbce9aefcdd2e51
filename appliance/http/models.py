"""The admin API for loaded models: what each is doing, and its LoRA adapters, loaded and unloaded
at runtime without reloading the base model. Adapters loaded here last until a restart; declare
them in models.toml to keep them."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, delete, get, post, put

from appliance.config.settings import NAME, NAME_RULE
from appliance.fleet.admin import QUANT_TYPES, alias_for, estimated_size, file_type, quantize, quantized_name, register
from appliance.fleet.files import ModelFileError, download, hub_file_problem, resolve, sha256
from appliance.fleet.registry import LoadedModel
from appliance.http.admin import _admin, confined, server_path
from appliance.http.fleet import apply_from_thread
from appliance.pipeline.errors import APIError, invalid
from appliance.server.jobs import Job, JobBusy
from appliance.server.services import Services
from appliance.wire.decode import decode_body
from engines.interface import AdapterInUse, EngineError, UnknownAdapter


class QuantizeBody(msgspec.Struct, forbid_unknown_fields=True):
    source: str  # a configured alias or a path on the server
    type: str
    alias: str | None = None
    allow_requantize: bool = False


class PullBody(msgspec.Struct, forbid_unknown_fields=True):
    repo: str
    file: str
    alias: str | None = None


class AdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    scale: float = 1.0


def _loaded(services: Services, alias: str) -> LoadedModel:
    model = services.registry.get(alias)
    if model is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    if not model.engine.supports_adapters:
        raise invalid(f"The model '{alias}' runs on an engine without adapters.", "model")
    return model


def _model_view(model: LoadedModel) -> dict[str, Any]:
    s = model.settings
    stats = model.engine.stats()
    return {
        "alias": s.alias, "engine": model.engine.name, "kind": s.kind, "tier": s.tier, "context_length": model.engine.context_length,
        "slots_total": stats.slots_total, "slots_busy": stats.slots_busy, "queue_depth": stats.queue_depth,
        "slots": [{"slot": i, "state": state, "tokens": tokens} for i, (state, tokens) in enumerate(stats.slot_states)],
        "kv_used_tokens": sum(tokens for _, tokens in stats.slot_states), "kv_capacity_tokens": stats.kv_capacity_tokens,
        "speculation": s.speculation_mode, "draft_model": s.draft_model, "prefix_cache": s.prefix_cache,
        "prefix": dataclasses.asdict(stats.prefix) if stats.prefix else None,
        "speculation_stats": dataclasses.asdict(stats.speculation) if stats.speculation else None,
        "adapters": [dataclasses.asdict(a) for a in model.engine.adapters()],
        "upstreams": [{**dataclasses.asdict(u), "failures": dict(u.failures)} for u in stats.upstreams],
    }


@get("/admin/models")
async def list_loaded_models(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    return {"models": [_model_view(m) for m in services.registry.all()]}


@get("/admin/models/loaded")
async def models_in_memory(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Every model, loaded or not: its memory estimate, slots in use, idle time, time to unload
    (what `appliance ps` prints)."""
    await _admin(request, services)
    manager = services.registry.manager
    return {"memory_budget_bytes": manager.budget, "loaded_bytes": manager.loaded_bytes(), "models": manager.view()}


@get("/admin/models/{alias:str}/adapters")
async def list_adapters(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    await _admin(request, services)
    return {"adapters": [dataclasses.asdict(a) for a in _loaded(services, alias).engine.adapters()]}


@put("/admin/models/{alias:str}/adapters/{name:str}", status_code=200)
async def load_adapter(request: Request[Any, Any, Any], services: Services, alias: str, name: str) -> dict[str, Any]:
    await _admin(request, services)
    model = _loaded(services, alias)
    body: AdapterBody = decode_body(await request.body(), AdapterBody)
    if not NAME.match(name):
        raise invalid(f"An adapter's name takes {NAME_RULE}.", "name")
    if not -10.0 <= body.scale <= 10.0:
        raise invalid("scale must be between -10 and 10.", "scale")
    path = server_path(services, body.path, "path")
    if not path.exists():  # a GGUF file for llama.cpp, an mlx-lm adapter folder for MLX
        raise invalid(f"There is no file or folder {path} on the server.", "path")
    try:
        info = await model.engine.load_adapter(name, path, body.scale)
    except EngineError as exc:
        raise APIError(409 if isinstance(exc, AdapterInUse) else 400, str(exc), param="path", code="adapter_not_loaded") from None
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


def _config_file(services: Services) -> Path:
    config = Path(services.settings.file)
    if not config.is_file():
        raise invalid("This server was not started from a config file it can register models in.")
    return config


def _start_job(services: Services, kind: str, description: str, work: Any) -> Job:
    try:
        return services.jobs.start(kind, description, work)
    except JobBusy as exc:
        raise APIError(409, str(exc), code="job_running") from None


@post("/admin/models/quantize", status_code=202)
async def quantize_model(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Quantizes a model file on a server thread, registers the result in models.toml and serves
    it without a restart. Poll GET /admin/jobs for progress."""
    await _admin(request, services)
    body: QuantizeBody = decode_body(await request.body(), QuantizeBody)
    config = _config_file(services)
    if body.type not in QUANT_TYPES:
        raise invalid(f"type must be one of {', '.join(QUANT_TYPES)}.", "type")
    configured = services.settings.model(body.source)
    if configured is not None and configured.engine == "openai":
        raise invalid(f"The model '{configured.alias}' runs upstream; there is no file here to quantize.", "source")
    server = services.settings.server
    try:  # a configured model's file is the config's to name; any other path is confined
        src = resolve(configured, server.data_dir) if configured else server_path(services, body.source, "source")
    except ModelFileError as exc:
        raise invalid(str(exc), "source") from None
    if not src.is_file():
        raise invalid(f"There is no file {src} on the server.", "source")
    dst = quantized_name(src, body.type)
    if confined(str(dst), server.api_path_roots) is None:  # a configured file in a package or elsewhere
        dst = server.data_dir / dst.name
    derived = f"{configured.alias}-{body.type.lower()}" if configured else alias_for(dst)
    alias = _new_alias(services, derived if body.alias is None else body.alias)  # an empty alias is refused, not replaced
    threads = configured.threads if configured else 2
    loop = asyncio.get_running_loop()

    def work(job: Job) -> str:
        job.total = estimated_size(src, file_type(src), body.type)
        quantize(src, dst, body.type, threads=threads, allow_requantize=body.allow_requantize,
                 progress=lambda size: setattr(job, "done", size))
        job.done = dst.stat().st_size
        register(config, alias, dst, sha256(dst), like=configured.alias if configured else None)
        return f"wrote {dst} and registered it as {alias!r} in {config}" + apply_from_thread(services, loop)

    return {"job": _start_job(services, "quantize", f"{src.name} to {body.type}", work).view()}


@post("/admin/models/pull", status_code=202)
async def pull_model(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Downloads one GGUF from a hub (huggingface-hub: HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE) on a
    server thread, registers it in models.toml and serves it without a restart. Poll GET
    /admin/jobs for progress."""
    await _admin(request, services)
    body: PullBody = decode_body(await request.body(), PullBody)
    return {"job": start_pull(services, body.repo, body.file, body.alias).view()}


def start_pull(services: Services, repo: str, file: str, alias: str | None) -> Job:
    """The pull job: one GGUF downloaded from the hub, registered and served (the admin API's and
    Ollama's /api/pull). Refusals name `repo`, `file` or `alias`."""
    config = _config_file(services)
    if "/" not in repo or not file.endswith(".gguf"):
        raise invalid("Give a hub repo as owner/name and a .gguf file in it.", "repo" if "/" not in repo else "file")
    if (problem := hub_file_problem(file)) is not None:
        raise invalid(f"file names {problem}.", "file")
    alias = _new_alias(services, alias_for(Path(file)) if alias is None else alias)
    data_dir = services.settings.server.data_dir
    loop = asyncio.get_running_loop()

    def work(job: Job) -> str:
        path, digest = download(repo, file, data_dir, tqdm_class=_progress_into(job))
        job.done = job.total = path.stat().st_size
        register(config, alias, path, digest)
        return f"downloaded {path} and registered it as {alias!r} in {config}" + apply_from_thread(services, loop)

    return _start_job(services, "pull", f"{repo}/{file}", work)


def _new_alias(services: Services, alias: str) -> str:
    """Checked before a job starts; the job's write into models.toml checks it again."""
    if not NAME.match(alias):
        raise invalid(f"alias takes {NAME_RULE}.", "alias")
    if services.settings.model(alias) is not None or services.settings.route(alias) is not None:
        raise invalid(f"There is already a model with alias {alias!r}.", "alias")
    return alias


def _progress_into(job: Job) -> Any:
    """A tqdm class that writes huggingface-hub's download progress into the job, and nothing
    to the server's terminal."""
    import io

    from tqdm.auto import tqdm

    class JobProgress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = io.StringIO()
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            job.done, job.total = int(self.n), int(self.total) if self.total else None
            return shown

    return JobProgress


@get("/admin/jobs")
async def list_jobs(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await _admin(request, services)
    return {"jobs": services.jobs.list()}


@delete("/admin/jobs/{job_id:str}", status_code=200)
async def cancel_job(request: Request[Any, Any, Any], services: Services, job_id: str) -> dict[str, Any]:
    """Asks a running job to stop; it ends as "cancelled" (a training job at the end of its step,
    keeping a checkpoint). Quantize and pull jobs cannot be stopped: 409."""
    await _admin(request, services)
    job = services.jobs.get(job_id)
    if job is None:
        raise APIError(404, f"There is no job {job_id}.", type="not_found_error", param="job_id", code="job_not_found")
    if job.state != "running":
        raise APIError(409, f"The job {job_id} has already ended ({job.state}).", param="job_id", code="job_not_running")
    if not services.jobs.cancel(job_id):
        raise APIError(409, f"A {job.kind} job cannot be stopped once started.", param="job_id", code="job_not_cancellable")
    return {"job": job.view()}


ROUTES = [list_loaded_models, models_in_memory, list_adapters, load_adapter, unload_adapter, quantize_model, pull_model, list_jobs,
          cancel_job]
