"""Distillation's collect step on the request path: a finished answer of a tenant that opted in
(`[distill] tenants`) is kept with its prompt, the route and model that produced it and the
request's task family (`metadata.family`), written on the policy store's thread
(appliance/store/kept_answers.py). Nobody else's answer is kept."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from appliance.pipeline.context import CallContext, Remember
from appliance.pipeline.prepare import chat_messages
from appliance.pipeline.tool_request import has_tools
from appliance.store import kept_answers
from appliance.wire.schemas import ChatCompletionRequest
from engines.interface import FinishEvent
from policy.router import validate

log = logging.getLogger("appliance.distill")


def keeper(ctx: CallContext, body: ChatCompletionRequest, route: str | None, alias: str) -> Remember | None:
    """What to do with the answer `alias` gives to `body` as `ctx` prepared it (asked through `route`,
    or by name): keep it, or None."""
    services, principal = ctx.services, ctx.principal
    _, prepared = ctx.chosen()
    settings = services.settings.distill
    # Tool calls depend on tools and results from outside the prompt; n > 1 is several answers to one prompt.
    if principal.tenant not in settings.tenants or has_tools(body) or prepared.choices != 1:
        return None
    fmt = body.response_format
    schema = fmt.json_schema.schema if fmt is not None and fmt.json_schema is not None else None
    wants_json = fmt is not None and fmt.type in ("json_object", "json_schema")
    messages = [{"role": m["role"], "content": m["content"] or ""} for m in chat_messages(body)]
    family = (body.metadata or {}).get("family")
    model = prepared.model_name(alias)

    def keep(text: str, finish: FinishEvent) -> None:
        # The route's validators again (a cheap, pure check), so an answer asked by name passes the same
        # ones: one that fails (empty, cut, a refusal, JSON that breaks its schema) is not worth keeping.
        if not validate(text, finish.reason, [], schema, wants_json, 0.0, 1.0).ok:
            return
        answer = kept_answers.Answer(principal.tenant, prepared.request.id, route, model, family, messages, text, finish.reason,
                                     "json_schema" if schema is not None else None)
        services.store.submit(lambda db: kept_answers.keep(db, answer, settings.retention_days * 86400)).add_done_callback(_logged)

    return keep


def _logged(done: Future[None]) -> None:
    if done.exception() is not None:
        log.error("could not keep an answer for distillation: %s", done.exception())


def both(first: Remember | None, second: Remember | None) -> Remember | None:
    """Two things to do with a finished answer (the cache's store, the keeper), either possibly absent."""
    if first is None or second is None:
        return first or second

    def done(text: str, finish: FinishEvent) -> None:
        first(text, finish)
        second(text, finish)

    return done

