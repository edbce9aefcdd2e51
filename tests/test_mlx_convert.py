"""One file, two engines: the bundled GGUF converted to an MLX folder that mlx-lm loads, with a
tokenizer rebuilt from the GGUF that splits text exactly like llama.cpp, and answers that agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.model_files import package_file
from tests.conftest import MODEL_FILE, ROOT

mlx_lm = pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")

SAMPLES = [
    "Hello, world! How are you today?",
    "naïve café, Straße, 東京タワー, русский текст, emoji 🚀🙂 and math ∑x²",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x >= 10: pass",
    "   leading spaces,\n\n\ntrailing tabs\t\t and   runs     of   spaces   ",
    "Numbers 1234567890, 3.14159, -42 and 2024-12-02",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's we're they've I'm you'll he'd",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mlx") / "smollm2-mlx"
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "convert", str(package_file(MODEL_FILE)), "--to", "mlx",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "4-bit, group 32" in run.stdout and "8-bit, group 32" in run.stdout  # Q4_1 layers and the Q8_0 embedding stay packed
    return out


def test_the_folder_is_what_mlx_lm_expects(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4 and config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert (converted / "model.safetensors").stat().st_size < 120e6  # packed, not dequantized
    assert "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())


def test_the_tokenizer_splits_text_exactly_like_llama_cpp(converted: Path) -> None:
    from transformers import AutoTokenizer

    from engines.llamacpp.runtime import Model

    hf = AutoTokenizer.from_pretrained(str(converted))
    llama = Model(package_file(MODEL_FILE))
    try:
        for text in SAMPLES:
            assert hf.encode(text, add_special_tokens=False) == llama.tokenize(text, add_special=False, parse_special=True), text
    finally:
        llama.close()


def test_mlx_answers_like_llama_cpp(converted: Path) -> None:
    """The two engines compute nearly the same next-token logits (their arithmetic differs:
    llama.cpp quantizes activations for its dot products, MLX does not), so near-ties aside they
    answer alike: here both answer the chat question with Paris."""
    import mlx.core as mx
    import numpy as np

    from engines.llamacpp.runtime import Context, ContextShape, Model

    model, tokenizer = mlx_lm.load(str(converted))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False)
    assert "Paris" in mlx_lm.generate(model, tokenizer, prompt, max_tokens=12, verbose=False)
    llama = Model(package_file(MODEL_FILE))
    try:
        for text in (prompt, "The capital of France is", "def add(a, b):\n    return"):
            tokens = llama.tokenize(text, add_special=False, parse_special=True)
            assert tokens == tokenizer.encode(text, add_special_tokens=False)
            ctx = Context(llama, ContextShape(1, 256, 64, 2, False, True, "q8_0"))
            ctx.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
            ours = ctx.logits(len(tokens) - 1).astype(np.float64)
            ctx.close()
            theirs = np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32), dtype=np.float64)
            cosine = ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs)
            assert cosine > 0.99, (text, cosine)
            assert set(np.argsort(-ours)[:5]) & set(np.argsort(-theirs)[:5])  # the likely next tokens overlap
    finally:
        llama.close()


def test_what_cannot_convert_says_so(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 100)
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "convert", str(junk), "--to", "mlx", "--out", str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "not a GGUF model file" in run.stderr and "\n" not in run.stderr.strip()
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "convert", str(tmp_path / "missing.gguf"), "--to", "mlx"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "MLX cannot read this GGUF" in run.stderr
