"""Small real GGUF files that tests write themselves with the `gguf` package."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf


def rewrite_gguf(src: Path, dst: Path, edit: Callable[[str, Any], Any]) -> Path:
    """Copies a GGUF file, passing every metadata value through `edit(key, value)`."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, edit(field.name, field.contents()), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def tiny_llama(src: Path, dst: Path, *, width: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A llama of random float32 weights, `width` wide, with `src`'s vocabulary and chat template:
    a real model every engine and trainer loads, small enough that MLX's CPU build trains it in
    seconds (it takes about a minute a step on the bundled model here; docs/performance/distillation.md)."""
    import numpy as np

    reader = gguf.GGUFReader(src)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    sizes = {"llama.block_count": layers, "llama.embedding_length": width, "llama.feed_forward_length": 2 * width,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
             "llama.rope.dimension_count": width // heads, "general.file_type": 0}
    writer = gguf.GGUFWriter(dst, "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name == "general.quantization_version":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, sizes.get(field.name, field.contents()), value_type, sub_type=sub_type)
    rng = np.random.default_rng(seed)
    kv = width // heads * kv_heads

    def weight(rows: int, cols: int) -> Any:
        return rng.normal(0, 1 / np.sqrt(cols), (rows, cols)).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (kv, width)), ("attn_v", (kv, width)), ("attn_output", (width, width)),
                            ("ffn_gate", (2 * width, width)), ("ffn_up", (2 * width, width)), ("ffn_down", (width, 2 * width))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(width, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(width, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
