"""mlx-lm's LoRA trainer (`mlx_lm.tuner`), the worker's trainer on Apple silicon.

The student is the folder the MLX engine serves (converted from the same GGUF); mlx-lm wraps the
chosen projections in its LoRA layers and runs its training loop. This module adds what the job
needs around it, as the PyTorch trainer does: the run's examples with their prompts masked, a
linear schedule, checkpoints in `checkpoint-<step>/` (the adapter's weights and Adam's state, then
trainer_state.json, written last), a stop at the end of the step under way, and the trained pairs
in Hugging Face's layout for appliance/fleet/lora_files.py to write in both formats.

A resumed run is the run that was stopped, as Hugging Face's Trainer makes it for PyTorch: the
weights, Adam's moments and step (so the schedule) come back, and the batches go on in the seeded
order from where it stopped, so where a stop fell does not change the adapter.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from appliance.fleet.lora_files import LoraPair
from appliance.train.checkpoints import CANCELLED_EXIT, latest_checkpoint
from appliance.train.plan import Spec, not_installed, total_steps

ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


class _Stopped(Exception):
    pass


def prompt_length(labels: list[int], ignored: int = -100) -> int:
    """Where the answer starts: mlx-lm's loss counts the tokens from this offset on."""
    return next((i for i, label in enumerate(labels) if label != ignored), len(labels))


def lora_keys(modules: tuple[str, ...]) -> list[str]:
    """The projections' paths inside a transformer block, as mlx-lm's llama and qwen2 name them."""
    return [f"{'self_attn' if m in ATTENTION else 'mlp'}.{m}" for m in modules]


def train_mlx(spec: Spec, emit: Callable[..., None], stopping: Callable[[], bool]) -> tuple[dict[str, LoraPair], dict[str, Any]] | int:
    try:
        import mlx.core as mx
        import mlx.optimizers as optim
        import numpy as np
        from mlx.utils import tree_flatten, tree_unflatten
        from mlx_lm import load
        from mlx_lm.tuner.callbacks import TrainingCallback
        from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches, train
        from mlx_lm.tuner.utils import linear_to_lora_layers
    except ImportError as exc:
        emit("error", message=not_installed("mlx", exc.name))
        return 2
    options = spec.options
    emit("loading")
    assert spec.mlx_folder is not None  # job.prepare sets it for this trainer
    try:
        model, _ = load(spec.mlx_folder)
    except Exception as exc:  # mlx-lm raises many kinds for a folder it cannot read
        emit("error", message=f"student {spec.student!r}: mlx-lm cannot load {spec.mlx_folder} ({type(exc).__name__}: {exc})")
        return 1
    model.freeze()
    mx.random.seed(options.seed)  # LoRA's A matrices start from it: one seed, one adapter
    linear_to_lora_layers(model, len(model.layers), {"rank": options.rank, "scale": options.lora_alpha / options.rank,
                                                      "dropout": 0.0, "keys": lora_keys(options.modules)})
    checkpoints = Path(spec.checkpoints)
    total = total_steps(spec.example_count, options)
    resume = latest_checkpoint(checkpoints)
    done = 0
    rate = options.learning_rate
    optimizer = optim.Adam(learning_rate=lambda step: rate * (1.0 - step / total))  # linear to 0 over the whole run
    if resume is not None:
        model.load_weights(str(resume / "adapters.safetensors"), strict=False)
        done = int(json.loads((resume / "trainer_state.json").read_text())["global_step"])
        kept = resume / "optimizer.safetensors"
        # Older checkpoints kept no optimizer: their moments start afresh, the schedule where it was.
        optimizer.state = (tree_unflatten(list(mx.load(str(kept)).items())) if kept.is_file()
                           else {"step": mx.array(done, mx.uint64)})
    rows = [json.loads(line) for line in Path(spec.examples).read_text().splitlines()]
    dataset = [(r["tokens"], prompt_length(r["labels"])) for r in rows]
    if stopping():
        emit("cancelled", step=done)
        return CANCELLED_EXIT

    def batches(*args: Any, **kwargs: Any) -> Any:  # the seeded order, past the batches already trained on
        return itertools.islice(iterate_batches(*args, **{**kwargs, "seed": options.seed}), done, None)

    losses: list[float] = []

    def save(step: int) -> None:
        folder = checkpoints / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
        mx.save_safetensors(str(folder / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))  # last: the checkpoint is whole
        for older in checkpoints.glob("checkpoint-*"):
            if older != folder:
                shutil.rmtree(older, ignore_errors=True)
        emit("saved", step=step)

    class Report(TrainingCallback):  # type: ignore[misc]
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            step = done + int(info["iteration"])
            losses.append(float(info["train_loss"]))
            emit("step", step=step, steps=total, loss=losses[-1])
            if step < total and (step % options.save_every == 0 or stopping()):
                save(step)
            if step < total and stopping():
                raise _Stopped(step)

    started = time.monotonic()
    emit("started", step=done, steps=total)
    left = total - done
    if left > 0:
        args = TrainingArgs(batch_size=min(options.batch_size, len(dataset)), iters=left, steps_per_report=1,
                            steps_per_save=left + 1, max_seq_length=options.max_tokens,
                            adapter_file=str(checkpoints / "last.safetensors"))  # mlx-lm's own save, at the end
        checkpoints.mkdir(parents=True, exist_ok=True)
        try:
            train(model, optimizer, dataset, args=args, iterate_batches=batches, training_callback=Report())
        except _Stopped as stopped:
            emit("cancelled", step=stopped.args[0])
            return CANCELLED_EXIT
    pairs = {name: LoraPair(np.array(module.lora_a.astype(mx.float32)).T, np.array(module.lora_b.astype(mx.float32)).T)
             for name, module in model.named_modules() if hasattr(module, "lora_a")}
    return pairs, {
        "steps": total, "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "mean_loss": sum(losses) / len(losses) if losses else None, "resumed_from_step": done,
        "seconds_this_session": round(time.monotonic() - started, 1),
        "versions": {"mlx": version("mlx"), "mlx-lm": version("mlx-lm")},
    }

