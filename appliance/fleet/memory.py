"""A model file's memory: its shape read from the GGUF header, and the estimate and GPU plan made
from it (policy/memory_plan.py holds the arithmetic).

`estimate(model_file, slots, context_length, kv_type)` is the one entry point for anything that
budgets memory (the GPU layer plan here, a model loader's memory budget). MLX folders and ONNX files
are estimated at the end (`mlx_estimate`, `onnx_memory`), from their config and file sizes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config.settings import ModelSettings
from engines.llamacpp.gguf_header import GgufError, GgufHeader, read_header
from policy.memory_plan import ContextShape, GpuPlan, MemoryEstimate, ModelShape, estimate_memory, plan_gpu_layers

if TYPE_CHECKING:
    from engines.llamacpp.devices import Device

log = logging.getLogger("appliance.memory")

# ggml type ids of the matrices ggml's CPU backend repacks (Q4_0, Q4_K, IQ4_NL), measured on
# llama-cpp-python 0.3.36 with AVX2: Qwen2.5's Q4_K block matrices gain a copy, its Q5_0, Q6_K and
# Q8_0 ones do not.
REPACKED_TYPES = frozenset({2, 12, 20})


class ModelShapeError(ValueError):
    """The file is not a GGUF model whose shape we can read; the message says what is missing."""


def _scalar_or_list(value: Any) -> Any:
    return value if not isinstance(value, list) or len(value) != 1 else value[0]


def _per_layer(value: Any, n_layer: int, name: str) -> tuple[int, ...]:
    """A hyperparameter GGUF stores once or once per layer (head_count_kv of hybrid models)."""
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelShapeError(f"{name} lists {len(value)} values for {n_layer} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def shape_from_gguf(header: GgufHeader) -> ModelShape:
    """A ModelShape from a GGUF file's metadata and tensor table."""
    metadata = header.metadata
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelShapeError("no general.architecture in the GGUF metadata")

    def need(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ModelShapeError(f"no {arch}.{key} in the GGUF metadata")
        return _scalar_or_list(value)

    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    heads = _per_layer(need("attention.head_count"), n_layer, "attention.head_count")
    kv_heads = _per_layer(_scalar_or_list(metadata.get(f"{arch}.attention.head_count_kv", list(heads))), n_layer, "attention.head_count_kv")
    n_head = max(heads)
    key_length = int(_scalar_or_list(metadata.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1))))
    value_length = int(_scalar_or_list(metadata.get(f"{arch}.attention.value_length", key_length)))
    ff = _scalar_or_list(metadata.get(f"{arch}.feed_forward_length", 0))
    n_ff = max(ff) if isinstance(ff, list) else int(ff)
    n_vocab = int(metadata.get(f"{arch}.vocab_size", header.array_lengths.get("tokenizer.ggml.tokens", 0)))

    blocks = [0] * n_layer
    repack = [0] * n_layer
    input_bytes = output_bytes = 0
    names = {name: size for name, size, _ in header.tensors}
    if "token_embd.weight" not in names:
        raise ModelShapeError("no token_embd.weight tensor")
    for name, size, kind in header.tensors:
        if name.startswith("blk."):
            index = int(name.split(".", 2)[1])
            if index >= n_layer:
                raise ModelShapeError(f"tensor {name} is past block_count ({n_layer})")
            blocks[index] += size
            if kind in REPACKED_TYPES and name.endswith(".weight") and "norm" not in name:
                repack[index] += size
        elif name.startswith(("output.", "output_norm.")):
            output_bytes += size
        else:
            input_bytes += size
    return ModelShape(
        block_bytes=tuple(blocks),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        tied_bytes=0 if "output.weight" in names else names["token_embd.weight"],
        k_width=tuple(h * key_length for h in kv_heads),
        v_width=tuple(h * value_length for h in kv_heads),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        repack_bytes=tuple(repack),
    )


@functools.lru_cache(maxsize=32)
def _read_shape(path: str, size: int, mtime_ns: int) -> ModelShape:
    try:
        header = read_header(Path(path))
    except GgufError as exc:
        raise ModelShapeError(str(exc)) from None
    return shape_from_gguf(header)


def read_shape(model_file: Path) -> ModelShape:
    """The shape of a GGUF model, read from its header (the weights are not read)."""
    stat = Path(model_file).stat()
    return _read_shape(str(Path(model_file).resolve()), stat.st_size, stat.st_mtime_ns)


