"""LoRA adapter files for both engines, from one set of low-rank pairs: a GGUF adapter that
llama.cpp's adapter loader reads, and an mlx-lm adapter folder.

The pairs are as PyTorch's peft holds them, in Hugging Face's row order: A is (rank, in), B is
(out, rank), and the update is W + (alpha / rank) * B @ A.

- GGUF: `blk.N.attn_q.weight.lora_a` and `.lora_b`, with general.type "adapter", adapter.type
  "lora" and adapter.lora.alpha (llama.cpp scales by alpha / rank, the rank read from lora_a). A
  numpy array's (rows, cols) is ggml's (ne1, ne0), so A and B are written as they are; only the
  rows of B for Q and K are put into llama.cpp's rope order (engines/llama_layout.py).
- MLX: `adapters.safetensors` with `<module>.lora_a` of shape (in, rank) and `.lora_b` of
  (rank, out), the transposes, in Hugging Face order (the MLX model is too); `adapter_config.json`
  names the scale itself (alpha / rank), the layers and the modules, as mlx-lm's loader needs.

Imported by training and by tests only (it needs the `gguf` package); serving never imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.llama_layout import ROPE_PERMUTED, gguf_stem, rope_permute

MLX_WEIGHTS = "adapters.safetensors"
MLX_CONFIG = "adapter_config.json"


class LoraFileError(ValueError):
    pass


@dataclass(frozen=True)
class LoraPair:
    a: np.ndarray  # (rank, in)
    b: np.ndarray  # (out, rank)


@dataclass(frozen=True)
class LoraAdapter:
    pairs: Mapping[str, LoraPair]  # Hugging Face module path (model.layers.N.self_attn.q_proj) -> pair
    alpha: float

    @property
    def rank(self) -> int:
        ranks = {p.a.shape[0] for p in self.pairs.values()} | {p.b.shape[1] for p in self.pairs.values()}
        if len(ranks) != 1:
            raise LoraFileError(f"the pairs have ranks {sorted(ranks)}; one adapter has one rank")
        return ranks.pop()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class BaseShape:
    """What of the base model the files depend on."""

    arch: str  # general.architecture of the base GGUF: the adapter must name the same
    heads: int
    kv_heads: int
    layers: int


def write_gguf(adapter: LoraAdapter, path: Path, base: BaseShape) -> Path:
    import gguf

    rank = adapter.rank
    writer = gguf.GGUFWriter(path, base.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(adapter.alpha))
    for module, pair in sorted(adapter.pairs.items()):
        stem = gguf_stem(module)
        if stem is None:
            raise LoraFileError(f"{module}: not a projection inside a model block; llama.cpp has no tensor for it")
        b = pair.b
        if base.arch in ROPE_PERMUTED and stem.endswith((".attn_q", ".attn_k")):
            b = rope_permute(b, base.heads if stem.endswith(".attn_q") else base.kv_heads)
        if pair.a.shape[0] != rank:
            raise LoraFileError(f"{module}: lora_a has rank {pair.a.shape[0]}, not {rank}")
        writer.add_tensor(f"{stem}.weight.lora_a", np.ascontiguousarray(pair.a, dtype=np.float32))
        writer.add_tensor(f"{stem}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_mlx(adapter: LoraAdapter, folder: Path, base: BaseShape) -> Path:
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    keys: set[str] = set()
    for module, pair in adapter.pairs.items():
        if gguf_stem(module) is None:
            raise LoraFileError(f"{module}: not a projection inside a model block")
        tensors[f"{module}.lora_a"] = np.ascontiguousarray(pair.a.T, dtype=np.float32)
        tensors[f"{module}.lora_b"] = np.ascontiguousarray(pair.b.T, dtype=np.float32)
        keys.add(module.split(".", 3)[3])  # self_attn.q_proj: mlx-lm matches these inside each block
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / MLX_WEIGHTS), metadata={"format": "mlx"})
    config = {
        "fine_tune_type": "lora",
        "num_layers": base.layers,  # mlx-lm wraps the last num_layers blocks: all of them
        "lora_parameters": {"rank": adapter.rank, "scale": adapter.scale, "dropout": 0.0, "keys": sorted(keys)},
    }
    (folder / MLX_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder
