"""How much memory a llama.cpp model takes, and how many of its layers a GPU can hold.

Pure arithmetic over a model's shape (read from its GGUF file elsewhere, appliance/fleet/memory.py),
checked against what llama.cpp allocates (tests/test_memory_plan.py, docs/gpu.md):

- weights: every tensor's bytes as stored; a layer's are its `blk.N.*` tensors; with extra
  buffers on, ggml's CPU backend keeps a repacked copy of a layer's Q4_0/Q4_K/IQ4_NL matrices;
- KV cache: per layer, cells x (K width + V width) x bytes per element of the cache type, with a
  quantized type's block overhead (q8_0 is 34 bytes per 32 values); each slot's cells are padded to
  256, as llama.cpp pads them;
- host overhead: llama.cpp's vocabulary tables, measured at 320-360 bytes a token (17 MiB for
  SmolLM2's 49k tokens, 47 MiB for Qwen2.5's 152k), allowed VOCAB_BYTES_PER_TOKEN;
- compute: an allowance for llama.cpp's graph buffer, the larger of the logits of a full batch and
  (without flash attention) the attention scores, plus the attention mask, a full batch's
  activations and the per-slot logits llama.cpp keeps.

Offloading follows llama.cpp's `n_gpu_layers`: N <= n_layer puts the last N blocks (weights and
their KV) on the device; n_layer + 1 adds the output layer; the token embeddings stay on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

# ggml's storage of one block of values: (values per block, bytes per block), for the KV cache
# types the engine offers (engines/llamacpp/runtime.py, KV_TYPES).
KV_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18),
}
# llama.cpp rounds each sequence's KV cells up to a multiple of this.
KV_CELL_PAD = 256
# What llama.cpp's own parameter fitting leaves free on each device by default (1 GiB): CUDA's
# cuBLAS workspace, fragmentation and other processes' growth live there.
DEFAULT_DEVICE_RESERVE = 1 << 30
VOCAB_BYTES_PER_TOKEN = 384


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model file."""

    block_bytes: tuple[int, ...]  # each repeating layer's weights (blk.N.*)
    input_bytes: int  # token embeddings and other tensors that stay on the host
    output_bytes: int  # the output layer: its norm and its own output matrix, if it has one
    tied_bytes: int  # an output matrix shared with the token embeddings (0: none); offloading copies it
    k_width: tuple[int, ...]  # per layer: K values per token (head_count_kv x key_length)
    v_width: tuple[int, ...]
    n_vocab: int
    n_embd: int
    n_ff: int
    n_head: int
    # Per layer: bytes of the tensors ggml's CPU backend repacks into a second copy when extra
    # buffers are on (batch_invariant = false): Q4_0, Q4_K and IQ4_NL matrices. Empty: none.
    repack_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.block_bytes) == len(self.k_width) == len(self.v_width):
            raise ValueError("block_bytes, k_width and v_width need one entry per layer")
        if self.repack_bytes and len(self.repack_bytes) != len(self.block_bytes):
            raise ValueError("repack_bytes needs one entry per layer")

    @property
    def n_layer(self) -> int:
        return len(self.block_bytes)

    @property
    def weights(self) -> int:
        """The model's weights once, as they sit in host memory with nothing offloaded."""
        return self.input_bytes + sum(self.block_bytes) + self.output_bytes


