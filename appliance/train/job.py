"""A training run from start to a registered adapter, for the CLI (a progress bar, Ctrl-C stops it)
and the admin API (a server job, DELETE /admin/jobs/{id} stops it):

    prepare()  checks everything it can before any process starts (the trainer installed, the
               student, the examples) and writes the run folder; the errors are one line each
    run()      runs the worker (appliance/train/worker.py) in its own process at a lower priority,
               reports its progress, stops it cleanly when asked
    install()  moves the finished files into place and registers them in models.toml

Nothing here imports the training stack: the server stays light, and the worker imports it alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import msgspec

from appliance.config.settings import NAME, NAME_RULE, LocalModel, Settings
from appliance.config.writer import append_nested
from appliance.fleet.files import ModelFileError, resolve
from appliance.prompt.template import template_of
from appliance.train.checkpoints import CANCELLED_EXIT
from appliance.train.data import MIN_EXAMPLES, DataError, check_count, encode_all, read_examples, write_encoded
from appliance.train.plan import (
    TRAINABLE_ARCHS,
    TRAINERS,
    OptionError,
    Options,
    Refused,
    RunPaths,
    Spec,
    adapter_file,
    default_threads,
    identity,
    not_installed,
    resume_or_start,
    total_steps,
    trainer_for,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent.parent  # the worker runs this checkout's code


class TrainError(Exception):
    """One line: what is wrong and what to do; `param` names the input at fault (for the API)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class TrainCancelled(Exception):
    """Stopped when asked; the message says what was kept."""


@dataclass(frozen=True)
class Prepared:
    spec: Spec
    paths: RunPaths
    engine: str  # the student's engine: which file models.toml names
    steps: int
    resume: bool
    left_out: tuple[int, ...]  # lines of examples longer than max_tokens


@dataclass(frozen=True)
class Progress:
    phase: str  # loading | training | saving
    step: int = 0
    steps: int = 0
    loss: float | None = None


def trainer_missing(trainer: str = "torch") -> str | None:
    """The first package of the trainer's stack that is not installed, looked up without importing it."""
    return next((m for m in TRAINERS[trainer][0] if importlib.util.find_spec(m) is None), None)


def student_file(settings: Settings, alias: str) -> tuple[LocalModel, Path, str]:
    """The student's settings, its GGUF, and the engine that serves it."""
    from appliance.fleet.registry import engine_for

    model = settings.model(alias)
    if model is None:
        raise TrainError(f"student {alias!r}: {settings.file} has no model with that alias", "student", "model_not_found")
    if not isinstance(model, LocalModel) or model.engine == "onnx" or model.kind != "chat":
        raise TrainError(f"student {alias!r}: only a chat model this machine runs from a GGUF file can be trained", "student")
    engine = engine_for(model)
    if engine == "mlx" and model.path is not None and model.path.is_dir():
        from engines.mlx.convert import source_of

        gguf = source_of(model.path)
        if gguf is None:
            raise TrainError(f"student {alias!r}: its MLX folder {model.path} names no GGUF file to train from", "student")
        return model, gguf, engine
    try:
        return model, resolve(model, settings.server.data_dir), engine
    except ModelFileError as exc:
        raise TrainError(f"student {alias!r}: {exc}", "student") from None


