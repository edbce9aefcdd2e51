"""The semantic cache at the API: whether a chat request reads or writes the cache
(`Cache-Control: no-cache` skips the lookup, `no-store` the storing), and a hit served as an
answer in the request's wire format, whole or streamed, marked `x-cache: hit`."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.answer_cache.service import Lookup, model_version
from appliance.config.settings import RouteSettings, split_tier
from appliance.fleet.registry import LoadedModel
from appliance.pipeline.call import known_answer, record
from appliance.pipeline.context import Answer, CallContext, Remember
from appliance.pipeline.prepare import chat_messages
from appliance.pipeline.tool_request import has_tools
from appliance.server.services import price_of
from appliance.server.tracing import annotate
from appliance.wire.schemas import ChatCompletionRequest
from engines.interface import FinishEvent, Usage
from policy.answer_cache import Cacheable, NotCacheable, classify
from policy.programs import wants_program
from policy.router import validate


@dataclass(frozen=True)
class CachePlan:
    item: Cacheable | None  # None: this request bypasses the cache
    read: bool
    write: bool
    lookup: Lookup | None = None
    schema: dict[str, Any] | None = None  # the caller's JSON Schema: an answer that meets it is verified by a validator

    @property
    def hit(self) -> Lookup | None:
        """The lookup that found an answer to serve; None on a miss or when the cache was not read."""
        return self.lookup if self.lookup is not None and self.lookup.entry is not None else None

    def headers(self) -> dict[str, str]:
        if self.item is None or not self.read:
            return {"x-cache": "bypass"}
        headers = {"x-cache": "miss"}
        if self.lookup is not None:
            headers["x-cache-reason"] = self.lookup.reason
        return headers

    def remember(self, ctx: CallContext) -> Remember | None:
        """What to do with the answer once the model `ctx` names has given it to the request it prepared."""
        item, lookup = self.item, self.lookup
        if item is None:
            return None
        model, prepared = ctx.chosen()
        services, traced = ctx.services, ctx.trace
        price = price_of(model)

        def done(text: str, finish: FinishEvent) -> None:
            cost = price.cost(finish.usage.prompt_tokens, finish.usage.completion_tokens)
            if self.read:
                services.cache.count_miss(cost)
            if self.write:
                with traced.child("cache.store", cache__bucket=item.bucket.key, completion_tokens=finish.usage.completion_tokens):
                    pass  # queued to the cache's store thread
                # The caller's own check, met: verified by a validator (the sweep's agreement never verifies).
                met = self.schema is not None and validate(text, finish.reason, [], self.schema, True, 0.0, 1.0).ok
                services.cache.remember(item, lookup.vector if lookup else None, text, finish.reason, finish.usage.prompt_tokens,
                                        finish.usage.completion_tokens, cost, prepared.request.id, prepared.replay,
                                        prepared.request.max_tokens, prepared.request.stop,
                                        verified_by="validator:json_schema" if met else None)

        return done


_DIRECTIVE = re.compile(r"[a-z-]+")


def cache_plan(ctx: CallContext, body: ChatCompletionRequest, route: RouteSettings | None) -> CachePlan:
    """Whether and where the request reads and writes the cache: a routed alias's bucket, or the
    bucket of the model `ctx` serves."""
    return _model_plan(ctx, body) if route is None else _route_plan(ctx, body, route)


async def look_up(ctx: CallContext, plan: CachePlan, payer: LoadedModel) -> CachePlan:
    """The plan with its lookup, when it reads the cache: `plan.hit` is an answer to serve; a miss
    the judge was asked about pays for the judge's tokens at `payer`'s price."""
    if not plan.read or plan.item is None:
        return plan
    with ctx.trace.child("cache.lookup", cache__bucket=plan.item.bucket.key) as span:
        found = await ctx.services.cache.lookup(plan.item, span=span)
        ctx.notes["cache"] = "hit" if found.entry is not None else "miss"
        annotate(span, cache__result=ctx.notes["cache"], cache__similarity=found.similarity,
                 cache__reason=found.reason, cache__judged=found.judged)
    await charge_judge(ctx, payer, found)
    return dataclasses.replace(plan, lookup=found)


def _bypass(ctx: CallContext) -> None:
    ctx.services.metrics.cache_lookups.labels("bypass").inc()
    ctx.notes["cache"] = "bypass"


def _model_plan(ctx: CallContext, body: ChatCompletionRequest) -> CachePlan:
    """A request to a model by name: its bucket names the model (and its adapters) and its version."""
    services = ctx.services
    if not services.cache.ready:
        _bypass(ctx)
        return CachePlan(None, False, False)
    model, prepared = ctx.chosen()
    sampling = prepared.request.sampling
    settings = {
        "endpoint": "chat",
        "max_tokens": prepared.request.max_tokens,
        "stop": list(prepared.request.stop),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "response_format": msgspec.to_builtins(body.response_format) if body.response_format is not None else None,
        **_adjustments(body),
    }
    # An adapter answers differently from its base model: its answers get their own buckets.
    name = prepared.model_name(model.settings.alias)
    return _plan(ctx, body, name, model_version(model.settings), settings, sampling.temperature)


def _adjustments(body: ChatCompletionRequest) -> dict[str, Any]:
    """logit_bias, top_k, the penalties and the reasoning effort change the answer, so they are part of the bucket; named
    only when set, so the buckets of requests without them stay what they were."""
    out: dict[str, Any] = {}
    if body.logit_bias:
        out["logit_bias"] = dict(sorted(body.logit_bias.items()))
    for name in ("top_k", "frequency_penalty", "presence_penalty", "reasoning_effort"):
        if getattr(body, name):
            out[name] = getattr(body, name)
    return out


def _plan(ctx: CallContext, body: ChatCompletionRequest, model: str, version: str, settings: dict[str, Any],
          temperature: float) -> CachePlan:
    services, principal = ctx.services, ctx.principal
    # Never cached with tools offered or tool turns in the chat: a tool call's answer depends on the
    # tool set and on results from outside, which the question's text does not capture.
    unset = body.temperature is None and services.cache.policy.cache_unset_temperature
    decision = classify(
        tenant=principal.tenant, role=principal.role, model=model, model_version=version, messages=chat_messages(body),
        settings=settings, temperature=None if unset else temperature, n=body.n or 1, wants_logprobs=body.logprobs, has_tools=has_tools(body),
        policy=services.cache.policy,
    )
    if isinstance(decision, NotCacheable):
        _bypass(ctx)
        return CachePlan(None, False, False)
    directives = set(_DIRECTIVE.findall((ctx.cache_control or "").lower()))
    read, write = "no-cache" not in directives, "no-store" not in directives
    if not read:
        _bypass(ctx)
    fmt = body.response_format
    schema = fmt.json_schema.schema if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None else None
    return CachePlan(decision, read, write, schema=schema)


def answered_by_program(route: RouteSettings, body: ChatCompletionRequest) -> bool:
    """Whether the route asks for a program first: its family is listed and it wants plain text (no
    tools, no JSON form). One decision for the route's attempt and for the cache bucket it answers in."""
    json_form = body.response_format is not None and body.response_format.type in ("json_object", "json_schema")
    return wants_program(route.program_families, body.metadata, body.tools is None and body.functions is None and not json_form)


