"""Ollama's API on /api: what Open WebUI, Continue, VS Code's Ollama provider and the `ollama`
clients call. /api/chat and /api/generate are asked as the chat (or completion) request they
translate to (appliance/wire/ollama_input.py) through the one flow chat takes (the key, rate
limits and budgets, guards, route or model, cache, traces, the request log) and answered in
Ollama's wire (appliance/wire/ollama.py); /api/embed and /api/embeddings go through the embedding
pipeline. Every error is Ollama's `{"error": "..."}`.

Ollama's clients send no key by default: in keys mode give one in the client's headers
(`Authorization: Bearer <key>`); docs/clients.md says how for each client."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, head, post
from litestar.response import Stream

from appliance.fleet.card import Card, card
from appliance.fleet.manager import ModelUnavailable
from appliance.fleet.registry import LoadedModel
from appliance.http.errors import handlers
from appliance.http.admin import _admin
from appliance.http.fleet import copy, remove, unavailable
from appliance.http.models import start_pull
from appliance.http.prologue import Endpoint, authenticate, begin, reply
from appliance.pipeline.context import Answer, CallContext
from appliance.pipeline.embed import embed
from appliance.pipeline.errors import APIError
from appliance.pipeline.flow import serve_chat, serve_completion
from appliance.pipeline.models import resolve_model
from appliance.server.jobs import Job
from appliance.server.services import Services
from appliance.wire.decode import decode_body
from appliance.wire.ollama import NDJSON, VERSION, chat_wire, error_envelope, generate_wire, lifecycle_answer
from appliance.wire.ollama_input import (
    ChatBody,
    CopyBody,
    DeleteBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    PullBody,
    ShowBody,
    chat_request,
    generate_request,
    hub_file,
    keep_alive_s,
    model_name,
)
from appliance.wire.schemas import ChatCompletionRequest

OLLAMA_ERRORS = handlers(error_envelope)
# Served as chat, completions and embeddings: the request log and the model policy know them so.
CHAT = Endpoint("chat", "chatcmpl-", ChatBody, "chat", trace_auth=True, trace_body=False)
GENERATE = Endpoint("chat", "chatcmpl-", GenerateBody, "chat", trace_auth=True, trace_body=False)
EMBED = Endpoint("embeddings", "emb-", EmbedBody, "embeddings", trace_body=False)
EMBEDDINGS = Endpoint("embeddings", "emb-", EmbeddingsBody, "embeddings", trace_body=False)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _details(c: Card) -> dict[str, Any]:
    return {"parent_model": "", "format": c.format, "family": c.family, "families": [c.family] if c.family else None,
            "parameter_size": c.parameter_size, "quantization_level": c.quantization}


def _listed(services: Services) -> list[LoadedModel]:
    return [m for m in services.registry.all() if m.settings.kind in ("chat", "embedding")]


@get("/")
async def root() -> Response[str]:
    return Response("Ollama is running", media_type="text/plain")  # what Ollama's clients probe for


@head("/")
async def root_head() -> None:
    return None


@get("/api/version", exception_handlers=OLLAMA_ERRORS)
async def version() -> dict[str, str]:
    return {"version": VERSION}


@get("/api/tags", exception_handlers=OLLAMA_ERRORS)
async def tags(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await authenticate(request, services)
    data_dir = services.settings.server.data_dir
    out = []
    for model in _listed(services):
        c = card(model, data_dir)
        name = f"{model.settings.alias}:latest"
        out.append({"name": name, "model": name, "modified_at": _iso(c.modified_at or services.started_at), "size": c.size_bytes,
                    "digest": c.digest, "details": _details(c)})
    return {"models": out}


@post("/api/show", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def show(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await authenticate(request, services)
    body = decode_body(await request.body(), ShowBody)
    asked = body.model or body.name
    if not asked:
        raise APIError(400, "model: name the model to show.", param="model")
    model = services.registry.get(model_name(asked))
    if model is None or model.settings.kind not in ("chat", "embedding"):
        raise APIError(404, f"model '{asked}' not found", param="model", code="model_not_found")
    c = card(model, services.settings.server.data_dir)
    defaults = services.settings.defaults
    parameters = f"temperature {defaults.temperature}\ntop_p {defaults.top_p}\nnum_predict {defaults.max_tokens}\nnum_ctx {c.context_length}"
    info: dict[str, Any] = {"general.architecture": c.family, "general.size_label": c.parameter_size}
    if c.family:
        info[f"{c.family}.context_length"] = c.context_length
    return {"modelfile": "", "parameters": parameters, "template": c.template, "details": _details(c), "model_info": info,
            "capabilities": list(c.capabilities), "modified_at": _iso(c.modified_at or services.started_at)}


@get("/api/ps", exception_handlers=OLLAMA_ERRORS)
async def ps(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    await authenticate(request, services)
    data_dir = services.settings.server.data_dir
    rows = {row["alias"]: row for row in services.registry.manager.view()}
    out = []
    now = datetime.datetime.now(datetime.timezone.utc).timestamp()
    for model in _listed(services):
        row = rows.get(model.settings.alias)
        if row is not None and not row["loaded"]:
            continue  # on demand and not in memory now
        c = card(model, data_dir)
        unloads = row["unloads_in_s"] if row is not None else None
        name = f"{model.settings.alias}:latest"
        out.append({"name": name, "model": name, "size": (row or {}).get("memory_bytes") or c.size_bytes, "digest": c.digest,
                    "details": _details(c), "expires_at": _iso(now + unloads) if unloads is not None else "0001-01-01T00:00:00Z",
                    "size_vram": 0, "context_length": c.context_length})
    return {"models": out}


async def _lifecycle(ctx: CallContext, name: str, keep_alive: Any, kind: Any) -> Answer:
    """An empty request loads its model, or with keep_alive 0 unloads it (an admin's to ask: it
    takes the model from every tenant)."""
    services = ctx.services
    model = resolve_model(services, model_name(name), "chat")
    manager = services.registry.manager
    entry = manager.entry(model.settings.alias)
    seconds = keep_alive_s(keep_alive)
    reason = "unload" if seconds == 0 else "load"
    try:
        if entry is not None and reason == "load":
            await manager.load(entry)
            _keep(ctx, model.settings.alias, keep_alive)
        elif entry is not None:
            if not ctx.principal.admin:
                raise APIError(403, "Unloading a model is an admin key's to ask: it takes the model from every caller.",
                               code="permission_denied")
            await manager.unload(entry)
    except ModelUnavailable as exc:
        raise unavailable(exc) from None
    ctx.trace.end()
    return Answer(msgspec.json.encode(lifecycle_answer(f"{model.settings.alias}:latest", kind, reason)), {})


@post("/api/chat", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def chat(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, CHAT)
    return await reply(ctx, _chat(ctx, body))


def _keep(ctx: CallContext, model: str, keep_alive: Any) -> None:
    """A request's keep_alive (refused before any work when malformed) sets how long its model stays
    loaded after it: an admin's ask, since it decides for every caller of the model; a member's is
    accepted and the model's configured keep_alive stays."""
    seconds = keep_alive_s(keep_alive)
    if seconds is not None and ctx.principal.admin:
        ctx.services.registry.manager.keep_alive(model_name(model), seconds)