def prepare(settings: Settings, student: str, data: Path, name: str, options: Options, *, fresh: bool = False,
            threads: int | None = None, nice: int = 10) -> Prepared:
    """Everything checked, the examples encoded and the run folder written; raises TrainError."""
    from engines.llamacpp.vocabulary import LlamaVocabulary

    try:
        options.check()
    except OptionError as exc:
        raise TrainError(str(exc), f"options.{exc.param}") from None
    trainer = trainer_for(options.trainer, sys.platform, platform.machine())
    missing = trainer_missing(trainer)
    if missing is not None:
        raise TrainError(not_installed(trainer, missing), code="trainer_not_installed")
    if not NAME.match(name):
        raise TrainError(f"adapter name {name!r}: expected {NAME_RULE}", "name")
    model, gguf, engine = student_file(settings, student)
    if any(a.name == name for a in model.adapters):
        raise TrainError(f"student {student!r} already has an adapter named {name!r}; choose another name", "name")
    paths = RunPaths.of(settings.server.data_dir, student, name)
    if paths.adapter.exists():
        raise TrainError(f"{paths.adapter} exists already; remove it or choose another name", "name")
    mlx_student = _mlx_student(settings, model) if trainer == "mlx" else None
    try:
        vocabulary = LlamaVocabulary.of_file(gguf)
    except Exception as exc:  # llama.cpp refuses a file that is not a GGUF model
        raise TrainError(f"student {student!r}: llama.cpp cannot read {gguf} ({exc})", "student") from None
    try:
        meta = vocabulary.model.meta
        arch = meta("general.architecture") or "?"
        if arch not in TRAINABLE_ARCHS:
            raise TrainError(f"student {student!r}: {gguf.name} is a {arch!r} model; training reads "
                             f"{', '.join(sorted(TRAINABLE_ARCHS))} GGUFs", "student")
        heads = int(meta(f"{arch}.attention.head_count") or 0)
        shape = (heads, int(meta(f"{arch}.attention.head_count_kv") or heads), int(meta(f"{arch}.block_count") or 0))
        examples = read_examples(data)
        max_tokens = min(options.max_tokens, model.context_length)
        encoded, left_out = encode_all(examples, template_of(model.chat_template, vocabulary), vocabulary, max_tokens, str(data))
        check_count(len(encoded), MIN_EXAMPLES, f"{data} (leaving out {len(left_out)} longer than {max_tokens} tokens)" if left_out else str(data))
    except DataError as exc:
        raise TrainError(str(exc), "data") from None
    finally:
        vocabulary.close()
    examples_text = "".join(json.dumps([e.tokens, e.labels]) for e in encoded)
    stat = gguf.stat()
    wanted = identity(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}", examples_text, options)
    try:
        start = resume_or_start(_identity_on_disk(paths), wanted, fresh)
    except Refused as exc:
        raise TrainError(f"{paths.run}: {exc}", "fresh") from None
    if start == "start":
        shutil.rmtree(paths.run, ignore_errors=True)
    paths.run.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(paths.staging, ignore_errors=True)  # an earlier run's unfinished files
    spec = Spec(student=student, adapter=name, gguf=str(gguf), arch=arch, heads=shape[0], kv_heads=shape[1], layers=shape[2],
                examples=str(paths.examples), example_count=len(encoded), checkpoints=str(paths.checkpoints),
                staging=str(paths.staging), options=options, identity=wanted, threads=threads or default_threads(), nice=nice,
                trainer=trainer, mlx_folder=str(mlx_student) if mlx_student is not None else None)
    write_encoded(encoded, paths.examples)
    paths.spec.write_bytes(msgspec.json.encode(spec))
    return Prepared(spec, paths, engine, total_steps(len(encoded), options), start == "resume", tuple(left_out))


def _mlx_student(settings: Settings, model: LocalModel) -> Path:
    """The folder the MLX engine serves the student from (converted from its GGUF once, into the
    data directory): mlx-lm trains over the same weights."""
    from appliance.fleet.registry import mlx_folder

    try:
        return mlx_folder(model, settings)[0]
    except (RuntimeError, ModelFileError) as exc:
        raise TrainError(f"student {model.alias!r}: {exc}", "student") from None


