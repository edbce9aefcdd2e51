"""The admin API that changes the fleet while the server runs: add, edit and remove models in
models.toml (through appliance.config.writer, which keeps the operator's comments), apply a file
edited by hand, and load or unload a model now. Each change is applied by appliance/fleet/reconfigure.py;
one the fleet cannot take leaves the file and the fleet as they were and answers 400."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, get_args, get_origin

import msgspec
from litestar import Request, delete, patch, post

from appliance.config.schema import keys_of, strip
from appliance.config.settings import ConfigError, LocalModel, names_template_file
from appliance.config.writer import remove_table, update_table
from appliance.fleet.admin import ModelAdminError, alias_for, check_alias, register
from appliance.fleet.change import FleetChange
from appliance.fleet.files import ModelFileError, hub_file_problem, package_file_unimported, resolve, sha256
from appliance.fleet.manager import ModelUnavailable
from appliance.fleet.reconfigure import apply_config
from appliance.http.admin import _admin, confined, path_not_allowed, server_path
from appliance.pipeline.errors import APIError, invalid
from appliance.prompt.template import TemplateError
from appliance.server.services import Services
from appliance.wire.decode import decode_body

log = logging.getLogger("appliance.api")


class AddBody(msgspec.Struct, forbid_unknown_fields=True):
    path: str  # a GGUF file on the server, inside the data directory or [server] model_dirs
    alias: str | None = None
    like: str | None = None  # a configured model whose keys it takes (all but its file and adapters)
    sha256: str | None = None  # checked when given; computed otherwise


def config_file(services: Services) -> Path:
    config = Path(services.settings.file)
    if not config.is_file():
        raise invalid("This server was not started from a config file it can change.")
    return config


async def change_fleet(services: Services, edit: Any = None) -> FleetChange:
    """Applies `edit` (a blocking config_writer change) and the file to the running fleet; the
    refusals become 400s naming what was wrong."""
    try:
        return await apply_config(services, edit)
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.key, code="invalid_config") from None
    except TemplateError as exc:  # compiled, and tried within its bounds, before the fleet switched
        raise APIError(400, f"The change was not applied (the file and the running models are as they were): {exc}",
                       param="chat_template", code="invalid_chat_template") from None
    except ModelAdminError as exc:
        raise invalid(str(exc), code="invalid_config") from None
    except Exception as exc:  # a file llama.cpp cannot read, a missing tokenizer, an upstream key not set
        log.warning("the config could not be applied: %s", exc)
        raise APIError(400, f"The change was not applied (the file and the running models are as they were): {exc}",
                       code="model_not_loadable") from None


def _change_view(change: FleetChange, services: Services) -> dict[str, Any]:
    return {"change": change.view(), "models": sorted(m.settings.alias for m in services.registry.all())}


@post("/admin/config/reload", status_code=200)
async def reload_config(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Applies models.toml as it is now (after an edit by hand or by the CLI): added models are
    served, removed ones finish their requests and go, changed ones are served again."""
    await _admin(request, services)
    config_file(services)
    return _change_view(await change_fleet(services), services)


