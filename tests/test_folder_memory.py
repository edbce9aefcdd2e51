"""The memory estimates of MLX folders and ONNX files (appliance/fleet/memory.py): the arithmetic
without IO, then the MLX estimate against the resident memory the engine gains on the bundled
model converted to MLX (tests/mlx_memory_probe.py, in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.fleet.memory import (
    MLX_KV_STEP,
    MLX_VOCAB_BYTES_PER_TOKEN,
    ONNX_WIDENING,
    ModelShapeError,
    activation_bytes,
    mlx_memory,
    mlx_shape,
    onnx_memory,
    read_mlx_shape,
)
from tests.conftest import MODEL_FILE, ROOT

MiB = 2**20
SMOL_CONFIG = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}


@pytest.mark.parametrize(("dtypes", "width"), [
    ({"U32", "F16", "F32"}, 4),  # the converted SmolLM2: float32 norms promote its activations
    ({"U32", "BF16"}, 2),  # an mlx-community 4-bit model: bfloat16 scales and norms
    ({"F16"}, 2),
    ({"F16", "BF16"}, 4),  # MLX promotes the pair to float32
    ({"U32"}, 4),
])
def test_activation_width_is_the_widest_float_type(dtypes: set[str], width: int) -> None:
    assert activation_bytes(dtypes) == width


def test_mlx_shape_from_config() -> None:
    shape = mlx_shape(SMOL_CONFIG, {"U32", "F16", "F32"}, 98_421_384)
    assert (shape.n_layer, shape.kv_heads, shape.head_dim, shape.n_head, shape.n_vocab, shape.dtype_bytes) == (30, 3, 64, 9, 49152, 4)
    explicit = mlx_shape(SMOL_CONFIG | {"head_dim": 128}, {"BF16"}, 1)
    assert explicit.head_dim == 128 and explicit.dtype_bytes == 2
    nested = mlx_shape({"model_type": "vlm", "text_config": SMOL_CONFIG}, {"BF16"}, 1)  # a multimodal model's language half
    assert nested.n_layer == 30
    no_kv = {k: v for k, v in SMOL_CONFIG.items() if k != "num_key_value_heads"}
    assert mlx_shape(no_kv, {"BF16"}, 1).kv_heads == 9  # no grouped-query attention: a KV head per head
    with pytest.raises(ModelShapeError, match="num_hidden_layers"):
        mlx_shape({"hidden_size": 8}, {"F16"}, 1)


def test_mlx_kv_counts_every_slot_at_its_context_in_mlx_steps() -> None:
    shape = mlx_shape(SMOL_CONFIG, {"F32"}, 100 * MiB)
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, layers, KV heads, head_dim, float32
    e = mlx_memory(shape, 4, 1000)
    assert e.weights == 100 * MiB
    assert e.kv == per_token * 4 * 1024  # 1000 tokens take four steps of 256
    assert e.overhead == 49152 * MLX_VOCAB_BYTES_PER_TOKEN
    assert e.total == e.weights + e.kv + e.compute + e.overhead
    assert mlx_memory(shape, 4, 1024).kv == e.kv and mlx_memory(shape, 4, 1025).kv == per_token * 4 * (1024 + MLX_KV_STEP)
    assert mlx_memory(shape, 8, 1024).kv == 2 * e.kv  # twice the slots, twice the KV
    assert e.compute > e.kv  # a copy of the KV plus a prefill step's activations
    half = mlx_memory(mlx_shape(SMOL_CONFIG, {"BF16"}, 100 * MiB), 4, 1000)
    assert half.kv * 2 == e.kv and half.compute * 2 == e.compute


def test_onnx_estimate_is_the_widened_file_and_one_pass() -> None:
    e = onnx_memory(22 * MiB, batch_tokens=512, context_length=512)
    assert e.weights == ONNX_WIDENING * 22 * MiB and e.kv == 0
    # The int8 MiniLM measured 95-100 MiB for its session and 73 MiB for a pass of 512 x 512 tokens.
    assert 73 * MiB <= e.compute <= 100 * MiB
    assert onnx_memory(22 * MiB, 2048, 512).compute == 4 * e.compute  # four times the tokens in a pass
    assert onnx_memory(22 * MiB, 512, 128).compute < e.compute  # no input is wider than its context


def test_an_mlx_folder_without_weights_cannot_be_estimated(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOL_CONFIG))
    with pytest.raises(ModelShapeError, match="safetensors"):
        read_mlx_shape(tmp_path)


def test_mlx_estimate_against_resident_memory(tmp_path: Path) -> None:
    """The engine loads the converted bundled model and fills one slot of 64 tokens (MLX's CPU
    prefill runs at about 8 tokens a second here, so docs/performance/models.md lists the fuller runs):
    the process's peak resident memory gained lies within a fifth of the estimate."""
    pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")
    from appliance.fleet.files import package_file
    from engines.mlx.convert import gguf_to_mlx

    folder = tmp_path / "smol"
    gguf_to_mlx(package_file(MODEL_FILE), folder)
    shape = read_mlx_shape(folder)
    assert shape.weight_bytes == (folder / "model.safetensors").stat().st_size and shape.dtype_bytes == 4
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "mlx_memory_probe.py"), str(folder), "1", "64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({k: round(v / MiB, 1) if k not in ("slots", "context_length") else v for k, v in measured.items()}))
    assert measured["rss_load"] >= measured["weights"]  # the weights are resident once loaded
    assert 0.8 * measured["total"] <= measured["peak"] <= 1.2 * measured["total"]
