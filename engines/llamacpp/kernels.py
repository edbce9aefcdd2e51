"""Which matmul kernels llama.cpp's CPU backend uses, chosen before any model computes.

Kept apart from the runtime so that `appliance doctor` can report the choice without importing
llama_cpp (whose absence it must be able to report)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("appliance.llamacpp")

_lock = threading.Lock()

# llama.cpp's CPU backend multiplies K-quant and IQ weights (Q4_K, Q6_K, ...) with a tiled kernel
# from 8 rows up and a vector kernel below, and the two round differently: a token's logits then
# depend on how many rows share its batch (a prompt's last token, prefilled with the rest or decoded
# alone after a prefix-cache hit, gave other greedy text). Batch invariance needs one kernel for
# every batch size: the vector one (the tiled one costs ~10x on a single row). ggml reads the switch
# once per process, at the first matmul, so it is set before any model computes.
TILED_MATMUL_ENV = "GGML_CPU_TILED_MM"
_tiled_choice: str | None = None


def choose_matmul_kernels(invariant: bool) -> None:
    """Before any model computes: with `invariant`, K-quant matmuls take the vector kernel at every
    batch size (K-quant prompt processing runs ~40% slower; see docs/architecture.md). The first
    call decides for the process, as ggml will; an explicit GGML_CPU_TILED_MM in the environment wins."""
    global _tiled_choice
    with _lock:
        if _tiled_choice is None:
            if invariant:
                os.environ.setdefault(TILED_MATMUL_ENV, "0")
            _tiled_choice = os.environ.get(TILED_MATMUL_ENV, "1")
        if invariant and _tiled_choice != "0":
            log.warning("%s=%s: K-quant matmuls switch kernels at 8 rows in this process, so a batch-invariant model's "
                        "greedy output can depend on what shares its batch", TILED_MATMUL_ENV, _tiled_choice)