@post("/admin/models", status_code=201)
async def add_model(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    """Registers a model file on the server in models.toml and serves it without a restart."""
    await _admin(request, services)
    body: AddBody = decode_body(await request.body(), AddBody)
    config_file(services)
    path = server_path(services, body.path, "path")
    if not path.is_file():
        raise invalid(f"There is no file {path} on the server.", "path")
    try:
        alias = check_alias(body.alias if body.alias is not None else alias_for(path))
    except ModelAdminError as exc:
        raise invalid(str(exc), "alias") from None
    if services.settings.model(alias) is not None or services.settings.route(alias) is not None:
        raise APIError(409, f"There is already a model or route with alias {alias!r}.", param="alias", code="alias_taken")
    if body.like is not None and services.settings.model(body.like) is None:
        raise invalid(f"There is no model with alias {body.like!r} to copy settings from.", "like")

    def edit(config: Path) -> None:
        digest = sha256(path)
        if body.sha256 is not None and body.sha256.lower() != digest:
            raise ModelAdminError(f"sha256: {path} has sha256 {digest}, not {body.sha256}")
        register(config, alias, path, digest, like=body.like)

    change = await change_fleet(services, edit)
    return {"alias": alias, **_change_view(change, services)}


@patch("/admin/models/{alias:str}", status_code=200)
async def edit_model(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    """Sets keys of a model's table (`{"slots": 4, "keep_alive": "10m"}`; null removes a key) and
    serves the model again with them, once its running requests have finished."""
    await _admin(request, services)
    values = decode_body(await request.body(), dict[str, Any])
    config_file(services)
    if services.settings.model(alias) is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    if not values:
        raise invalid("Give at least one key of the model's table to set.")
    values = confined_values(services, LocalModel, values)
    change = await change_fleet(services, lambda config: update_table(config, "models", alias, values))
    return _change_view(change, services)


@delete("/admin/models/{alias:str}", status_code=200)
async def remove_model(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    """Removes a model from models.toml; it finishes its running requests, then unloads. Its file
    stays on disk. Refused while a route, the cache or a guardrail still names it."""
    await _admin(request, services)
    return _change_view(await remove(services, alias), services)


async def remove(services: Services, alias: str) -> FleetChange:
    """The admin API's DELETE and Ollama's /api/delete."""
    config_file(services)
    if services.settings.model(alias) is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    return await change_fleet(services, lambda config: remove_table(config, "models", alias))


async def copy(services: Services, source: str, destination: str) -> FleetChange:
    """Ollama's /api/copy: the source's file registered again under another alias, with the
    source's settings (`like`)."""
    config_file(services)
    configured = services.settings.model(source)
    if configured is None:
        raise APIError(404, f"The model '{source}' does not exist.", param="source", code="model_not_found")
    try:
        alias = check_alias(destination)
        path = resolve(configured, services.settings.server.data_dir)
    except ModelAdminError as exc:
        raise invalid(str(exc), "destination") from None
    except ModelFileError as exc:  # an upstream model, or a file not downloaded
        raise invalid(f"The model '{source}' has no file here to copy: {exc}", "source") from None
    if services.settings.model(alias) is not None or services.settings.route(alias) is not None:
        raise APIError(409, f"There is already a model or route with alias {alias!r}.", param="destination", code="alias_taken")
    return await change_fleet(services, lambda config: register(config, alias, path, sha256(path), like=source))


def confined_values(services: Services, table: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`values` for a table of `table` with every value that names a file confined as POST's
    `path` is (inside the data directory or a [server] model_dirs folder, symlinks resolved, one
    answer whether or not a file outside exists) and written as the absolute path it resolved to. A
    value of another form is left for the writer to refuse, naming its key."""
    out = dict(values)
    for key in keys_of(table):
        value, param, declared = values.get(key.name), f"{prefix}{key.name}", strip(key.type)
        if get_origin(declared) is tuple and isinstance(item := strip(get_args(declared)[0]), type) and issubclass(item, msgspec.Struct):
            if isinstance(value, list):  # an array of tables: the adapters
                out[key.name] = [confined_values(services, item, v, f"{param}[{i}].") if isinstance(v, dict) else v
                                 for i, v in enumerate(value)]
            continue
        kind = "path" if declared is Path else key.extra.get("file")
        if not isinstance(value, str) or kind is None:
            continue
        if kind == "hub":
            if (problem := hub_file_problem(value)) is not None:
                raise invalid(f"{param} names {problem}.", param)
        elif kind == "package":  # found without importing it; where it lies is confined like any path
            where = package_file_unimported(value)
            if where is None or confined(str(where), services.settings.server.api_path_roots) is None:
                raise path_not_allowed(param)
            _existing(where, param)
        elif kind == "path" or (kind == "template" and names_template_file(value)):  # a template's text stays as it is
            out[key.name] = str(_existing(server_path(services, value, param), param, folder=kind == "path"))
    return out


def _existing(path: Path, param: str, *, folder: bool = True) -> Path:
    """Said only of a path inside the allowed folders. `folder`: an MLX model or adapter may be one."""
    if not (path.exists() if folder else path.is_file()):
        raise invalid(f"There is no file{' or folder' if folder else ''} {path} on the server.", param)
    return path


def _entry(services: Services, alias: str) -> Any:
    entry = services.registry.manager.entry(alias)
    if entry is None:
        raise APIError(404, f"The model '{alias}' does not exist.", param="model", code="model_not_found")
    return entry


def unavailable(exc: ModelUnavailable) -> APIError:
    return APIError(exc.status, str(exc), code=exc.code, retry_after_s=exc.retry_after_s)


@post("/admin/models/{alias:str}/load", status_code=200)
async def load_model_now(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    """Loads a model now (as its first request would), unloading idle ones to make room under the budget."""
    await _admin(request, services)
    entry = _entry(services, alias)
    try:
        await services.registry.manager.load(entry)
    except ModelUnavailable as exc:
        raise unavailable(exc) from None
    return {"alias": alias, "loaded": True}


@post("/admin/models/{alias:str}/unload", status_code=200)
async def unload_model_now(request: Request[Any, Any, Any], services: Services, alias: str) -> dict[str, Any]:
    """Unloads a model now when idle, else as soon as its running requests finish (`"unloaded":
    false` says it is waiting for them). A preloaded model stays: 409."""
    await _admin(request, services)
    entry = _entry(services, alias)
    try:
        done = await services.registry.manager.unload(entry)
    except ModelUnavailable as exc:
        raise unavailable(exc) from None
    return {"alias": alias, "unloaded": done, "when_idle": not done}


def apply_from_thread(services: Services, loop: asyncio.AbstractEventLoop) -> str:
    """For a job thread that registered a model or an adapter: applies the file on the server's loop."""
    try:
        change = asyncio.run_coroutine_threadsafe(apply_config(services), loop).result()
    except Exception as exc:
        return f"; the running server could not serve it yet ({exc}): fix it and POST /admin/config/reload"
    return "; now served" if change.added or change.changed or change.adapters else ""


ROUTES = [reload_config, add_model, edit_model, remove_model, load_model_now, unload_model_now]
