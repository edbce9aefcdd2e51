"""How a GGUF lays out a Hugging Face llama-family model's weights: one copy of the facts that the
MLX converter (GGUF to MLX) and the LoRA writer (PyTorch to GGUF and MLX) both need.

- names: `blk.N.attn_q` is `model.layers.N.self_attn.q_proj`, and so on;
- llama.cpp's converter permutes the rows of Q and K of "llama" models for its rope layout (Qwen
  models are written as they are); Hugging Face and mlx-lm use the original order.
"""

from __future__ import annotations

from typing import Any

# A block's GGUF tensor stem -> its module under `model.layers.N.`
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_NAMES = {hf: stem for stem, hf in BLOCK_NAMES.items()}
# The projections a LoRA adapter may touch (nn.Linear in every llama-family block).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Architectures whose Q and K rows llama.cpp's converter permutes.
ROPE_PERMUTED = frozenset({"llama"})


def gguf_stem(module: str) -> str | None:
    """`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q`; None for a module outside the blocks."""
    parts = module.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    stem = _GGUF_NAMES.get(".".join(parts[3:]))
    return None if stem is None else f"blk.{parts[2]}.{stem}"


def rope_permute(x: Any, heads: int) -> Any:
    """Rows in Hugging Face order -> llama.cpp's (also right for the rows of a LoRA B matrix: each
    row is one output)."""
    rows = x.shape[0]
    return x.reshape(heads, 2, rows // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def rope_unpermute(x: Any, heads: int) -> Any:
    """The inverse of rope_permute (also right for packed rows: it moves whole rows, and
    quantization groups run along them)."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
