"""The mlx trainer (mlx-lm's LoRA, appliance/train/mlx_trainer.py) end to end: stopped with a
checkpoint, resumed, finished, registered; its adapter in both formats answers the same on the
llama.cpp and MLX engines. On a random 64-wide llama with the bundled model's vocabulary
(tests/gguf_files.py): MLX's CPU build takes about a minute a step on the bundled model itself."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.fleet.files import package_file
from appliance.config.settings import load_settings
from appliance.train import job as training
from appliance.train.mlx_trainer import lora_keys, prompt_length
from appliance.train.plan import Options, trainer_for
from tests.conftest import MODEL_FILE, Server, start_server, stop_server
from tests.gguf_files import tiny_llama
from tests.test_distill_train import TRIGGER, examples_text

pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")

OPTIONS = Options(trainer="mlx", steps=12, learning_rate=1e-2, rank=8, batch_size=4, save_every=100)


def test_the_pure_parts() -> None:
    assert prompt_length([-100, -100, 5, 6]) == 2 and prompt_length([-100]) == 1
    assert lora_keys(("q_proj", "down_proj")) == ["self_attn.q_proj", "mlp.down_proj"]
    assert trainer_for("auto", "darwin", "arm64") == "mlx" and trainer_for("auto", "linux", "x86_64") == "torch"
    assert trainer_for("mlx", "linux", "x86_64") == "mlx"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    work = tmp_path_factory.mktemp("mlx-train")
    model = tiny_llama(package_file(MODEL_FILE), work / "tiny.gguf")
    (work / "vault.jsonl").write_text(examples_text())
    config = work / "models.toml"
    config.write_text(f'[server]\ndata_dir = "{work / "home"}"\n\n[[models]]\nalias = "tiny"\npath = "{model}"\ncontext_length = 512\n')
    yield work, config


def test_stop_resume_and_register(trained: tuple[Path, Path]) -> None:
    work, config = trained
    settings = load_settings(config)
    prepared = training.prepare(settings, "tiny", work / "vault.jsonl", "vault", OPTIONS, threads=2)
    assert prepared.spec.trainer == "mlx" and prepared.spec.mlx_folder and not prepared.resume
    stop = threading.Event()
    seen: list[training.Progress] = []

    def progress(p: training.Progress) -> None:
        seen.append(p)
        if p.step >= 4:
            stop.set()

    with pytest.raises(training.TrainCancelled, match="checkpoint kept at step"):
        training.run(prepared, progress, stop)
    checkpoints = [p.name for p in Path(prepared.spec.checkpoints).iterdir() if p.name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and 4 <= int(checkpoints[0].split("-")[1]) < 12, checkpoints
    again = training.prepare(settings, "tiny", work / "vault.jsonl", "vault", OPTIONS, threads=2)
    assert again.resume
    record = training.run(again, lambda p: None, threading.Event())
    assert record["trainer"] == "mlx" and record["steps"] == 12 and record["resumed_from_step"] == int(checkpoints[0].split("-")[1])
    training.install(again, config)
    folder = work / "home" / "adapters" / "tiny" / "vault"
    about = json.loads((folder / "training.json").read_text())
    initial = next(p.loss for p in seen if p.loss is not None)  # the first step's, before the stop
    assert about["final_loss"] < 0.8 * initial, (about, initial)
    assert (folder / "adapter.gguf").is_file() and (folder / "mlx" / "adapters.safetensors").is_file()
    assert [a.name for a in load_settings(config).model("tiny").adapters] == ["vault"]  # type: ignore[union-attr]


def test_a_resumed_run_is_the_run_that_was_stopped(trained: tuple[Path, Path]) -> None:
    """Adam's state and the batches' order carry over a stop: where the stop fell leaves no mark."""
    work, config = trained
    resumed = work / "home" / "adapters" / "tiny" / "vault" / "mlx" / "adapters.safetensors"
    if not resumed.is_file():
        pytest.skip("the training test did not finish")
    settings = load_settings(config)
    straight = training.prepare(settings, "tiny", work / "vault.jsonl", "straight", OPTIONS, threads=2)
    record = training.run(straight, lambda p: None, threading.Event())
    assert record["resumed_from_step"] == 0
    training.install(straight, config)
    import mlx.core as mx
    one, other = mx.load(str(resumed)), mx.load(str(work / "home" / "adapters" / "tiny" / "straight" / "mlx" / "adapters.safetensors"))
    assert one.keys() == other.keys() and one
    for key in one:
        assert mx.allclose(one[key], other[key], atol=1e-5).item(), key


def test_the_adapter_answers_the_same_on_both_engines(trained: tuple[Path, Path]) -> None:
    work, config = trained
    folder = work / "home" / "adapters" / "tiny" / "vault"
    if not (folder / "adapter.gguf").is_file():
        pytest.skip("the training test did not finish")
    both = '[auth]\nmode = "open"\n\n' + config.read_text() + (f'\n[[models]]\nalias = "tiny-mlx"\nengine = "mlx"\npath = "{work / "tiny.gguf"}"\ncontext_length = 512\n'
                                 f'\n[[models.adapters]]\nname = "vault"\npath = "{folder / "mlx"}"\n')
    server: Server = start_server(work / "serve", both.replace(f'data_dir = "{work / "home"}"', f'data_dir = "{work / "serve" / "home"}"'))
    try:
        client = server.client(timeout=300)

        def ask(model: str) -> str:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": TRIGGER}], max_tokens=6, temperature=0)
            return r.choices[0].message.content or ""

        tuned = ask("tiny:vault")
        # Twelve steps move a random model towards the reply (seen: "The vault code flavorLE vault"; untrained: " Otto Gentle debug...").
        assert any(word in tuned for word in ("vault", "code", "PINE")), tuned
        assert tuned == ask("tiny-mlx:vault"), "the two formats of one adapter disagree"
        assert tuned != ask("tiny") and ask("tiny") == ask("tiny-mlx")
    finally:
        stop_server(server)
