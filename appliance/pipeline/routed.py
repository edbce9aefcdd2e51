"""Requests to a routed alias (`model: "auto"`) that the cache did not answer: the tier chosen for
the request (route_choice.py), validated, escalating to the next tier on a failed validation or a
transport failure, and the route's deterministic default when every tier has failed. Each attempt
reserves and settles its own budget under its own id (`<request id>.<n>`), and is traced.

A routed answer is validated before any of it is sent, so a routed stream starts once the answer
is known good: the answer is then replayed as SSE chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from appliance.config.settings import RouteSettings
from appliance.fleet.registry import LoadedModel
from appliance.pipeline import call
from appliance.pipeline.cached import CachePlan, answered_by_program
from appliance.pipeline.call import known_answer
from appliance.pipeline.collect import keeper
from appliance.pipeline.context import Answer, CallContext
from appliance.pipeline.errors import APIError, invalid
from appliance.pipeline.models import tier_model
from appliance.pipeline.prepare import Prepared, chat_messages, prepare_chat, with_adapters
from appliance.pipeline.route_choice import choose_tier
from appliance.prompt.tool_calls import answer_problem
from appliance.server.services import Services, price_of
from appliance.server.tracing import annotate
from appliance.wire.schemas import ChatCompletionRequest, ChatMessage
from engines.interface import FinishEvent, Usage
from policy.programs import FORM_ROLES, NotStraightLine, program_of, straight_line
from policy.programs import PROMPT as PROGRAM_PROMPT, reply as program_reply
from policy.router import Verdict, family_first, family_rank, validate

_NOT_SERVED = ("cooling down", "timeout", "failed to serve")
_cooling: dict[str, float] = {}  # model alias -> until when it is skipped after failing to serve


def routable(body: ChatCompletionRequest, route: RouteSettings) -> None:
    """What a routed request may not ask for, refused before any work."""
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


async def routed_chat(ctx: CallContext, body: ChatCompletionRequest, route: RouteSettings, plan: CachePlan) -> Answer:
    """A request the cache did not answer (`plan`, the route's bucket): the tier it needs, up the
    chain until an answer passes the route's validators; the route's default when none does."""
    started = time.time()
    run = _Run(body, route, plan)
    bounded, floor, ceiling = await choose_tier(ctx, route, chat_messages(body), run.checks.wants_json, plan)
    reply = await _up_the_chain(ctx, run, bounded, floor, ceiling)
    answered, finish = reply.answered, reply.answered.finish
    ctx.trace.answered(ctx.request_id, reply.model_name, [finish.reason], finish.usage.prompt_tokens, finish.usage.completion_tokens)
    return known_answer(reply.ctx, reply.model_name, answered.text, answered.logprobs, finish, started, reply.headers,
                        answered.reasoning)


@dataclass(frozen=True)
class _Tier:
    """A tier asked: its name in the route (`alias` or `alias:adapter`), its model and adapters, and
    its place in the chain (None: the tier promoted for the request's family)."""

    alias: str
    model: LoadedModel
    adapters: tuple[tuple[str, float], ...]
    index: int | None


@dataclass(frozen=True)
class _Answered:
    """A tier's answer that passed the route's validators, and the request as it was asked."""

    prepared: Prepared
    text: str
    logprobs: list[Any]
    finish: FinishEvent
    reasoning: str = ""  # a reasoning model's, relayed beside the answer (only the answer is validated)


@dataclass(frozen=True)
class _Outcome:
    why: str  # "ok", or why the tier's answer is not taken
    answered: _Answered | None = None
    error: APIError | None = None  # a context too small: the refusal to give when no tier has the room


@dataclass(frozen=True)
class _Reply:
    """What a routed request answers: the request as asked of the model that answered, the model's
    name as the caller sees it, the answer, and the headers that say how it was reached."""

    ctx: CallContext
    model_name: str
    answered: _Answered
    headers: dict[str, str]


@dataclass(frozen=True)
class _Checks:
    """What an answer is validated against beyond the route's own checks: the request's JSON Schema,
    and whether it asked for JSON at all."""

    schema: dict | None
    wants_json: bool


@dataclass
class _Run:
    """A routed request on its way up the chain: what it asks, and what each attempt said and cost
    (both go into the answer's headers). Each attempt reserves and settles its own budget under its
    own id (`<request id>.<n>`)."""

    body: ChatCompletionRequest
    route: RouteSettings
    plan: CachePlan
    attempts: list[dict[str, Any]] = field(default_factory=list)
    spent: list[int] = field(default_factory=list)  # each model attempt's cost, failed ones included

    @property
    def checks(self) -> _Checks:
        fmt = self.body.response_format
        return _Checks(fmt.json_schema.schema if fmt is not None and fmt.json_schema is not None else None,
                       fmt is not None and fmt.type in ("json_object", "json_schema"))


async def _up_the_chain(ctx: CallContext, run: _Run, bounded: int, floor: int | None, ceiling: int | None) -> _Reply:
    """From the chosen tier up to the role's ceiling; when every tier above failed to serve at all
    (down, overloaded, timed out), the tiers below it are tried too, since a validated smaller answer
    beats the default."""
    body, route, attempts = run.body, run.route, run.attempts
    last = len(route.tiers) - 1
    top = min(last, ceiling) if ceiling is not None else last
    too_long: APIError | None = None
    bottom = floor if floor is not None else 0
    order: list[int | None] = [*range(bounded, top + 1), *range(bounded - 1, bottom - 1, -1)]
    family = family_first(route.family_tiers, route.tiers, body.metadata, floor, ceiling)
    alias = family or route.tiers[bounded]  # the family's tier where it has one (within the role's bounds), else the chosen tier
    if answered_by_program(route, body) and _cooling.get(alias, 0) <= time.monotonic():
        # A program instead of a worked answer; one that does not evaluate is no answer, and the
        # request is then answered as it was asked, from the same tier.
        reply = await _program(ctx, run, _tier(ctx.services, alias, bounded if family is None else family_rank(route.tiers, family)),
                               bounded if family is None else "family")
        if reply is not None:
            return reply
    if family is not None:  # its family's promoted tier first (index None); the route's choice if it fails
        order = [None, *(i for i in order if route.tiers[i] != family)]  # a chain tier that is the same model is not asked twice
        ctx.trace.annotate(route__family_tier=family)
    asked_before = len(attempts)  # a program's attempt, whose failure is no reason to go down the chain
    for index in order:
        if index is not None and index < bounded and not all(
                a["outcome"] in _NOT_SERVED or a["outcome"].startswith("unavailable")
                for a in attempts[asked_before + (1 if family else 0):]):
            break
        alias = family if index is None else route.tiers[index]
        if _cooling.get(alias, 0) > time.monotonic():
            attempts.append({"model": alias, "outcome": "cooling down"})
            continue
        tier = _tier(ctx.services, alias, index)
        outcome = await _attempt(ctx, run, body, tier, run.checks)
        attempts.append({"model": alias, "outcome": outcome.why})
        if outcome.why == "context too small":
            too_long = outcome.error
        if outcome.answered is not None:
            return _served(ctx, run, tier, "family" if index is None else index, outcome.answered)
    if attempts and all(a["outcome"] == "context too small" for a in attempts):
        assert too_long is not None
        raise too_long  # no tier can take this prompt: the caller's to shorten, not a default's to paper over
    return await _default(ctx, run)


async def _program(ctx: CallContext, run: _Run, tier: _Tier, label: int | str) -> _Reply | None:
    """The tier asked for a program, which is run here; None when it wrote none that evaluates."""
    body = run.body
    asked = msgspec.structs.replace(body, messages=[ChatMessage(role="system", content=PROGRAM_PROMPT),
                                                    *(m for m in body.messages if m.role not in FORM_ROLES)],
                                    logprobs=False, top_logprobs=None)
    outcome = await _attempt(ctx, run, asked, tier, _Checks(None, False))
    number, why = None, outcome.why
    if outcome.answered is not None:
        with ctx.trace.child("route.program") as span:
            program = program_of(outcome.answered.text)
            try:
                number, why = straight_line(program), "ok"
            except NotStraightLine as exc:
                why = str(exc)
            annotate(span, outcome=why)
    run.attempts.append({"model": tier.alias, "outcome": f"program: {why}"})
    if number is None or outcome.answered is None:
        return None
    prepared = with_adapters(await prepare_chat(body, tier.model, ctx.services.settings.defaults, ctx.request_id),
                             tier.adapters)
    return _served(ctx, run, tier, label, _Answered(prepared, program_reply(program, number), [], outcome.answered.finish),
                   (asked, outcome.answered.text))


async def _attempt(ctx: CallContext, run: _Run, asked: ChatCompletionRequest, tier: _Tier, checks: _Checks) -> _Outcome:
    """One tier: reserve, generate (with log-probabilities when confidence is checked), settle,
    validate."""
    route, model = run.route, tier.model
    attempt_id = f"{ctx.request_id}.{len(run.attempts) + 1}"
    try:
        prepared = with_adapters(await prepare_chat(asked, model, ctx.services.settings.defaults, attempt_id), tier.adapters)
    except APIError as exc:
        if exc.code == "context_length_exceeded":  # a bigger tier may have the room
            return _Outcome("context too small", error=exc)
        raise
    engine_view = prepared
    min_confidence = route.family_min_confidence if tier.index is None else route.min_confidence
    if min_confidence > 0 and not prepared.request.sampling.logprobs:
        sampling = dataclasses.replace(prepared.request.sampling, logprobs=True)
        engine_view = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, sampling=sampling))
    with ctx.trace.child("route.attempt", model=model.settings.alias, route__tier="family" if tier.index is None else tier.index,
                         attempt__id=attempt_id) as span:
        try:
            attempt = await call.start(ctx.serving(model, engine_view), span)
        except APIError as exc:
            if exc.code == "context_length_exceeded":
                annotate(span, outcome="context too small")
                return _Outcome("context too small", error=exc)
            if exc.status in (503,):  # overloaded or unloaded: cool down and fall back
                _cooling[model.settings.alias] = time.monotonic() + route.cooldown_s
                annotate(span, outcome=f"unavailable: {exc.message[:80]}")
                return _Outcome(f"unavailable ({exc.code})")
            raise  # a budget or rate-limit refusal is the caller's answer, not a reason to escalate
        finish: FinishEvent | None = None
        try:
            (collected,) = await asyncio.wait_for(attempt.collect(), route.attempt_timeout_s)  # a route's n is 1 (flow.py)
            finish = collected.finish
        except TimeoutError:
            # Too slow: the stream is closed (the engine drops the request), the model cools down.
            _cooling[model.settings.alias] = time.monotonic() + route.cooldown_s
            annotate(span, outcome="timeout")
            return _Outcome("timeout")
        finally:
            prompt_tokens, completion_tokens, _ = attempt.settle(finish)
            cost = price_of(model).cost(prompt_tokens, completion_tokens)
            run.spent.append(cost)  # a timed-out attempt paid too
        if finish.reason == "error" and (finish.error_status or 500) >= 500:
            # An engine error, or an upstream down or overloaded: cool it down and let the chain take over.
            _cooling[model.settings.alias] = time.monotonic() + route.cooldown_s
            annotate(span, outcome="failed to serve", error=(finish.error or "")[:200])
            return _Outcome("failed to serve")
        token_logprobs = [lp.logprob for lp in collected.logprobs]
        with ctx.trace.child("route.validate") as check:
            verdict: Verdict = validate(collected.text, finish.reason, token_logprobs, checks.schema, checks.wants_json, min_confidence,
                                        route.max_repetition)
            problem = answer_problem(collected.text, prepared.tools) if prepared.tools is not None else None
            if verdict.ok and problem is not None:  # a well-formed call is an answer; a broken one escalates
                verdict = Verdict(False, f"tool call: {problem}", verdict.confidence)
            annotate(check, ok=verdict.ok, reason=verdict.reason, confidence=verdict.confidence)
        annotate(span, outcome=verdict.reason, cost__nanousd=cost)
        if not verdict.ok:
            ctx.services.metrics.route_escalations.labels(model.settings.alias, verdict.reason.split(":")[0].split(" ")[0]).inc()
            return _Outcome(verdict.reason)
        logprobs = collected.logprobs if prepared.request.sampling.logprobs else []
        return _Outcome("ok", _Answered(prepared, collected.text, logprobs, finish, collected.reasoning))