async def _chat(ctx: CallContext, body: ChatBody) -> Answer:
    if not body.messages:
        return await _lifecycle(ctx, body.model, body.keep_alive, "chat")
    _keep(ctx, body.model, body.keep_alive)
    asked = chat_request(body)
    return await serve_chat(ctx.answering(chat_wire, asked.stream), asked)


@post("/api/generate", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def generate(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, GENERATE)
    return await reply(ctx, _generate(ctx, body))


async def _generate(ctx: CallContext, body: GenerateBody) -> Answer:
    if not body.prompt and body.suffix is None:
        return await _lifecycle(ctx, body.model, body.keep_alive, "generate")
    _keep(ctx, body.model, body.keep_alive)
    asked = generate_request(body)
    if isinstance(asked, ChatCompletionRequest):
        return await serve_chat(ctx.answering(generate_wire, asked.stream), asked)
    return await serve_completion(ctx.answering(generate_wire, asked.stream), asked)


@post("/api/embed", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def embed_route(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, EMBED)
    return await reply(ctx, _embed(ctx, body))


async def _embed(ctx: CallContext, body: EmbedBody) -> Answer:
    done = await embed(ctx, model_name(body.model), body.input, body.dimensions)
    return Answer(msgspec.json.encode({"model": body.model, "embeddings": done.vectors.tolist(), "total_duration": 0,
                                       "load_duration": 0, "prompt_eval_count": done.prompt_tokens}), {})


@post("/api/embeddings", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def embeddings_route(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, EMBEDDINGS)
    return await reply(ctx, _embeddings(ctx, body))


async def _embeddings(ctx: CallContext, body: EmbeddingsBody) -> Answer:
    done = await embed(ctx, model_name(body.model), body.prompt, None)
    return Answer(msgspec.json.encode({"embedding": done.vectors[0].tolist()}), {})


@post("/api/pull", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def pull(request: Request[Any, Any, Any], services: Services) -> Any:
    """A hub file downloaded through the server's one download path (the admin API's pull job),
    registered and served; streamed as Ollama's progress lines unless `stream: false`. An admin
    key's to ask, as every change to the fleet is."""
    await _admin(request, services)
    body = decode_body(await request.body(), PullBody)
    repo, file = hub_file(body.model or body.name or "")
    job = start_pull(services, repo, file, None)
    if body.stream:
        return Stream(_progress(job), media_type=NDJSON)
    while job.state == "running":
        await asyncio.sleep(0.2)
    if job.state != "done":
        raise APIError(502, f"pull failed: {job.message}", code="pull_failed")
    return {"status": "success"}


async def _progress(job: Job) -> AsyncIterator[bytes]:
    """Ollama's pull lines, from the job as it runs: each change of the bytes done, then success
    (or the error)."""
    yield msgspec.json.encode({"status": "pulling manifest"}) + b"\n"
    seen: tuple[int, int | None] | None = None
    while True:
        state, done, total = job.state, job.done, job.total
        if (done, total) != seen:
            seen = (done, total)
            yield msgspec.json.encode({"status": f"pulling {job.description}", "digest": job.id, "total": total or 0,
                                       "completed": done}) + b"\n"
        if state != "running":
            break
        await asyncio.sleep(0.2)
    if state == "done":
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            yield msgspec.json.encode({"status": status}) + b"\n"
    else:
        yield msgspec.json.encode({"error": f"pull failed: {job.message}"}) + b"\n"


@delete("/api/delete", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def delete_model(request: Request[Any, Any, Any], services: Services) -> None:
    """The model out of models.toml (its file stays); an admin key's to ask."""
    await _admin(request, services)
    body = decode_body(await request.body(), DeleteBody)
    await remove(services, model_name(body.model or body.name or ""))


@post("/api/copy", status_code=200, exception_handlers=OLLAMA_ERRORS)
async def copy_model(request: Request[Any, Any, Any], services: Services) -> None:
    """The source's file served again under another alias, with the source's settings; an admin key's to ask."""
    await _admin(request, services)
    body = decode_body(await request.body(), CopyBody)
    await copy(services, model_name(body.source), model_name(body.destination))


ROUTES = [root, root_head, version, tags, show, ps, chat, generate, embed_route, embeddings_route, pull, delete_model, copy_model]