def _identity_on_disk(paths: RunPaths) -> str | None:
    try:
        return msgspec.json.decode(paths.spec.read_bytes(), type=Spec).identity
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def run(prepared: Prepared, on_progress: Callable[[Progress], None], cancel: threading.Event, *,
        busy: Callable[[], bool] | None = None, grace_s: float = 120.0, start_at: str | None = None) -> dict:
    """Runs the worker to the end; returns what it wrote about the run (training.json, with the
    seconds it spent paused). While `busy()` says serving has work, the worker is stopped
    (SIGSTOP) and continued once it has none: on a small CPU, ggml's spinning threads lose far
    more than the trainer's share to it (docs/performance.md). Raises TrainCancelled when `cancel`
    was set (the run's checkpoint stays, to resume), TrainError when the worker failed. Either way
    no finished files are left in staging."""
    spec, paths = prepared.spec, prepared.paths
    delay = wait_until(start_at, datetime.now())
    if delay:  # held for the quiet hours; a stop request ends the wait
        on_progress(Progress(f"waiting until {start_at}", 0, prepared.steps))
        if cancel.wait(delay):
            raise TrainCancelled(f"training {spec.student}:{spec.adapter} was stopped while waiting until {start_at}; nothing ran")
    threads = str(spec.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}  # the student is a local file: nothing leaves the machine
    with paths.log.open("ab") as log:
        # Its own session: a Ctrl-C at the terminal reaches the CLI, which stops the worker cleanly.
        process = subprocess.Popen([sys.executable, "-m", "appliance.train.worker", str(paths.spec)], cwd=ROOT, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    last = [Progress("loading", 0, prepared.steps)]
    watch = _Watch(process, cancel, busy, grace_s, lambda paused: on_progress(
        Progress("paused while serving" if paused else last[0].phase, last[0].step, last[0].steps, last[0].loss)))
    watcher = threading.Thread(target=watch.run, name="train-watch", daemon=True)
    watcher.start()
    error = None
    assert process.stdout is not None
    for raw in process.stdout:
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        kind, now = event.get("event"), last[0]
        if kind == "error":
            error = event.get("message")
            continue
        if kind in ("started", "step"):
            last[0] = Progress("training", event["step"], event["steps"], event.get("loss", now.loss))
        elif kind == "saved":
            last[0] = Progress("saving", event["step"], now.steps, now.loss)
        else:
            continue
        on_progress(last[0])
    code = process.wait()
    watcher.join()
    if code != 0 or cancel.is_set():
        shutil.rmtree(paths.staging, ignore_errors=True)
    if cancel.is_set() or code == CANCELLED_EXIT:
        kept = f"checkpoint kept at step {_checkpoint_step(paths)}" if _checkpoint_step(paths) else "no checkpoint yet"
        raise TrainCancelled(f"training {spec.student}:{spec.adapter} stopped at step {last[0].step} of {last[0].steps} "
                             f"({kept}; the same command resumes it, --fresh starts over)")
    if code != 0:
        raise TrainError(error or f"the trainer exited with status {code}; its log is {paths.log}")
    record = json.loads((paths.staging / "training.json").read_text())
    record["paused_seconds"] = round(watch.paused_s, 1)
    (paths.staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


class _Watch:
    """The worker's keeper, on its own thread: stops it when asked to (it finishes its step and
    saves a checkpoint), and pauses it while serving is busy."""

    POLL_S = 0.05

    def __init__(self, process: subprocess.Popen, cancel: threading.Event, busy: Callable[[], bool] | None,  # type: ignore[type-arg]
                 grace_s: float, paused_changed: Callable[[bool], None]) -> None:
        self.process, self.cancel, self.busy, self.grace_s, self.paused_changed = process, cancel, busy, grace_s, paused_changed
        self.paused_s = 0.0
        self._since: float | None = None

    def run(self) -> None:
        while self.process.poll() is None:
            if self.cancel.wait(self.POLL_S):
                self._pause(False)  # a stopped process takes no SIGTERM until it runs again
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                return
            if self.busy is not None:
                try:
                    wanted = self.busy()
                except Exception:  # serving's state unknown: do not hold training up for it
                    wanted = False
                self._pause(wanted)
        self._pause(False)

    def _pause(self, paused: bool) -> None:
        if paused == (self._since is not None):
            return
        try:
            self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        except ProcessLookupError:
            return
        if paused:
            self._since = time.monotonic()
        else:
            self.paused_s += time.monotonic() - (self._since or time.monotonic())
            self._since = None
        self.paused_changed(paused)


def _checkpoint_step(paths: RunPaths) -> int:
    steps = [int(p.name.rpartition("-")[2]) for p in paths.checkpoints.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(steps, default=0)


def install(prepared: Prepared, config: Path) -> Path:
    """Moves the finished files into the adapters folder and registers them under the student in
    models.toml; on a refusal nothing stays. Returns the file models.toml names."""
    paths, spec = prepared.paths, prepared.spec
    paths.adapter.parent.mkdir(parents=True, exist_ok=True)
    os.rename(paths.staging, paths.adapter)  # one step: the adapter is there whole or not at all
    target = adapter_file(paths.adapter, prepared.engine)
    try:
        append_nested(config, "models", spec.student, "adapters", {"name": spec.adapter, "path": target})
    except BaseException:
        shutil.rmtree(paths.adapter, ignore_errors=True)
        raise
    shutil.rmtree(paths.run, ignore_errors=True)  # its checkpoints are no longer needed
    return target
