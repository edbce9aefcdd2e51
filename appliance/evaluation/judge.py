"""A yes/no question to a small local chat model: one token forced by a grammar to "yes" or "no",
read as P(yes) from its log-probabilities. The cache's equivalence judge and the guardrails'
injection judge both ask this way; each caller accounts for the tokens it spent."""

from __future__ import annotations

import math
import uuid

from appliance.fleet.registry import LoadedModel
from engines.interface import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

YES_NO = 'root ::= "yes" | "no"'


async def yes_probability(model: LoadedModel, messages: list[dict[str, str]], tenant: str | None) -> tuple[float, tuple[int, int]]:
    """P(yes), and the (prompt, completion) tokens spent; `tenant`: whose text is judged (its prefix scope)."""
    assert model.template is not None  # settings allow only local chat models as judges
    tokens = (await model.chat_prompt_async(messages))[1]
    request = GenerationRequest(f"judge-{uuid.uuid4().hex}", tokens, 1,
                                SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20, grammar=YES_NO),
                                prefix_scope=model.prefix_scope(tenant))
    yes = no = 0.0
    async for event in model.engine.generate(request):
        if isinstance(event, TokenEvent) and event.logprob is not None:
            for top in event.logprob.top:
                word = top.token.strip().lower()
                if word == "yes":
                    yes += math.exp(top.logprob)
                elif word == "no":
                    no += math.exp(top.logprob)
        elif isinstance(event, FinishEvent):
            break
    return (yes / (yes + no) if yes + no > 0 else 0.0), (len(tokens), 1)