def _route_plan(ctx: CallContext, body: ChatCompletionRequest, route: RouteSettings) -> CachePlan:
    """A routed request's place in the cache: its bucket names the route and a digest of its tiers'
    versions, so any tier's validated answer serves the same question, and changing the fleet
    changes the bucket."""
    services = ctx.services
    if not services.cache.ready:
        _bypass(ctx)
        return CachePlan(None, False, False)
    defaults = services.settings.defaults
    temperature = defaults.temperature if body.temperature is None else body.temperature
    settings = {
        "endpoint": "chat", "route": route.alias,
        "max_tokens": body.max_completion_tokens or body.max_tokens or defaults.max_tokens,
        "stop": body.stop, "temperature": temperature, "top_p": defaults.top_p if body.top_p is None else body.top_p,
        "seed": body.seed,
        "response_format": msgspec.to_builtins(body.response_format) if body.response_format is not None else None,
        **_adjustments(body),
        # A program's reply has another form than a worked answer's: each keeps its own bucket.
        **({"program": True} if answered_by_program(route, body) else {}),
    }
    versions = []
    for tier in route.tiers:  # a distilled tier ("alias:adapter") keeps its own answers, apart from its base's
        model = services.registry.get(split_tier(tier)[0])
        versions.append(f"{tier}={model_version(model.settings) if model else '?'}")
    return _plan(ctx, body, route.alias, ";".join(versions), settings, temperature)


async def charge_judge(ctx: CallContext, model: LoadedModel, found: Lookup) -> None:
    """A miss the judge was asked about still pays for the judge's tokens, as a hit does: settled
    under its own id, apart from the model call that follows."""
    judge_prompt, judge_completion = found.judge_tokens
    if found.entry is not None or not (judge_prompt or judge_completion):
        return
    gate = ctx.services.gate
    admission = await gate.admit(ctx.principal, f"{ctx.request_id}.judge", model.settings.alias, price_of(model), judge_prompt, judge_completion)
    gate.settle(admission, judge_prompt, judge_completion, "cache_judge")


async def serve_hit(ctx: CallContext, found: Lookup) -> Answer:
    """A hit still passes the rate limits and the budget, at the hit's own cost (the judge's tokens,
    if it was asked), and is logged and counted. `ctx` names the model whose answer it stands for."""
    entry = found.entry
    assert entry is not None
    model, prepared = ctx.chosen()
    services = ctx.services
    started = time.time()
    judge_prompt, judge_completion = found.judge_tokens
    admission = await services.gate.admit(ctx.principal, prepared.request.id, model.settings.alias, price_of(model), judge_prompt,
                                          judge_completion)
    services.gate.settle(admission, judge_prompt, judge_completion, "cache_hit")
    services.cache.record_hit(entry, prepared.request.id, found.similarity, found.judged, found.score, found.language, found.judge)
    prompt_tokens = prepared.request.prompt_length
    finish = FinishEvent(entry.finish_reason, Usage(prompt_tokens, entry.completion_tokens, prompt_tokens), "",  # type: ignore[arg-type]
                         0.0, time.time() - started)
    record(ctx, started, finish, "cache_hit", cost_nanos=price_of(model).cost(judge_prompt, judge_completion))
    headers = {"x-cache": "hit", "x-cache-similarity": f"{found.similarity:.4f}", "x-cache-state": entry.state}
    answer = known_answer(ctx, model.settings.alias, entry.answer, [], finish, started, headers)
    ctx.trace.answered(ctx.request_id, model.settings.alias, [entry.finish_reason])
    return answer