@dataclass(frozen=True)
class ContextShape:
    """The context the engine creates: slots x context_length cells, batches of batch_tokens."""

    slots: int
    context_length: int  # per slot
    kv_type: str = "q8_0"  # K; V too unless kv_type_v is given
    kv_type_v: str | None = None
    batch_tokens: int = 512
    flash_attn: bool = True
    kv_unified: bool = False  # one KV stream shared by all slots (attention spans all cells)
    repack: bool = False  # the model is loaded with extra buffers (batch_invariant = false)
    kv_tokens: int = 0  # with kv_unified: the cells all slots share; 0: slots x context_length

    def __post_init__(self) -> None:
        for name in (self.kv_type, self.kv_type_v or self.kv_type):
            if name not in KV_BLOCKS:
                raise ValueError(f"unknown KV cache type {name!r} (known: {', '.join(KV_BLOCKS)})")
        if self.slots < 1 or self.context_length < 1 or self.batch_tokens < 1:
            raise ValueError("slots, context_length and batch_tokens must be positive")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model takes with this context. `total` is everything on one machine with no
    offload; `device_bytes(n)` and `host_bytes(n)` split it for n offloaded layers."""

    weights: int  # in host memory with nothing offloaded, repacked copies included
    kv: int
    compute: int
    total: int  # weights + kv + compute + overhead
    overhead: int  # host only: the vocabulary's tables
    per_layer_weights: tuple[int, ...]
    per_layer_kv: tuple[int, ...]
    input_weights: int  # always on the host
    output_weights: int  # the output layer on the host (a tied matrix is the input's)
    output_device_weights: int  # the output layer on a device (a tied matrix is copied there)
    per_layer_repack: tuple[int, ...] = ()  # repacked copies a layer keeps on the host (none offloaded)

    @property
    def n_layer(self) -> int:
        return len(self.per_layer_weights)

    @property
    def max_gpu_layers(self) -> int:
        """n_gpu_layers that offloads everything llama.cpp can: every block and the output layer."""
        return self.n_layer + 1

    def per_layer(self) -> tuple[int, ...]:
        """Each block's weights plus its KV: what offloading it moves."""
        return tuple(w + k for w, k in zip(self.per_layer_weights, self.per_layer_kv))

    def device_bytes(self, gpu_layers: int) -> int:
        """What the device needs with `gpu_layers` offloaded (llama.cpp's n_gpu_layers)."""
        n = _clamp(gpu_layers, self.max_gpu_layers)
        if n == 0:
            return 0
        blocks = min(n, self.n_layer)
        moved = sum(self.per_layer()[self.n_layer - blocks:])
        output = self.output_device_weights if n > self.n_layer else 0
        return moved + output + self.compute

    def host_bytes(self, gpu_layers: int) -> int:
        """What stays in host memory; the compute allowance is counted on both sides (llama.cpp
        keeps a host graph buffer for what it does not offload)."""
        n = _clamp(gpu_layers, self.max_gpu_layers)
        blocks = min(n, self.n_layer)
        kept = sum(self.per_layer()[: self.n_layer - blocks]) + sum(self.per_layer_repack[: self.n_layer - blocks])
        output = 0 if n > self.n_layer else self.output_weights
        return self.input_weights + kept + output + self.compute + self.overhead


def _clamp(gpu_layers: int, most: int) -> int:
    if gpu_layers < 0:
        raise ValueError(f"gpu_layers must be 0 or more, got {gpu_layers}")
    return min(gpu_layers, most)


