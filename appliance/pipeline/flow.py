"""What a request goes through around its model call: input guards, the model (or route) it
names, the semantic cache, then the call itself (call.py). Chat completions and the Responses API
both come here with a ChatCompletionRequest and their own wire format; completions come with a
CompletionRequest, and skip the route and the cache."""

from __future__ import annotations

import dataclasses

from appliance.pipeline import call
from appliance.pipeline.cached import cache_plan, charge_judge, serve_hit
from appliance.pipeline.collect import both, keeper
from appliance.pipeline.context import Answer, CallContext, Remember
from appliance.pipeline.errors import invalid
from appliance.pipeline.guards import guard
from appliance.pipeline.models import model_with_adapters
from appliance.pipeline.prepare import (
    chat_messages,
    check_metadata,
    prepare_chat,
    prepare_completion,
    unsupported_chat,
    with_adapters,
)
from appliance.pipeline.routed import routed_chat
from appliance.server.tracing import annotate
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest


async def serve_chat(ctx: CallContext, body: ChatCompletionRequest) -> Answer:
    """Guards, then the route or the model, the cache, and the call; the caller's wire format
    shapes the answer. Ends the trace on every path that answers without a live stream."""
    unsupported_chat(body)
    check_metadata(body.metadata)
    await guard(ctx, [m.get("content", "") for m in chat_messages(body) if m.get("role") == "user"])
    route = ctx.services.settings.route(body.model)
    if route is not None:
        if body.n != 1:
            # A route validates and escalates one answer; n answers would each take their own path.
            raise invalid(f"The route '{route.alias}' answers with one choice: send n=1, or name a model for n > 1.", "n")
        if body.logit_bias:
            # Token ids belong to one vocabulary; a route's tiers may each have another.
            raise invalid(f"The route '{route.alias}' spans models with their own vocabularies: name a model to use logit_bias.",
                          "logit_bias")
        if body.adapters:
            # A route's tiers are its own models and adapters (a tier may name one); the caller's would apply to whichever answers.
            raise invalid(f"The route '{route.alias}' chooses its tiers' adapters: name a model to use adapters.", "adapters")
        ctx.trace.annotate(model=route.alias, stream=body.stream, end_user=body.user)
        routed = await routed_chat(ctx, body, route)
        ctx.trace.end(http__status_code=200)
        return routed
    model, adapters = model_with_adapters(ctx.services, body.model, body.adapters)
    ctx.trace.annotate(model=model.settings.alias, stream=body.stream, end_user=body.user)
    prepared = with_adapters(await prepare_chat(body, model, ctx.services.settings.defaults, ctx.request_id), adapters)
    ctx = ctx.serving(model, prepared)
    plan = cache_plan(ctx, body)
    if plan.read and plan.item is not None:
        with ctx.trace.child("cache.lookup", cache__bucket=plan.item.bucket.key) as span:
            found = await ctx.services.cache.lookup(plan.item, span=span)
            annotate(span, cache__result="hit" if found.entry is not None else "miss", cache__similarity=found.similarity,
                     cache__reason=found.reason, cache__judged=found.judged)
        if found.entry is not None:
            answer = await serve_hit(ctx, found)
            ctx.trace.end(cache__result="hit", cache__entry_state=found.entry.state, http__status_code=200)
            return answer
        await charge_judge(ctx, model, found)
        plan = dataclasses.replace(plan, lookup=found)
    ctx.trace.annotate(cache__result="miss" if plan.read and plan.item is not None else "bypass")

    def remember_for(ran: CallContext) -> Remember | None:
        return both(plan.remember(ran), keeper(ran, body, None, model.settings.alias))

    return await call.respond(ctx, headers=plan.headers(), remember_for=remember_for)


async def serve_completion(ctx: CallContext, body: CompletionRequest) -> Answer:
    """A legacy completion: the guards, the model it names, the call."""
    await guard(ctx, [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)])
    model, adapters = model_with_adapters(ctx.services, body.model, body.adapters)
    ctx.trace.annotate(model=model.settings.alias, stream=body.stream, end_user=body.user)
    prepared = with_adapters(prepare_completion(body, model, ctx.services.settings.defaults, ctx.request_id), adapters)
    return await call.respond(ctx.serving(model, prepared))
