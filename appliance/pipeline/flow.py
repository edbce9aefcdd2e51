"""What a request goes through around its model call: input guards, the model (or route) it
names, the semantic cache, then the call itself (call.py). Chat completions and the Responses API
both come here with a ChatCompletionRequest and their own wire format; completions come with a
CompletionRequest, and skip the route and the cache."""

from __future__ import annotations

from appliance.pipeline import call
from appliance.pipeline.cached import cache_plan, look_up, serve_hit
from appliance.pipeline.collect import both, keeper
from appliance.pipeline.context import Answer, CallContext, Remember
from appliance.pipeline.guards import guard
from appliance.pipeline.models import model_with_adapters, tier_model
from appliance.pipeline.prepare import (
    chat_messages,
    check_metadata,
    prepare_chat,
    prepare_completion,
    unsupported_chat,
    with_adapters,
)
from appliance.pipeline.routed import routable, routed_chat
from appliance.wire.schemas import ChatCompletionRequest, CompletionRequest


async def serve_chat(ctx: CallContext, body: ChatCompletionRequest) -> Answer:
    """Guards, then the route or the model, the cache, and the call; the caller's wire format
    shapes the answer. Ends the trace on every path that answers without a live stream."""
    unsupported_chat(body)
    check_metadata(body.metadata)
    await guard(ctx, [m.get("content", "") for m in chat_messages(body) if m.get("role") == "user"])
    services = ctx.services
    route = services.settings.route(body.model)
    if route is not None:
        routable(body, route)
        ctx.notes["route"] = route.alias
        ctx.trace.annotate(model=route.alias, stream=body.stream, end_user=body.user)
        payer, _ = tier_model(services, route.tiers[0])  # where a routed request's cached answer is counted
    else:
        payer, adapters = model_with_adapters(services, body.model, body.adapters)
        ctx.trace.annotate(model=payer.settings.alias, stream=body.stream, end_user=body.user)
        ctx = ctx.serving(payer, with_adapters(await prepare_chat(body, payer, services.settings.defaults, ctx.request_id), adapters))
    plan = await look_up(ctx, cache_plan(ctx, body, route), payer)
    if plan.hit is not None:
        if route is not None:  # the hit stands for the route's first tier
            ctx = ctx.serving(payer, await prepare_chat(body, payer, services.settings.defaults, ctx.request_id))
            ctx.trace.annotate(route__model="cache")
        answer = await serve_hit(ctx, plan.hit)
        if route is not None:
            answer.headers["x-route"] = route.alias
        ctx.trace.end(cache__result="hit", cache__entry_state=plan.hit.entry.state, http__status_code=200)
        return answer
    ctx.trace.annotate(cache__result="miss" if plan.read and plan.item is not None else "bypass")
    if route is not None:
        routed = await routed_chat(ctx, body, route, plan)
        ctx.trace.end(http__status_code=200)
        return routed

    def remember_for(ran: CallContext) -> Remember | None:
        return both(plan.remember(ran), keeper(ran, body, None, payer.settings.alias))

    return await call.respond(ctx, headers=plan.headers(), remember_for=remember_for)


async def serve_completion(ctx: CallContext, body: CompletionRequest) -> Answer:
    """A legacy completion: the guards, the model it names, the call."""
    await guard(ctx, [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)])
    model, adapters = model_with_adapters(ctx.services, body.model, body.adapters)
    ctx.trace.annotate(model=model.settings.alias, stream=body.stream, end_user=body.user)
    prepared = with_adapters(prepare_completion(body, model, ctx.services.settings.defaults, ctx.request_id), adapters)
    return await call.respond(ctx.serving(model, prepared))
