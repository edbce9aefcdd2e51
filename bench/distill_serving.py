"""What serving loses while `appliance distill train` runs beside it on the same machine.

One server on the bundled model (2 threads); --clients streamed chat completions of --max-tokens
greedy tokens each, --rounds times, measured alone, then while a training job (the real CLI, on the
economics workload's classification and extraction examples) runs at each --nice given, then alone
again. By default the trainer pauses while the server has requests (the CLI watches its /health);
--no-yield keeps it running. Prints completion tok/s and time to first token (p50) for each, and the
steps the trainer made in the whole window (its load included).

    .venv/bin/python -m bench.distill_serving [--nice 10,19] [--train-threads 2] [--no-yield] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.distill_train import examples
from bench.kit.paths import ROOT
from bench.kit.peers import PACKAGE_FILE
from bench.kit.server import start


async def load(url: str, clients: int, rounds: int, max_tokens: int) -> tuple[float, float]:
    """(completion tok/s over the whole load, TTFT p50 in seconds)."""
    ttfts: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            body = {"model": "student", "messages": [{"role": "user", "content": f"Write a long story about the number {i * 10 + r}."}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            start = time.monotonic()
            first = None
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                        first = time.monotonic() - start
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append(first or 0.0)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(clients)))
        return tokens / (time.monotonic() - start), statistics.median(ttfts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", default="10,19", help="the trainer's nice values to try, comma-separated")
    parser.add_argument("--train-threads", type=int, default=2)
    parser.add_argument("--no-yield", action="store_true", help="the trainer keeps running while the server has requests")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distill-serving-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "APPLIANCE_HOME": str(work / "home")}
        (work / "models.toml").write_text(f'[[models]]\nalias = "student"\npackage_file = "{PACKAGE_FILE}"\ncontext_length = 2048\nthreads = 2\n'
                                          'slots = 4\n\n[auth]\nmode = "open"\n\n[cache]\nenabled = false\n')
        data = work / "examples.jsonl"
        data.write_text("".join(json.dumps(e) + "\n" for e in examples({"classification", "extraction"}, 500)))
        server = start(work)
        url = server.base
        try:
            asyncio.run(load(url, 1, 1, 8))  # warm
            rows = [("alone", *asyncio.run(load(url, args.clients, args.rounds, args.max_tokens)), "-")]
            show(rows[-1])
            for nice in [int(n) for n in args.nice.split(",")]:
                trainer = subprocess.Popen(
                    [sys.executable, "-m", "appliance.cli.main", "distill", "train", "--config", str(work / "models.toml"), "--student", "student",
                     "--data", str(data), "--out", f"n{nice}", "--steps", "10000", "--threads", str(args.train_threads), "--nice", str(nice),
                     "--url", url, *(["--no-yield"] if args.no_yield else [])], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                run = work / "home" / "distill" / "runs" / f"student--n{nice}"
                time.sleep(45)  # past the student's load: the trainer is stepping
                tok_s, ttft = asyncio.run(load(url, args.clients, args.rounds, args.max_tokens))
                trainer.send_signal(signal.SIGINT)  # stops after its step, with a checkpoint
                said = trainer.communicate(timeout=300)[0]
                if trainer.returncode != 130:
                    raise SystemExit(f"the trainer ended with {trainer.returncode}: {said[-2000:]}")
                steps = max((int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("checkpoint-*")), default=0)
                rows.append((f"training, nice {nice}, {args.train_threads} threads{'' if args.no_yield else ', yielding'}", tok_s, ttft, str(steps)))
                show(rows[-1])
            rows.append(("alone again", *asyncio.run(load(url, args.clients, args.rounds, args.max_tokens)), "-"))
            show(rows[-1])
        finally:
            server.stop()
    return 0


def show(row: tuple[str, float, float, str]) -> None:
    name, tok_s, ttft, steps = row
    print(f"{name:<34}{tok_s:>8.1f} tok/s  TTFT p50 {ttft:>6.2f}s  trainer steps {steps}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
