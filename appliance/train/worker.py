"""The trainer's own process: `python -m appliance.train.worker SPEC.json`.

PyTorch with peft's LoRA and transformers' Trainer (its checkpoints, resume, schedule and
optimizer), on the student's weights read by transformers from the same GGUF the engine serves;
or, with the spec's trainer "mlx", mlx-lm's (appliance/train/mlx_trainer.py). It runs at the
spec's `nice` with its own thread count, so serving keeps the CPU first.

It reports on its stdout, one JSON object a line (library output goes to its stderr, the run's log):
    {"event": "loading"} | {"event": "started", "step", "steps"} | {"event": "step", "step", "steps", "loss", "epoch"}
    | {"event": "saved", "step"} | {"event": "done", "step", "loss", "seconds"} | {"event": "cancelled", "step"}
    | {"event": "error", "message"}
SIGTERM (or its parent going away) stops it at the end of the step under way, with a checkpoint;
it then exits 3. It writes only inside its run folder; the finished files go to the spec's staging
folder, which the parent moves into place and registers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgspec

from appliance.fleet.lora_files import BaseShape, LoraAdapter, LoraPair, write_gguf, write_mlx
from appliance.train.checkpoints import CANCELLED_EXIT, latest_checkpoint
from appliance.train.plan import Spec, not_installed


class _Events:
    def __init__(self) -> None:
        # The events get the real stdout; anything a library prints goes to stderr (the log).
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def __call__(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(Path(argv[0]).read_bytes(), type=Spec)
    emit = _Events()
    try:
        return _train(spec, emit)
    except Exception as exc:  # the parent shows one line; the traceback goes to the log
        traceback.print_exc()
        emit("error", message=f"training failed: {type(exc).__name__}: {exc}")
        return 1


def _train(spec: Spec, emit: _Events) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    _die_with_parent()
    os.nice(spec.nice)

    def stopping() -> bool:  # asked to stop, or the server went away
        return stop.is_set() or os.getppid() != parent

    if spec.trainer == "mlx":
        from appliance.train.mlx_trainer import train_mlx as trainer  # mlx-lm only where asked for
    else:
        trainer = _train_torch
    outcome = trainer(spec, emit, stopping)
    if isinstance(outcome, int):
        return outcome
    pairs, record = outcome
    _write_adapter(pairs, spec, Path(spec.staging), record)
    emit("done", step=record["steps"], loss=record["final_loss"], seconds=record["seconds_this_session"])
    return 0


def _train_torch(spec: Spec, emit: Callable[..., None], stopping: Callable[[], bool]) -> tuple[dict[str, Any], dict[str, Any]] | int:
    """PyTorch's run: the adapter's pairs and what to record, or the exit status when it stopped."""
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import Trainer, TrainerCallback, TrainingArguments
    except ImportError as exc:
        emit("error", message=not_installed("torch", exc.name))
        return 2
    torch.set_num_threads(spec.threads)
    options = spec.options
    gguf = Path(spec.gguf)
    emit("loading")
    try:
        base = _load_dense(gguf, torch)
    except Exception as exc:  # transformers raises many kinds for a file it cannot read
        emit("error", message=f"student {spec.student!r}: transformers cannot load {gguf} ({type(exc).__name__}: {exc})")
        return 1
    if stopping():
        emit("cancelled", step=0)
        return CANCELLED_EXIT
    torch.manual_seed(options.seed)  # LoRA's A matrices start from it (the Trainer seeds only once it is built)
    model = get_peft_model(base, LoraConfig(r=options.rank, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                                            target_modules=list(options.modules), task_type="CAUSAL_LM"))
    rows = [json.loads(line) for line in Path(spec.examples).read_text().splitlines()]
    dataset = [{"input_ids": r["tokens"], "labels": r["labels"]} for r in rows]

    def collate(batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    class Report(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit("started", step=state.global_step, steps=state.max_steps)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                emit("step", step=state.global_step, steps=state.max_steps, loss=logs["loss"], epoch=state.epoch)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if stopping():
                control.should_save = True
                control.should_training_stop = True

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit("saved", step=state.global_step)

    args = TrainingArguments(
        output_dir=spec.checkpoints, per_device_train_batch_size=options.batch_size,
        num_train_epochs=options.epochs, max_steps=options.steps or -1,
        learning_rate=options.learning_rate, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="steps", save_steps=options.save_every, save_total_limit=1,
        report_to="none", disable_tqdm=True, seed=options.seed, data_seed=options.seed,
        train_sampling_strategy="group_by_length",  # batches of like lengths: less padding to compute
        remove_unused_columns=False, dataloader_pin_memory=False, use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[Report()])
    started = time.monotonic()
    resume = latest_checkpoint(Path(spec.checkpoints))
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if trainer.state.global_step < trainer.state.max_steps:
        emit("cancelled", step=trainer.state.global_step)
        return CANCELLED_EXIT
    pairs = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            pairs[name.removeprefix("base_model.model.")] = LoraPair(
                module.lora_A["default"].weight.detach().float().cpu().numpy(),
                module.lora_B["default"].weight.detach().float().cpu().numpy())
    return pairs, {
        "steps": trainer.state.global_step, "first_loss": _first_loss(trainer.state.log_history),
        "final_loss": _last_loss(trainer.state.log_history),
        "mean_loss": result.training_loss, "resumed_from_step": int(resume.name.rpartition("-")[2]) if resume else 0,
        "seconds_this_session": round(time.monotonic() - started, 1),
        "versions": {"torch": torch.__version__, "peft": version("peft"), "transformers": version("transformers")},
    }


def _die_with_parent() -> None:
    """On Linux the kernel kills this process when its parent dies, even while it is stopped
    (paused for serving), so it cannot outlive a server that was killed; it resumes from its last
    checkpoint. Elsewhere it notices at its next step and stops."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _load_dense(gguf: Path, torch: Any) -> Any:
    """The student's weights unpacked into float32: the LoRA trains over them, and they are the
    weights the GGUF holds (transformers would otherwise mark the model as GGUF-quantized and
    refuse to train it)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True))


def _write_adapter(pairs: dict[str, LoraPair], spec: Spec, staging: Path, record: dict[str, Any]) -> None:
    """Both formats from the same pairs (Hugging Face's names and row order): llama.cpp's GGUF and
    mlx-lm's folder, with training.json."""
    adapter = LoraAdapter(pairs, alpha=spec.options.lora_alpha)
    base = BaseShape(spec.arch, spec.heads, spec.kv_heads, spec.layers)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_gguf(adapter, staging / "adapter.gguf", base)
    write_mlx(adapter, staging / "mlx", base)
    about = {"student": spec.student, "adapter": spec.adapter, "student_file": spec.gguf, "trainer": spec.trainer,
             "examples": spec.example_count, "identity": spec.identity, "options": msgspec.to_builtins(spec.options), **record}
    (staging / "training.json").write_text(json.dumps(about, indent=2) + "\n")


def _first_loss(history: list[dict[str, Any]]) -> float | None:
    """This session's first step's loss (after a resume, the first step it took)."""
    return next((h["loss"] for h in history if "loss" in h), None)


def _last_loss(history: list[dict[str, Any]]) -> float | None:
    return next((h["loss"] for h in reversed(history) if "loss" in h), None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
