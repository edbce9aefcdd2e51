"""One model file, two engines: a llama-architecture GGUF as an MLX model folder mlx-lm loads.

`mlx.core.load` reads the GGUF: Q4_0, Q4_1 and Q8_0 tensors come back packed (weights, scales,
biases) and are kept packed; other quantized types come back as float16; a type MLX cannot read
fails the load, and the conversion says so. What else GGUF changes is undone here:

- names (`blk.N.attn_q` → `model.layers.N.self_attn.q_proj`, ...);
- llama.cpp's converter permutes the rows of Q and K for its rope layout; mlx-lm's llama uses the
  original order, so the rows are put back (left permuted, the model emits end-of-turn at once);
- no output matrix means tied embeddings;
- the tokenizer is rebuilt from the GGUF's own vocabulary and merges (no hub download), with the
  pre-tokenizer the GGUF names (`smollm`: digits one by one, then GPT-2's byte-level split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.llama_layout import BLOCK_NAMES, rope_unpermute

# Pre-tokenizers we can rebuild, by the name GGUF gives them.
_PRE_TOKENIZERS = {"smollm", "gpt2", "default"}


class ConversionError(Exception):
    """One line saying what in the source cannot be converted."""


@dataclass
class ConversionReport:
    packed: dict[str, int] = field(default_factory=dict)  # "4-bit, group 32": tensors
    float16: list[str] = field(default_factory=list)
    unquantized: int = 0


def _value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    return value


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem == "token_embd":
        return f"model.embed_tokens.{kind}"
    if stem == "output_norm":
        return f"model.norm.{kind}"
    if stem == "output":
        return f"lm_head.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{kind}"
    raise ConversionError(f"tensor {gguf_name} has no counterpart in mlx-lm's llama model")


def gguf_to_mlx(src: Path, dst: Path) -> ConversionReport:
    import mlx.core as mx

    try:
        weights, meta = mx.load(str(src), return_metadata=True)
    except Exception as exc:  # MLX names the tensor type it cannot read
        raise ConversionError(f"{src}: MLX cannot read this GGUF ({exc})") from None
    if not weights:
        raise ConversionError(f"{src}: no tensors: not a GGUF model file")
    arch = _value(meta, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{src}: architecture {arch!r}; only llama-architecture GGUFs convert to MLX so far")
    pre = _value(meta, "tokenizer.ggml.pre", "default")
    if _value(meta, "tokenizer.ggml.model") != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ConversionError(f"{src}: tokenizer {_value(meta, 'tokenizer.ggml.model')!r} with pre-tokenizer {pre!r} cannot be rebuilt yet")
    a = "llama."
    hidden = int(_value(meta, a + "embedding_length"))
    heads, kv_heads = int(_value(meta, a + "attention.head_count")), int(_value(meta, a + "attention.head_count_kv", 0) or _value(meta, a + "attention.head_count"))
    report = ConversionReport()
    out: dict[str, Any] = {}
    quantization: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        target = _hf_name(name)
        layer = target.rsplit(".", 1)[0]
        scales, biases = weights.get(name[: -len("weight")] + "scales"), weights.get(name[: -len("weight")] + "biases")
        arrays = {"weight": tensor}
        if scales is not None:
            arrays |= {"scales": scales, "biases": biases}
            # packed uint32 columns x 32 bits = in_features x bits; groups = in_features / group size
            in_features = _in_features(name, hidden, int(_value(meta, a + "feed_forward_length")))
            bits = tensor.shape[1] * 32 // in_features
            group = in_features // scales.shape[1]
            quantization[layer] = {"group_size": group, "bits": bits}
            key = f"{bits}-bit, group {group}"
            report.packed[key] = report.packed.get(key, 0) + 1
        elif tensor.dtype == mx.float16 and tensor.ndim == 2:
            report.float16.append(name)
        else:
            report.unquantized += 1
        for kind, array in arrays.items():
            if ".attn_q." in name:
                array = rope_unpermute(array, heads)
            elif ".attn_k." in name:
                array = rope_unpermute(array, kv_heads)
            out[f"{layer}.{kind}"] = array
    tied = "output.weight" not in weights
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": int(_value(meta, a + "block_count")),
        "intermediate_size": int(_value(meta, a + "feed_forward_length")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": float(_value(meta, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_value(meta, a + "rope.freq_base", 10000.0)),
        "vocab_size": int(_value(meta, a + "vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(_value(meta, a + "context_length", 2048)),
        "tie_word_embeddings": tied,
        "bos_token_id": _value(meta, "tokenizer.ggml.bos_token_id"), "eos_token_id": _value(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantization:
        # mlx-lm reads per-layer settings by path; the most common one is the default.
        common = max(({json.dumps(q, sort_keys=True) for q in quantization.values()}),
                     key=lambda q: sum(json.dumps(v, sort_keys=True) == q for v in quantization.values()))
        config["quantization"] = json.loads(common) | {
            layer: q for layer, q in quantization.items() if json.dumps(q, sort_keys=True) != common}
        for layer in {name.rsplit(".", 1)[0] for name in out} - set(quantization):
            if layer.endswith("_proj") or layer.endswith("embed_tokens"):
                config["quantization"][layer] = False  # left in float: not quantized by mlx-lm either
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(meta, pre, dst)
    write_source(dst, src)
    return report


SOURCE_FILE = "appliance-source.json"


def write_source(folder: Path, gguf: Path) -> None:
    """Which GGUF a folder came from: its vocabulary is the same token for token, and the MLX
    engine runs llama.cpp's grammars and samplers on it."""
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}, indent=2))


def source_of(folder: Path) -> Path | None:
    try:
        path = Path(json.loads((folder / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def _in_features(name: str, hidden: int, ffn: int) -> int:
    return ffn if ".ffn_down." in name else hidden


def _write_tokenizer(meta: dict[str, Any], pre: str, dst: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()] if "tokenizer.ggml.token_type" in meta else [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if pre == "smollm" else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == 3]  # llama.cpp's CONTROL tokens
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.save(str(dst / "tokenizer.json"))
    bos, eos = _value(meta, "tokenizer.ggml.bos_token_id"), _value(meta, "tokenizer.ggml.eos_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None, "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False, "model_max_length": int(_value(meta, "llama.context_length", 2048)),
    }
    template = _value(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
