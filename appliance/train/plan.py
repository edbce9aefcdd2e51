"""A training run's plan: what the operator chose, where each file goes, and whether a run already
on disk is resumed or refused. Plain values and pure decisions; job.py does the IO.

Layout under the data directory:
    distill/runs/<student>--<name>/   the run while it lasts: spec.json, examples.jsonl (token ids),
                                      checkpoints/ (resumable), staging/ (the finished files), train.log
    adapters/<student>/<name>/        the adapter once finished: adapter.gguf (llama.cpp),
                                      mlx/ (mlx-lm), training.json; then registered in models.toml
A run that stops (cancelled, failed, the server stopped) leaves only its run folder, never an
adapter or a models.toml entry; the same command resumes it from its last checkpoint.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import msgspec

from engines.llama_layout import PROJECTIONS

# Architectures whose GGUF both transformers reads and whose tensor names engines/llama_layout.py knows.
TRAINABLE_ARCHS = frozenset({"llama", "qwen2", "qwen3"})
# Each trainer's packages, and how to install them.
TRAINERS = {
    "torch": (("torch", "peft", "transformers", "accelerate", "gguf", "safetensors"),
              "bash installer/install.sh --with train in a checkout, else pip install 'appliance[train]'"),
    "mlx": (("mlx", "mlx_lm", "gguf"), "pip install gguf (mlx and mlx-lm come with the appliance on a Mac)"),
}


class OptionError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the operator chooses (CLI flags, the admin API's body)."""

    epochs: float = 2.0
    steps: int | None = None  # when given, exactly this many optimizer steps (epochs is ignored)
    rank: int = 16
    alpha: float | None = None  # None: twice the rank
    learning_rate: float = 2e-4
    batch_size: int = 4
    max_tokens: int = 1024  # longer examples are left out, and counted
    save_every: int = 20  # steps between checkpoints
    modules: tuple[str, ...] = PROJECTIONS
    seed: int = 0
    trainer: str = "auto"  # "mlx" (mlx-lm) on Apple silicon, "torch" (PyTorch + peft) elsewhere

    def check(self) -> None:
        """Raises OptionError naming the option."""
        rules = [
            ("epochs", self.epochs > 0, "must be more than 0"),
            ("steps", self.steps is None or self.steps >= 1, "must be 1 or more"),
            ("rank", 1 <= self.rank <= 256, "must be between 1 and 256"),
            ("alpha", self.alpha is None or self.alpha > 0, "must be more than 0"),
            ("learning_rate", 0 < self.learning_rate <= 1, "must be in (0, 1]"),
            ("batch_size", 1 <= self.batch_size <= 256, "must be between 1 and 256"),
            ("max_tokens", self.max_tokens >= 16, "must be 16 or more"),
            ("save_every", self.save_every >= 1, "must be 1 or more"),
            ("modules", bool(self.modules) and set(self.modules) <= set(PROJECTIONS), f"must name some of {', '.join(PROJECTIONS)}"),
            ("trainer", self.trainer in ("auto", *TRAINERS), f"must be auto, {' or '.join(TRAINERS)}"),
        ]
        for name, ok, rule in rules:
            if not ok:
                raise OptionError(name, rule)

    @property
    def lora_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the worker process needs, written as the run's spec.json."""

    student: str
    adapter: str
    gguf: str  # the student's file; transformers reads its weights
    arch: str
    heads: int
    kv_heads: int
    layers: int
    examples: str  # examples.jsonl: token ids and labels
    example_count: int
    checkpoints: str
    staging: str
    options: Options
    identity: str  # what must match for a run on disk to be resumed
    threads: int
    nice: int
    trainer: str = "torch"
    mlx_folder: str | None = None  # the mlx trainer's student: the folder the MLX engine serves, converted from the GGUF


@dataclass(frozen=True)
class RunPaths:
    run: Path
    adapter: Path

    @classmethod
    def of(cls, data_dir: Path, student: str, name: str) -> RunPaths:
        return cls(data_dir / "distill" / "runs" / f"{student}--{name}", data_dir / "adapters" / student / name)

    @property
    def spec(self) -> Path:
        return self.run / "spec.json"

    @property
    def examples(self) -> Path:
        return self.run / "examples.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.run / "checkpoints"

    @property
    def staging(self) -> Path:
        return self.run / "staging"

    @property
    def log(self) -> Path:
        return self.run / "train.log"


def not_installed(trainer: str, module: str | None) -> str:
    return f"the {trainer} trainer is not installed ({module} is missing): {TRAINERS[trainer][1]}"


def trainer_for(choice: str, system: str, machine: str) -> str:
    """"auto" is mlx-lm on Apple silicon (Metal; on a CPU its matrix products are about 20 times
    slower than PyTorch's, docs/performance.md) and PyTorch everywhere else."""
    if choice != "auto":
        return choice
    return "mlx" if system == "darwin" and machine == "arm64" else "torch"


def adapter_file(adapter_folder: Path, engine: str) -> Path:
    """What models.toml names for the student's engine: llama.cpp's GGUF, or mlx-lm's folder."""
    return adapter_folder / "mlx" if engine == "mlx" else adapter_folder / "adapter.gguf"


def identity(student_digest: str, examples_text: str, options: Options) -> str:
    """A run is resumed only with the same student file, the same examples and the same options."""
    h = hashlib.sha256()
    for part in (student_digest, examples_text, msgspec.json.encode(options).decode()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def total_steps(examples: int, options: Options) -> int:
    """Optimizer steps the trainer will take (one batch a step)."""
    if options.steps is not None:
        return options.steps
    return max(1, math.ceil(options.epochs * math.ceil(examples / options.batch_size)))


class Refused(ValueError):
    pass


def resume_or_start(on_disk: str | None, wanted: str, fresh: bool) -> str:
    """'start' or 'resume' for a run whose folder holds a run of identity `on_disk` (None: none);
    another run under the same name is refused unless `fresh` discards it."""
    if on_disk is None or fresh:
        return "start"
    if on_disk == wanted:
        return "resume"
    raise Refused("a stopped run of this name with other examples or options is on disk; "
                  "add --fresh (\"fresh\": true) to discard it, or choose another name")


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


def wait_until(clock: str | None, now: datetime) -> float:
    """Seconds from `now` (local time) to the next `clock` ("HH:MM", 24-hour): a job held for the
    quiet hours. None or the present minute: 0."""
    if clock is None:
        return 0.0
    try:
        hour, minute = (int(part) for part in clock.split(":"))
        if not (0 <= hour < 24 and 0 <= minute < 60 and len(clock) == 5):
            raise ValueError
    except ValueError:
        raise OptionError("start_at", f"{clock!r} is not a time of day as HH:MM (24-hour), for example \"02:00\"") from None
    start = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if (start.hour, start.minute) == (now.hour, now.minute):
        return 0.0
    if start < now:
        start += timedelta(days=1)
    return (start - now).total_seconds()
