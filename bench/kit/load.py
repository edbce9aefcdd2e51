"""Streamed chat load on a server: prompts no cache can serve, one request's timings, and clients
sending rounds of requests at once while the CPU other processes use is watched."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.kit.machine import cpu_busy_s, process_cpu_s
from bench.kit.server import Server
from bench.kit.stats import percentile

TOPICS = [
    "the history of the Roman Empire", "how the human immune system works", "the life cycle of stars",
    "the causes of the French Revolution", "how airplanes fly", "the water cycle on Earth",
    "the invention of the printing press", "how computers store data", "the ecology of coral reefs",
    "the history of the Olympic Games", "how vaccines are developed", "the geography of South America",
    "the industrial revolution in Britain", "how volcanoes form", "the migration of birds",
    "the history of mathematics", "how electricity reaches our homes", "the culture of ancient Egypt",
    "the theory of evolution", "how bread is made", "the exploration of the Moon",
    "the life of honey bees", "the history of the bicycle", "how rain forests affect the climate",
    "the building of the pyramids", "how the internet works", "the history of music notation",
    "the physics of rainbows", "the growth of cities", "how ships navigate the ocean",
    "the history of medicine", "the formation of mountains", "how plants make food",
]


WORDS = ("river mountain engine library garden window theory market signal harbor planet lantern copper meadow "
         "circuit festival glacier orbit canvas ledger compass thunder velvet quarry saddle beacon mosaic harvest "
         "falcon prism tunnel orchard anchor summit blossom cipher voyage ember granite meadowlark tidewater").split()


def long_prompt(tokens: int, seed: int) -> str:
    """About `tokens` tokens of text no other request has sent (a seeded shuffle of words)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(int(tokens * 0.95))]
    return f"Request {seed}. Summarise the following notes in one word.\n" + " ".join(words)


def prompt(i: int, tokens: int = 0) -> str:
    """Request i's prompt: a short essay request, or with `tokens` notes of about that length and
    then the same request (new text every time, so no prefix cache can serve it)."""
    if tokens:
        return long_prompt(tokens, seed=i).replace("Summarise the following notes in one word.", "Notes follow.") + \
            "\n\n" + prompt(i)
    topic = TOPICS[i % len(TOPICS)]
    return (f"Write a long, detailed essay about {topic}. Cover the background, the main events or "
            f"ideas, the important people or parts involved, and why it matters today. "
            f"Use several paragraphs.")


@dataclass
class Result:
    ok: bool
    ttft: float | None = None  # seconds to the first non-empty content delta
    total: float = 0.0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    chunk_tokens: int = 0
    finish: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunk_tokens


async def one_request(client: httpx.AsyncClient, server: Server, i: int, max_tokens: int, prompt_tokens: int = 0,
                      sampling: dict[str, float] | None = None) -> Result:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt(i, prompt_tokens)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),  # temperature, top_p, seed: greedy unless given
    }
    res = Result(ok=False)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as r:
            res.status = r.status_code
            if not 200 <= r.status_code < 300:  # OpenAI answers 200; any success status is let through and recorded
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return res
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        res.chunk_tokens += 1
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.prompt_tokens = int(usage["prompt_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.total = time.perf_counter() - t0
    if res.ttft is None and res.finish is not None:
        res.ttft = res.total  # the first token ended the answer (an end of turn): it came with the finish
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no content streamed"
    return res


class Disturbed(RuntimeError):
    pass


DISTURBED_CORES = 0.5  # others' average use over DISTURBED_WINDOW_S that abandons a measurement
DISTURBED_WINDOW_S = 5.0


async def disturbance(server_pid: int) -> float:
    """Return once other processes have used over DISTURBED_CORES cores for DISTURBED_WINDOW_S seconds."""
    samples: list[tuple[float, float]] = []  # (monotonic time, CPU seconds used by others so far)
    base_busy, base_server, base_self = cpu_busy_s(), process_cpu_s(server_pid), time.process_time()
    while True:
        await asyncio.sleep(1.0)
        others = (cpu_busy_s() - base_busy) - (process_cpu_s(server_pid) - base_server) - (time.process_time() - base_self)
        now = time.monotonic()
        samples.append((now, others))
        old = [s for s in samples if now - s[0] >= DISTURBED_WINDOW_S]
        if old:
            t, o = old[-1]
            use = (others - o) / (now - t)
            if use > DISTURBED_CORES:
                return use
            samples = samples[samples.index(old[-1]):]


async def run_load(server: Server, clients: int, rounds: int, max_tokens: int, first_prompt: int,
                   watch: bool = False, stagger_s: float = 0.0, prompt_tokens: int = 0,
                   sampling: dict[str, float] | None = None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    timeout = httpx.Timeout(connect=10.0, read=900.0, write=30.0, pool=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker(c: int) -> list[Result]:
            out = []
            await asyncio.sleep(c * stagger_s)  # staggered arrivals stay out of phase for every round
            for r in range(rounds):
                out.append(await one_request(client, server, first_prompt + r * clients + c, max_tokens, prompt_tokens, sampling))
            return out

        assert server.proc is not None
        load0 = os.getloadavg()[0]
        busy0, server0, self0 = cpu_busy_s(), process_cpu_s(server.proc.pid), time.process_time()
        t0 = time.perf_counter()
        load = asyncio.ensure_future(asyncio.gather(*(worker(c) for c in range(clients))))
        if watch:
            watchdog = asyncio.ensure_future(disturbance(server.proc.pid))
            await asyncio.wait({load, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():
                others = watchdog.result()
                load.cancel()
                try:
                    await load
                except asyncio.CancelledError:
                    pass
                raise Disturbed(f"other processes used {others:.2f} cores; measurement abandoned")
            watchdog.cancel()
        per_client = await load
        wall = time.perf_counter() - t0
        busy = cpu_busy_s() - busy0
        server_cpu = process_cpu_s(server.proc.pid) - server0
        bench_cpu = time.process_time() - self0
    results = [r for rs in per_client for r in rs]
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    errors = [r.error for r in results if not r.ok]
    usage_seen = [r.usage_tokens is not None for r in good]
    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "token_source": "usage" if good and all(usage_seen) else ("chunks" if not any(usage_seen) else "mixed"),
        "chunks_per_request": sum(r.chunk_tokens for r in good) / len(good) if good else None,
        "usage_tokens_per_request": (sum(r.usage_tokens or 0 for r in good) / len(good)) if good and any(usage_seen) else None,
        "finish_reasons": sorted({str(r.finish) for r in good}),
        "http_statuses": sorted({r.status for r in results if r.status is not None}),
        "prompt_tokens": sorted({r.prompt_tokens for r in good if r.prompt_tokens is not None}),
        # per request, client by client, round by round: [ttft_s, total_s, completion tokens]
        "requests_detail": [[[round(r.ttft or -1, 4), round(r.total, 4), r.tokens] for r in rs] for rs in per_client],
        # CPU the server and this client used, and what everything else on the machine used meanwhile
        # (in cores on average): above ~0.05 the figures are disturbed by someone else's work
        "server_cores": server_cpu / wall if wall > 0 else None,
        "bench_client_cores": bench_cpu / wall if wall > 0 else None,
        "other_cores": max(0.0, busy - server_cpu - bench_cpu) / wall if wall > 0 else None,
        "loadavg_1m_before": load0,
        "loadavg_1m_after": os.getloadavg()[0],
    }

