"""The semantic cache at the API: whether a chat request reads or writes the cache
(`Cache-Control: no-cache` skips the lookup, `no-store` the storing), and a hit served as a
response in the request's wire format, whole or streamed, marked `x-cache: hit`."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Response

from appliance.pipeline.call import WireFor, known_answer
from appliance.wire.schemas import ChatCompletionRequest
from appliance.pipeline.tool_request import has_tools
from appliance.pipeline.prepare import Prepared, chat_messages
from appliance.fleet.registry import LoadedModel
from appliance.answer_cache import Lookup, model_version
from appliance.server.services import Services, price_of
from appliance.config.settings import RouteSettings, split_tier
from engines.interface import FinishEvent, Usage
from policy.answer_cache import Cacheable, NotCacheable, classify
from policy.identity import Principal
from policy.programs import wants_program


@dataclass(frozen=True)
class CachePlan:
    item: Cacheable | None  # None: this request bypasses the cache
    read: bool
    write: bool
    lookup: Lookup | None = None

    def headers(self) -> dict[str, str]:
        if self.item is None or not self.read:
            return {"x-cache": "bypass"}
        headers = {"x-cache": "miss"}
        if self.lookup is not None:
            headers["x-cache-reason"] = self.lookup.reason
        return headers

    def remember(self, services: Services, model: LoadedModel, prepared: Prepared,
                 traced: Any = None) -> Callable[[str, FinishEvent], None] | None:
        """What to do with the answer once the model has given it."""
        item, lookup = self.item, self.lookup
        if item is None:
            return None
        price = price_of(model)

        def done(text: str, finish: FinishEvent) -> None:
            cost = price.cost(finish.usage.prompt_tokens, finish.usage.completion_tokens)
            if self.read:
                services.cache.count_miss(cost)
            if self.write:
                if traced is not None:
                    with traced.child("cache.store", cache__bucket=item.bucket.key, completion_tokens=finish.usage.completion_tokens):
                        pass  # queued to the cache's store thread
                services.cache.remember(item, lookup.vector if lookup else None, text, finish.reason, finish.usage.prompt_tokens,
                                        finish.usage.completion_tokens, cost, prepared.request.id, prepared.replay,
                                        prepared.request.max_tokens, prepared.request.stop)

        return done


_DIRECTIVE = re.compile(r"[a-z-]+")


def cache_plan(header: str | None, services: Services, principal: Principal, body: ChatCompletionRequest, model: LoadedModel,
               prepared: Prepared) -> CachePlan:
    directives = set(_DIRECTIVE.findall((header or "").lower()))
    if not services.cache.ready:
        services.metrics.cache_lookups.labels("bypass").inc()
        return CachePlan(None, False, False)
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
    return _plan(services, directives, principal, body, name, model_version(model.settings), settings, sampling.temperature)


def _adjustments(body: ChatCompletionRequest) -> dict[str, Any]:
    """logit_bias and the penalties change the answer, so they are part of the bucket; named only
    when set, so the buckets of requests without them stay what they were."""
    out: dict[str, Any] = {}
    if body.logit_bias:
        out["logit_bias"] = dict(sorted(body.logit_bias.items()))
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            out[name] = getattr(body, name)
    return out


def _plan(services: Services, directives: set[str], principal: Principal, body: ChatCompletionRequest, model: str,
          version: str, settings: dict[str, Any], temperature: float) -> CachePlan:
    # Never cached with tools offered or tool turns in the chat: a tool call's answer depends on the
    # tool set and on results from outside, which the question's text does not capture.
    decision = classify(
        tenant=principal.tenant, role=principal.role, model=model, model_version=version, messages=chat_messages(body),
        settings=settings, temperature=temperature, n=body.n or 1, wants_logprobs=body.logprobs, has_tools=has_tools(body),
        policy=services.cache.policy,
    )
    if isinstance(decision, NotCacheable):
        services.metrics.cache_lookups.labels("bypass").inc()
        return CachePlan(None, False, False)
    read, write = "no-cache" not in directives, "no-store" not in directives
    if not read:
        services.metrics.cache_lookups.labels("bypass").inc()
    return CachePlan(decision, read, write)


def answered_by_program(route: RouteSettings, body: ChatCompletionRequest) -> bool:
    """Whether the route asks for a program first: its family is listed and it wants plain text (no
    tools, no JSON form). One decision for the route's attempt and for the cache bucket it answers in."""
    json_form = body.response_format is not None and body.response_format.type in ("json_object", "json_schema")
    return wants_program(route.program_families, body.metadata, body.tools is None and body.functions is None and not json_form)


def route_cache_plan(header: str | None, services: Services, principal: Principal, body: ChatCompletionRequest,
                     route: RouteSettings) -> CachePlan:
    """A routed request's place in the cache: its bucket names the route and a digest of its tiers'
    versions, so any tier's validated answer serves the same question, and changing the fleet
    changes the bucket."""
    directives = set(_DIRECTIVE.findall((header or "").lower()))
    if not services.cache.ready:
        services.metrics.cache_lookups.labels("bypass").inc()
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
    return _plan(services, directives, principal, body, route.alias, ";".join(versions), settings, temperature)


async def charge_judge(services: Services, principal: Principal, model: LoadedModel, request_id: str, found: Lookup) -> None:
    """A miss the judge was asked about still pays for the judge's tokens, as a hit does: settled
    under its own id, apart from the model call that follows."""
    judge_prompt, judge_completion = found.judge_tokens
    if found.entry is not None or not (judge_prompt or judge_completion):
        return
    admission = await services.gate.admit(principal, f"{request_id}.judge", model.settings.alias, price_of(model), judge_prompt, judge_completion)
    services.gate.settle(admission, judge_prompt, judge_completion, "cache_judge")


async def serve_hit(services: Services, principal: Principal, model: LoadedModel, prepared: Prepared, found: Lookup,
                    stream: bool, wire_for: WireFor) -> Response[Any]:
    """A hit still passes the rate limits and the budget, at the hit's own cost (the judge's tokens,
    if it was asked), and is logged and counted."""
    entry = found.entry
    assert entry is not None
    started = time.time()
    judge_prompt, judge_completion = found.judge_tokens
    admission = await services.gate.admit(principal, prepared.request.id, model.settings.alias, price_of(model), judge_prompt, judge_completion)
    services.gate.settle(admission, judge_prompt, judge_completion, "cache_hit")
    services.cache.record_hit(entry, prepared.request.id, found.similarity, found.judged)
    prompt_tokens = prepared.request.prompt_length
    finish = FinishEvent(entry.finish_reason, Usage(prompt_tokens, entry.completion_tokens, prompt_tokens), "",  # type: ignore[arg-type]
                         0.0, time.time() - started)
    services.record(prepared, model, "chat", started, finish, "cache_hit", principal, cost_nanos=price_of(model).cost(judge_prompt, judge_completion))
    headers = {"x-cache": "hit", "x-cache-similarity": f"{found.similarity:.4f}", "x-cache-state": entry.state}
    return known_answer(wire_for(prepared, model.settings.alias, int(started)), entry.answer, [], finish, stream, headers,
                        prepared.tools)
