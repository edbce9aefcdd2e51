"""One file, two engines: the bundled GGUF converted to an MLX folder that mlx-lm loads, with a
tokenizer rebuilt from the GGUF that splits text exactly like llama.cpp, and answers that agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.fleet.files import package_file
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
    run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "convert", str(package_file(MODEL_FILE)), "--to", "mlx",
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


CROSS_ENGINE_PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about autumn leaves."),
    ("chat", "Explain in one sentence why the sky is blue."),
    ("chat", "Translate 'good morning' into Spanish."),
    ("chat", "List three prime numbers."),
    ("raw", "The capital of France is"),
    ("raw", "def add(a, b):\n    return"),
    ("raw", "1, 2, 3, 4, 5,"),
    ("raw", "Once upon a time, in a small village by the sea,"),
    ("raw", "naïve café, Straße, 東京 and"),
]


def test_both_engines_compute_the_same_logits_and_mostly_the_same_greedy_text(converted: Path) -> None:
    """On the same weights: the first-step logits correlate (r >= 0.99) and agree on the top token
    wherever llama.cpp's top two are more than one logit apart (llama.cpp rounds activations to 8
    bits in its quantized dot products, so near-ties may flip). How many of the first 32 greedy
    tokens agree is printed and recorded in docs/performance/models.md."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from engines.llamacpp.runtime import Context, ContextParams, Model

    model, tokenizer = mlx_lm.load(str(converted))
    llama = Model(package_file(MODEL_FILE))
    agreement = []
    try:
        for kind, text in CROSS_ENGINE_PROMPTS:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False) \
                if kind == "chat" else text
            tokens = llama.tokenize(prompt, add_special=False, parse_special=True)
            assert tokens == tokenizer.encode(prompt, add_special_tokens=False)
            ctx = Context(llama, ContextParams(1, 256, 64, 2, False, True, "q8_0"))
            try:
                ctx.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
                ours = ctx.logits(len(tokens) - 1).astype(np.float64).copy()
                greedy_llama = []
                for step in range(32):
                    nxt = int(np.argmax(ctx.logits(len(tokens) - 1 if step == 0 else 0)))
                    greedy_llama.append(nxt)
                    ctx.decode([(nxt, len(tokens) + step, 0, True)])
            finally:
                ctx.close()
            theirs = np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32), dtype=np.float64)
            r = np.corrcoef(ours, theirs)[0, 1]
            assert r >= 0.99, (text, r)
            top2 = np.sort(ours)[-2:]
            if top2[1] - top2[0] > 1.0:
                assert int(np.argmax(ours)) == int(np.argmax(theirs)), text
            greedy_mlx = [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=32, sampler=lambda lp: mx.argmax(lp, axis=-1))]
            same = next((i for i, (a, b) in enumerate(zip(greedy_llama, greedy_mlx)) if a != b), 32)
            agreement.append(same)
            print(f"{kind:5} r={r:.4f} top-2 gap={top2[1] - top2[0]:.2f} greedy tokens agreeing: {same}/32  {text[:40]!r}")
    finally:
        llama.close()
    print(f"greedy agreement: {sum(agreement)}/{32 * len(agreement)} tokens before the first difference; {agreement}")
    assert sum(agreement) >= 8 * len(agreement)  # near-ties flip some texts early, but not most


def test_what_cannot_convert_says_so(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 100)
    run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "convert", str(junk), "--to", "mlx", "--out", str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "not a GGUF model file" in run.stderr and "\n" not in run.stderr.strip()
    run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "convert", str(tmp_path / "missing.gguf"), "--to", "mlx"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "MLX cannot read this GGUF" in run.stderr


def test_quantize_for_mlx_with_bits_and_group_size(tmp_path: Path) -> None:
    """`models quantize --engine mlx`: the GGUF converted, dequantized and quantized again by
    mlx-lm at the asked bits and group size, registered with engine = "mlx", and still answering."""
    import shutil

    gguf = tmp_path / "small.gguf"
    shutil.copy(package_file(MODEL_FILE), gguf)
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nalias = "small"\npath = "small.gguf"\nslots = 2\ntier = "small"\n')
    run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "quantize", "small", "--engine", "mlx", "--bits", "8",
                          "--group-size", "64", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    folder = tmp_path / "small-mlx-8bit-g64"
    assert "registered as 'small-mlx-8bit'" in run.stdout
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (8, 64)
    assert json.loads((folder / "appliance-source.json").read_text())["gguf"] == str(gguf)  # grammars use its vocabulary
    from appliance.config.settings import load_settings

    registered = load_settings(config).model("small-mlx-8bit")
    assert registered is not None and registered.engine == "mlx" and registered.path == folder and registered.tier == "small"
    model, tokenizer = mlx_lm.load(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False)
    assert "Paris" in mlx_lm.generate(model, tokenizer, prompt, max_tokens=12, verbose=False)
    again = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "quantize", "small", "--engine", "mlx", "--bits", "7",
                            "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "invalid choice: 7" in again.stderr