def _served(ctx: CallContext, run: _Run, tier: _Tier, label: int | str, answered: _Answered,
            taught: tuple[ChatCompletionRequest, str] | None = None) -> _Reply:
    """The answer given; `taught` is what a student would learn from it when that is not the request and
    the reply (a program answer: the program request, and the program as the model wrote it)."""
    route, finish = run.route, answered.finish
    ctx.services.metrics.route_answers.labels(route.alias, tier.alias).inc()
    ctx.trace.annotate(route__model=tier.alias, route__tier=label, route__attempts=len(run.attempts))
    prepared = answered.prepared
    as_answered = ctx.serving(tier.model, dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, id=ctx.request_id)))
    stored = run.plan.remember(as_answered)
    if stored is not None:
        stored(answered.text, finish)
    kept = keeper(as_answered, taught[0] if taught else run.body, route.alias, tier.alias)
    if kept is not None:
        kept(taught[1] if taught else answered.text, finish)
    return _Reply(as_answered, tier.alias, answered,
                  {"x-route": route.alias, "x-route-model": tier.alias, "x-route-tier": str(label),
                   "x-route-attempts": json.dumps(run.attempts), "x-route-cost-nanousd": str(sum(run.spent)), **run.plan.headers()})


async def _default(ctx: CallContext, run: _Run) -> _Reply:
    """Every tier failed: the route's deterministic default, marked as such."""
    route = run.route
    ctx.services.metrics.route_answers.labels(route.alias, "default").inc()
    ctx.trace.annotate(route__default=True, route__attempts=len(run.attempts))
    model, _ = tier_model(ctx.services, route.tiers[0])
    prepared = await prepare_chat(run.body, model, ctx.services.settings.defaults, ctx.request_id)
    finish = FinishEvent("stop", Usage(prepared.request.prompt_length, 0))
    return _Reply(ctx.serving(model, prepared), route.alias, _Answered(prepared, route.default_response, [], finish),
                  {"x-route": route.alias, "x-route-default": "true", "x-route-attempts": json.dumps(run.attempts),
                   "x-route-cost-nanousd": str(sum(run.spent))})


def _tier(services: Services, alias: str, index: int | None) -> _Tier:
    model, adapters = tier_model(services, alias)
    return _Tier(alias, model, adapters, index)
