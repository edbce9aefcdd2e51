"""`n > 1`: several completions of one prompt, each a generation request of its own.

Choice i is the same request with seed + i (wrapped into 64 bits) when a seed is given, so a
fixed seed gives the same choices again; without a seed each choice draws its own. The engine's
prefix cache lets the copies share the prompt's prefill: the second request finds the first's
slot holding the prompt and copies its KV (engines/prefix.py), where the prompt is long enough
for a copy to pay. Usage counts the prompt once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from engines.base import EngineEvent, FinishEvent, GenerationRequest, Usage
from engines.stream import EventStream

_INT64 = 2**64


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of `request` (choice 0 is the request itself)."""
    if index == 0:
        return request
    s = request.sampling
    seed = None if s.seed is None else (s.seed + index + 2**63) % _INT64 - 2**63
    return dataclasses.replace(request, id=f"{request.id}.{index}", sampling=dataclasses.replace(s, seed=seed))


def total_finish(finishes: Sequence[FinishEvent], completion_tokens: int | None = None) -> FinishEvent:
    """One finish for the whole response, to settle, record and report usage: the prompt once, the
    completions summed (or `completion_tokens`, what was generated when a choice failed); the first
    error, if any, decides how the response ended."""
    first = next((f for f in finishes if f.reason == "error"), finishes[0])
    usage = Usage(finishes[0].usage.prompt_tokens,
                  sum(f.usage.completion_tokens for f in finishes) if completion_tokens is None else completion_tokens,
                  finishes[0].usage.cached_prompt_tokens)
    firsts = [f.time_to_first_token_s for f in finishes if f.time_to_first_token_s is not None]
    return dataclasses.replace(first, usage=usage, time_to_first_token_s=min(firsts, default=None),
                               total_time_s=max(f.total_time_s for f in finishes), inter_token_s=None)


class ChoiceStreams:
    """The n event streams of one response, closed together, read as (index, event) pairs in the
    order they arrive (each choice's own events in order)."""

    def __init__(self, streams: list[EventStream]) -> None:
        self.streams = streams

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def tokens_pushed(self) -> int:
        return sum(s.tokens_pushed for s in self.streams)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    async def peek(self) -> EngineEvent:
        """Every choice's first event (an upstream's refusal comes before any token): the first
        error among them, else choice 0's."""
        firsts = await asyncio.gather(*(s.peek() for s in self.streams))
        return next((e for e in firsts if isinstance(e, FinishEvent) and e.reason == "error"), firsts[0])

    async def events(self) -> AsyncIterator[tuple[int, EngineEvent]]:
        queue: asyncio.Queue[tuple[int, EngineEvent | None]] = asyncio.Queue()

        async def pump(index: int, stream: EventStream) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            live = len(tasks)
            while live:
                index, event = await queue.get()
                if event is None:
                    live -= 1
                else:
                    yield index, event
        finally:
            for task in tasks:
                task.cancel()
