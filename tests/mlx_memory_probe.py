"""Loads an MLX folder the way the engine does, fills every slot's KV cache to its context (one
prompt per slot, decoded together), and prints (JSON) how much the process's resident memory grew,
its peak, and the appliance's estimate. Run in its own process, so that nothing else counts; the
libraries' first use (transformers' tokenizer machinery, about 40 MiB) is paid before measuring, as
a server pays it once for all its models:

    python tests/mlx_memory_probe.py FOLDER SLOTS CONTEXT_LENGTH
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402, F401  (the libraries' own pages are not the model's)
import mlx_lm  # noqa: E402, F401

from appliance.fleet.memory import mlx_estimate  # noqa: E402
from engines.interface import GenerationRequest, SamplingParams  # noqa: E402
from engines.mlx.engine import MlxConfig, MlxEngine  # noqa: E402
from engines.mlx.vocabulary import MlxVocabulary  # noqa: E402


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


async def fill(engine: MlxEngine, slots: int, context_length: int) -> None:
    prompt = tuple(100 + i % 1000 for i in range(context_length - 2))
    streams = [engine.generate(GenerationRequest(f"r{i}", prompt, 2, SamplingParams(temperature=0))) for i in range(slots)]
    for stream in streams:
        async for _ in stream:
            pass


def main() -> None:
    folder, slots, context_length = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    MlxVocabulary(folder).close()
    before = status("VmRSS")
    engine = MlxEngine(MlxConfig(folder, slots, context_length, max_queue=slots, prompt_cache_bytes=0))
    loaded = status("VmRSS")
    asyncio.run(fill(engine, slots, context_length))
    after = status("VmRSS")
    e = mlx_estimate(folder, slots, context_length)
    print(json.dumps({"slots": slots, "context_length": context_length, "rss_load": loaded - before, "rss_filled": after - before,
                      "peak": status("VmHWM") - before, "weights": e.weights, "kv": e.kv, "compute": e.compute, "total": e.total}))
    engine.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # Past this point MLX's teardown at interpreter exit sometimes aborts ("terminate called without
    # an active exception"; the engine before this change did too): the measurement is out already.
    os._exit(0)