def kv_cells(slots: int, context_length: int, shared: int = 0) -> int:
    """KV cells llama.cpp allocates: each slot's context rounded up to KV_CELL_PAD, or the `shared`
    pool of a unified cache, rounded the same way."""
    if shared:
        return -(-shared // KV_CELL_PAD) * KV_CELL_PAD
    per_slot = -(-context_length // KV_CELL_PAD) * KV_CELL_PAD
    return slots * per_slot


def context_cells(context: ContextShape) -> int:
    return kv_cells(context.slots, context.context_length, context.kv_tokens if context.kv_unified else 0)


def kv_row_bytes(width: int, kv_type: str) -> int:
    """Bytes of one token's K (or V) in one layer: `width` values stored as `kv_type`."""
    block, size = KV_BLOCKS[kv_type]
    return -(-width // block) * size


def kv_bytes(shape: ModelShape, context: ContextShape) -> tuple[int, ...]:
    """Each layer's KV cache bytes."""
    cells = context_cells(context)
    v_type = context.kv_type_v or context.kv_type
    return tuple(cells * (kv_row_bytes(k, context.kv_type) + kv_row_bytes(v, v_type)) for k, v in zip(shape.k_width, shape.v_width))


def compute_bytes(shape: ModelShape, context: ContextShape) -> int:
    """The allowance for llama.cpp's graph and output buffers (an upper bound: llama.cpp's CPU
    buffers were 89-98% of it on the bundled and Qwen models; docs/performance.md)."""
    tokens = context.batch_tokens
    cells = context_cells(context)
    attended = cells if context.kv_unified else cells // context.slots  # what one token attends over
    logits = shape.n_vocab * tokens * 4
    scores = 0 if context.flash_attn else shape.n_head * attended * tokens * 4
    mask = attended * tokens * 2
    activations = 2 * tokens * (shape.n_embd + shape.n_ff) * 4
    outputs = shape.n_vocab * context.slots * 4  # one row of logits per slot, kept between steps
    return max(logits, scores) + mask + activations + outputs


def estimate_memory(shape: ModelShape, context: ContextShape) -> MemoryEstimate:
    kv = kv_bytes(shape, context)
    compute = compute_bytes(shape, context)
    repack = shape.repack_bytes if context.repack and shape.repack_bytes else (0,) * shape.n_layer
    weights = shape.weights + sum(repack)
    overhead = shape.n_vocab * VOCAB_BYTES_PER_TOKEN
    return MemoryEstimate(
        weights=weights,
        kv=sum(kv),
        compute=compute,
        total=weights + sum(kv) + compute + overhead,
        overhead=overhead,
        per_layer_weights=shape.block_bytes,
        per_layer_kv=kv,
        input_weights=shape.input_bytes,
        output_weights=shape.output_bytes,
        output_device_weights=shape.output_bytes + shape.tied_bytes,
        per_layer_repack=repack,
    )


def layers_that_fit(device_free_bytes: int, estimate: MemoryEstimate, reserve: int = DEFAULT_DEVICE_RESERVE) -> int:
    """The most layers (llama.cpp's n_gpu_layers) whose weights, KV and the compute buffer fit in
    the device's free memory with `reserve` left over; 0 when not even one does."""
    budget = device_free_bytes - reserve
    best = 0
    for n in range(1, estimate.max_gpu_layers + 1):
        if estimate.device_bytes(n) > budget:
            break
        best = n
    return best


@dataclass(frozen=True)
class GpuPlan:
    gpu_layers: int
    reason: str


def plan_gpu_layers(setting: int | str, devices_free: tuple[int, ...], estimate: MemoryEstimate,
                    reserve: int = DEFAULT_DEVICE_RESERVE) -> GpuPlan:
    """`gpu_layers` from the model's setting ("auto" or a number) and the free memory of each
    device llama.cpp can offload to (none on a CPU build). llama.cpp splits layers across several
    devices by their free memory, each with its own compute buffer and reserve: they are pooled
    as one device less the extra buffers."""
    if not devices_free:
        return GpuPlan(0, "no GPU this llama.cpp build can use")
    if setting == "auto":
        pooled = sum(devices_free) - (len(devices_free) - 1) * (estimate.compute + reserve)
        n = layers_that_fit(pooled, estimate, reserve)
        return GpuPlan(n, f"auto: {n} of {estimate.max_gpu_layers} layers fit {sum(devices_free) >> 20} MiB free "
                          f"(they need {estimate.device_bytes(n) >> 20} MiB; {reserve >> 20} MiB kept free per device)")
    if not isinstance(setting, int) or isinstance(setting, bool) or setting < 0:
        raise ValueError(f"gpu_layers: expected \"auto\" or a whole number >= 0, got {setting!r}")
    n = min(setting, estimate.max_gpu_layers)
    return GpuPlan(n, f"configured: {n} of {estimate.max_gpu_layers} layers")
