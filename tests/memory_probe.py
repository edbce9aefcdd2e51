"""Loads a model the way the engine does, decodes one full batch, and prints (JSON) how much the
process's resident memory grew and the buffer sizes llama.cpp logged. Run in its own process so
that nothing else this test session loaded counts:

    python tests/memory_probe.py MODEL.gguf SLOTS CONTEXT_LENGTH KV_TYPE BATCH_TOKENS BATCH_INVARIANT(0|1) [GPU_LAYERS]

With GPU_LAYERS, also how much the free memory of the GPUs llama.cpp offloads to fell (null without one).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp as L  # noqa: E402

from engines.llamacpp.devices import gpu_devices  # noqa: E402
from engines.llamacpp.engine import context_layout  # noqa: E402
from engines.llamacpp.runtime import Context, ContextParams, Model, init_backend  # noqa: E402

_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")
lines: list[str] = []


@L.llama_log_callback
def _capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    lines.append(text.decode("utf-8", errors="replace"))


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    path, slots, context_length, kv_type, batch_tokens, invariant = sys.argv[1:7]
    slots_n, ctx_n, batch_n, invariant_b = int(slots), int(context_length), int(batch_tokens), invariant == "1"
    gpu_layers = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    init_backend()
    L.llama_log_set(_capture, ctypes.c_void_p(0))  # after init_backend, which installs the engine's own
    gpus_before = gpu_devices()
    before = rss()
    model = Model(Path(path), use_extra_buffers=not invariant_b, gpu_layers=gpu_layers)
    kv_unified, flash_attn = context_layout(invariant_b, kv_type)
    ctx = Context(model, ContextParams(slots_n, ctx_n, batch_n, 2, kv_unified, flash_attn, kv_type))
    # One full batch of prompt tokens in slot 0, logits for the last only (as a prefill step asks).
    ctx.decode([(100 + i % 1000, i, 0, i == batch_n - 1) for i in range(batch_n)])
    after = rss()
    free_after = {d.name: d.free for d in gpu_devices()}
    device_growth = sum(d.free - free_after.get(d.name, d.free) for d in gpus_before) if gpus_before else None
    buffers: dict[str, float] = {}
    for match in _BUFFER.finditer("".join(lines)):
        buffers[match[2]] = buffers.get(match[2], 0.0) + float(match[3])
        buffers[f"{match[1]} {match[2]}"] = float(match[3])
    print(json.dumps({"rss_growth": after - before, "device_growth": device_growth, "gpu_layers": gpu_layers,
                      "model_size": L.llama_model_size(model.ptr), "flash_attn": flash_attn,
                      "kv_unified": kv_unified, "buffers_mib": buffers}))
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