def estimate(model_file: Path, slots: int, context_length: int, kv_type: str = "q8_0", *, kv_type_v: str | None = None,
             batch_tokens: int = 512, flash_attn: bool = True, kv_unified: bool = False, repack: bool = False,
             kv_tokens: int = 0) -> MemoryEstimate:
    """Bytes the model takes when the engine serves `slots` x `context_length` tokens (`repack`:
    loaded with extra buffers, as batch_invariant = false loads it; `kv_tokens`: a unified cache's
    shared pool, when smaller than that)."""
    context = ContextShape(slots, context_length, kv_type, kv_type_v, batch_tokens, flash_attn, kv_unified, repack, kv_tokens)
    return estimate_memory(read_shape(model_file), context)


def model_estimate(model: ModelSettings, model_file: Path) -> MemoryEstimate:
    """The estimate for a configured llama.cpp model, in the context layout its engine makes."""
    from engines.llamacpp.engine import context_layout

    pooled = model.kv_tokens is not None and model.kv_tokens < model.slots * model.context_length
    kv_unified, flash_attn = context_layout(model.batch_invariant, model.kv_cache_type, pooled)
    return estimate(model_file, model.slots, model.context_length, model.kv_cache_type, kv_type_v=model.kv_cache_type_v,
                    batch_tokens=model.batch_tokens, flash_attn=flash_attn, kv_unified=kv_unified, repack=not model.batch_invariant,
                    kv_tokens=model.kv_tokens or 0)


def gpu_plan(model: ModelSettings, model_file: Path, gpus: tuple[Device, ...]) -> GpuPlan:
    """The model's n_gpu_layers given the GPUs this llama.cpp build can use (none: 0)."""
    if model.gpu_layers == 0:
        return GpuPlan(0, "configured: all on the CPU")
    if not gpus:
        return GpuPlan(0, "no GPU this llama.cpp build can use")
    try:
        memory = model_estimate(model, model_file)
    except ModelShapeError as exc:
        if model.gpu_layers == "auto":
            return GpuPlan(0, f"its size cannot be estimated ({exc}); set gpu_layers to a number to offload")
        return GpuPlan(int(model.gpu_layers), f"configured (its size cannot be estimated: {exc})")
    return plan_gpu_layers(model.gpu_layers, tuple(d.free for d in gpus), memory)


def gpu_layers_for(model: ModelSettings, model_file: Path) -> int:
    """What the engine passes to llama.cpp as n_gpu_layers, with the free memory as of now."""
    from engines.llamacpp.devices import gpu_devices

    plan = gpu_plan(model, model_file, gpu_devices() if model.gpu_layers != 0 else ())
    log.info("%s: gpu_layers = %d (%s)", model.alias, plan.gpu_layers, plan.reason)
    return plan.gpu_layers


# ---- MLX folders and ONNX files ------------------------------------------------------------------
# Simpler arithmetic than a GGUF's: neither engine offloads layers, so one total is all the budget needs.

MLX_KV_STEP = 256  # mlx-lm's KV caches grow in steps of this many tokens per sequence
MLX_PREFILL_STEP = 2048  # tokens of each prompt mlx-lm's BatchGenerator prefills at once (its default)
MLX_VOCAB_BYTES_PER_TOKEN = 512  # the transformers tokenizer and the engine's byte pieces: 22 MiB for SmolLM2's 49k tokens
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class FolderEstimate:
    weights: int
    kv: int
    compute: int  # activations, and copies of the KV
    overhead: int = 0  # MLX: the tokenizer; ONNX: the session's own buffers

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead


@dataclass(frozen=True)
class MlxShape:
    weight_bytes: int  # the safetensors files' sizes: MLX holds every tensor as stored
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    kv_heads: int
    head_dim: int
    n_vocab: int
    dtype_bytes: int  # of the activations, and so of the KV cache


def activation_bytes(float_dtypes: Collection[str]) -> int:
    """Bytes per value of an MLX model's activations: its float tensors' widest type, since MLX
    promotes a product of two types to the wider (a float32 norm weight makes float32 hidden states:
    the converted SmolLM2, float16 scales and float32 norms, keeps a float32 KV cache), and float16
    with bfloat16 to float32."""
    widths = {_FLOAT_BYTES[d] for d in float_dtypes if d in _FLOAT_BYTES}
    if not widths:
        return 4
    return max(4, *widths) if {"F16", "BF16"} <= set(float_dtypes) else max(widths)


