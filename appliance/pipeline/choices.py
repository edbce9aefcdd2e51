"""A call's choices: `n` completions of one prompt, each a generation request of its own (n = 1
is the usual call, with one).

Choice i is the same request with seed + i (wrapped into 64 bits) when a seed is given, so a
fixed seed gives the same choices again; without a seed each choice draws its own. The engine's
prefix cache lets the copies share the prompt's prefill: the second request finds the first's
slot holding the prompt and copies its KV (engines/prefix.py), where the prompt is long enough
for a copy to pay. Usage counts the prompt once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from appliance.prompt.reasoning import ReasoningSplit
from engines.interface import EngineEvent, FinishEvent, GenerationRequest, TokenEvent, TokenLogprob, Usage
from engines.stream import EventStream

_INT64 = 2**64


@dataclass(frozen=True)
class Collected:
    """One choice, read to its end."""

    text: str  # the answer (a reasoning model's reasoning apart)
    logprobs: list[TokenLogprob]
    finish: FinishEvent  # its usage counts the reasoning tokens
    reasoning: str = ""


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of `request` (choice 0 is the request itself)."""
    if index == 0:
        return request
    s = request.sampling
    seed = None if s.seed is None else (s.seed + index + 2**63) % _INT64 - 2**63
    return dataclasses.replace(request, id=f"{request.id}.{index}", sampling=dataclasses.replace(s, seed=seed))


def total_finish(ended: Mapping[int, FinishEvent], choices: int, generated: int) -> FinishEvent | None:
    """The whole answer's finish, to settle, record and report usage: once every choice has ended,
    the prompt once and the completions summed; once one has failed (the others cut), that error,
    charged for the `generated` tokens of them all. None while neither (a client gone before the
    end: the caller settles on what was generated). One choice's finish is its own."""
    errors = [f for _, f in sorted(ended.items()) if f.reason == "error"]
    if len(ended) < choices and not errors:
        return None
    finishes = [f for _, f in sorted(ended.items())]
    if len(finishes) == 1 and choices == 1:
        return finishes[0]
    first = errors[0] if errors else finishes[0]
    completion = sum(f.usage.completion_tokens for f in finishes) if len(ended) == choices else generated
    reasoning = sum(f.usage.reasoning_tokens for f in finishes)
    usage = Usage(finishes[0].usage.prompt_tokens, completion, finishes[0].usage.cached_prompt_tokens, reasoning)
    firsts = [f.time_to_first_token_s for f in finishes if f.time_to_first_token_s is not None]
    return dataclasses.replace(first, usage=usage, time_to_first_token_s=min(firsts, default=None),
                               total_time_s=max(f.total_time_s for f in finishes), inter_token_s=None)


async def _collect(stream: EventStream, split: ReasoningSplit | None) -> Collected:
    parts: list[str] = []
    thought: list[str] = []
    thinking_tokens = 0
    logprobs: list[TokenLogprob] = []
    finish: FinishEvent | None = None
    try:
        async for event in stream:
            if split is None:
                parts.append(event.text)
            else:
                reasoning, content, inside = split.feed_token(event.text)
                thought.append(reasoning)
                parts.append(content)
                thinking_tokens += inside and isinstance(event, TokenEvent)
            if isinstance(event, TokenEvent):
                if event.logprob is not None:
                    logprobs.append(event.logprob)
            else:
                finish = event
    finally:
        stream.close()
    assert finish is not None
    if split is not None:
        reasoning, content = split.end()
        thought.append(reasoning)
        parts.append(content)
        finish = with_reasoning_tokens(finish, thinking_tokens)
    return Collected("".join(parts), logprobs, finish, "".join(thought))


def with_reasoning_tokens(finish: FinishEvent, count: int) -> FinishEvent:
    """The finish with the split's count of reasoning tokens, unless the engine counted them (an
    upstream that reports its own: it streams chunks, not tokens, so the split's count is near)."""
    if finish.usage.reasoning_tokens:
        return finish
    return dataclasses.replace(finish, usage=dataclasses.replace(finish.usage, reasoning_tokens=count))


class ChoiceStreams:
    """The event streams of one call's choices, closed together, read whole or as (index, event)
    pairs in the order they arrive (each choice's own events in order)."""

    def __init__(self, streams: list[EventStream]) -> None:
        self.streams = streams
        self._pumps: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def tokens_pushed(self) -> int:
        return sum(s.tokens_pushed for s in self.streams)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
        for pump in self._pumps:
            pump.cancel()

    async def peek(self) -> tuple[int, EngineEvent]:
        """Every choice's first event (an upstream's refusal comes before any token): the first
        error among them, else choice 0's."""
        if len(self.streams) == 1:
            return 0, await self.streams[0].peek()
        firsts = await asyncio.gather(*(s.peek() for s in self.streams))
        return next(((i, e) for i, e in enumerate(firsts) if isinstance(e, FinishEvent) and e.reason == "error"), (0, firsts[0]))

    async def collect(self, splitter: Callable[[], ReasoningSplit | None] = lambda: None) -> list[Collected]:
        """Every choice read to its end, side by side; a reasoning model's reasoning split from each answer."""
        if len(self.streams) == 1:
            return [await _collect(self.streams[0], splitter())]
        return list(await asyncio.gather(*(_collect(s, splitter()) for s in self.streams)))

    async def events(self) -> AsyncIterator[tuple[int, EngineEvent]]:
        if len(self.streams) == 1:
            async for event in self.streams[0]:
                yield 0, event
            return
        queue: asyncio.Queue[tuple[int, EngineEvent | None]] = asyncio.Queue()

        async def pump(index: int, stream: EventStream) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event))
            finally:
                queue.put_nowait((index, None))

        self._pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            live = len(self._pumps)
            while live:
                index, event = await queue.get()
                if event is None:
                    live -= 1
                else:
                    yield index, event
        finally:
            for task in self._pumps:
                task.cancel()