def mlx_shape(config: Mapping[str, Any], float_dtypes: Collection[str], weight_bytes: int) -> MlxShape:
    """An MLX model's shape from its config.json (a multimodal one's text_config) and its tensors' types."""
    text = config if "num_hidden_layers" in config else config.get("text_config", config)
    try:
        n_layer, heads, hidden = int(text["num_hidden_layers"]), int(text["num_attention_heads"]), int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        n_ff = int(text.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelShapeError(f"config.json has no usable {exc}") from None
    return MlxShape(weight_bytes, n_layer, hidden, n_ff, heads, int(text.get("num_key_value_heads") or heads), head_dim,
                    int(text.get("vocab_size") or 0), activation_bytes(float_dtypes))


def mlx_memory(shape: MlxShape, slots: int, context_length: int) -> FolderEstimate:
    """What the MLX engine holds serving `slots` x `context_length` (checked against the resident
    memory it gains in tests/test_mlx_engine.py):

    - weights as stored;
    - a K and a V per layer for every slot at its full context, in steps of MLX_KV_STEP;
    - a copy of that KV: mlx-lm concatenates a batch's KV when requests join it and copies each
      finished request's out (for the prompt cache);
    - one prefill step's activations, every slot's prompt at once as the engine prefills them:
      attention scores and their softmax against the whole context (MLX's CPU path makes them
      whole; Metal's fused attention needs less), the MLP's and the hidden states' buffers;
    - the tokenizer.

    Not counted: the freed buffers MLX keeps for reuse, the host prompt cache (prefix_cache_host_mb,
    as for a GGUF), and the prompt's logits, which mlx-lm never computes."""
    cells = -(-context_length // MLX_KV_STEP) * MLX_KV_STEP
    kv = 2 * shape.n_layer * shape.kv_heads * shape.head_dim * shape.dtype_bytes * slots * cells
    step = slots * min(MLX_PREFILL_STEP, context_length)  # tokens in one prefill step
    activations = (2 * shape.n_head * step * cells + step * (3 * shape.n_ff + 4 * shape.n_embd)) * shape.dtype_bytes
    return FolderEstimate(shape.weight_bytes, kv, kv + activations, shape.n_vocab * MLX_VOCAB_BYTES_PER_TOKEN)


def read_mlx_shape(folder: Path) -> MlxShape:
    """Reads config.json and the safetensors headers (not the weights)."""
    import json

    from safetensors import safe_open

    files = sorted(folder.glob("model*.safetensors"))  # the files mlx-lm loads
    if not files:
        raise ModelShapeError(f"no model*.safetensors in {folder}")
    dtypes: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="numpy") as tensors:
            dtypes |= {tensors.get_slice(name).get_dtype() for name in tensors.keys()}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelShapeError(f"{folder}/config.json: {exc}") from None
    return mlx_shape(config, dtypes, sum(f.stat().st_size for f in files))


def mlx_estimate(folder: Path, slots: int, context_length: int) -> FolderEstimate:
    return mlx_memory(read_mlx_shape(folder), slots, context_length)


# onnxruntime folds a weight stored in 8 bits and cast to float at run time into a float32 constant
# when it makes the session: the shipped int8 MiniLM's 21.9 MiB file became about 95 MiB resident.
# A float32 file loads at its size, so for one this counts up to 4x too much: the safe side.
ONNX_WIDENING = 4
# The session's own buffers beyond the widened weights. Measured (RSS before and after making the
# session, onnxruntime 1.32, the 21.9 MiB int8 MiniLM): +102 MiB for a second session in a process,
# 87.6 MiB of it the widened file; a process's first session took +155 MiB, about 53 MiB of it
# onnxruntime's own first use, paid once a process and so not counted per model.
ONNX_SESSION_BYTES = 16 << 20
# One padded token's activations in a forward pass, measured on all-MiniLM-L6-v2 (6 layers, 384
# wide, 12 heads) through onnxruntime's arena: about 28 KiB for its hidden states, plus 226 bytes
# per token of the widest input for its attention scores; rounded up. A wider model takes more.
# The arena keeps a pass's memory: after one pass of 16 x 512 tokens (the defaults' widest, 8192
# padded tokens) the process above held +1,424 MiB; a pass of 4 x 512 (2048 tokens) +452 MiB.
ONNX_TOKEN_BYTES = 32 << 10
ONNX_SCORE_BYTES = 256


def onnx_memory(file_bytes: int, batch_tokens: int, context_length: int) -> FolderEstimate:
    """An ONNX embedding model's session (its weights widened to float32, and the session's own
    buffers) with one forward pass of `batch_tokens` padded tokens in flight. The engine runs one
    pass at a time (one slot), so one pass is all it ever holds."""
    width = min(batch_tokens, context_length)  # the longest input one pass may hold
    return FolderEstimate(ONNX_WIDENING * file_bytes, 0, batch_tokens * (ONNX_TOKEN_BYTES + ONNX_SCORE_BYTES * width),
                          ONNX_SESSION_BYTES)
