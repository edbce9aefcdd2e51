"""The admin API for distillation: train a LoRA adapter for a student model as a server job (poll
GET /admin/jobs; DELETE /admin/jobs/{id} stops it with a checkpoint that the same request
resumes). The trainer is paused while the server's own models have requests. The finished adapter
is registered in models.toml and served without a restart."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, post

from appliance.config.settings import LocalModel
from appliance.distill.export import TRAIN
from appliance.fleet.admin import alias_for
from appliance.http.admin import _admin, server_path
from appliance.http.fleet import apply_from_thread, config_file
from appliance.pipeline.errors import APIError, invalid
from appliance.server.jobs import Job, JobBusy, JobCancelled
from appliance.server.services import Services
from appliance.train.plan import OptionError, Options, wait_until
from appliance.wire.decode import decode_body


class TrainBody(msgspec.Struct, forbid_unknown_fields=True):
    student: str  # a configured model's alias
    data: str  # chat-format JSONL on the server, inside the data directory or [server] model_dirs
    name: str | None = None  # the adapter's name; default: from the data file's name
    options: Options = Options()
    threads: int | None = None  # the trainer's CPU threads; default: the CPU count
    nice: int = 10  # its priority below serving's
    fresh: bool = False  # discard a stopped run of this name instead of resuming it
    yield_to_serving: bool = True  # the trainer is paused while any local model has requests
    start_at: str | None = None  # "HH:MM": the job waits for this local time (quiet hours), stoppable meanwhile


@post("/admin/distill/train", status_code=202)
async def train_adapter(request: Request[Any, Any, Any], services: Services) -> dict[str, Any]:
    from appliance.train import job as training

    await _admin(request, services)
    body: TrainBody = decode_body(await request.body(), TrainBody)
    config = config_file(services)
    data = server_path(services, body.data, "data")
    if not (data.is_file() or (data / TRAIN).is_file()):
        raise invalid(f"There is no file {data} on the server (a JSONL file, or a folder `appliance distill export` wrote).", "data")
    if body.threads is not None and not 1 <= body.threads <= 1024:
        raise invalid("threads must be between 1 and 1024.", "threads")
    if not 0 <= body.nice <= 19:
        raise invalid("nice must be between 0 and 19.", "nice")
    try:
        wait_until(body.start_at, datetime.now())
    except OptionError as exc:
        raise invalid(f"{exc}.", "start_at") from None
    running = [j for j in services.jobs.list() if j["state"] == "running"]
    if running:
        raise APIError(409, f"{running[0]['kind']} job {running[0]['id']} is still running ({running[0]['description']})", code="job_running")
    name = body.name if body.name is not None else alias_for(data)
    try:  # checks the student and every example, and writes the run folder: off the loop
        prepared = await asyncio.to_thread(training.prepare, services.settings, body.student, data, name, body.options,
                                           fresh=body.fresh, threads=body.threads, nice=body.nice)
    except training.TrainError as exc:
        status = 404 if exc.code == "model_not_found" else 400
        raise APIError(status, str(exc), param=exc.param, code=exc.code or "invalid_training_request") from None
    loop = asyncio.get_running_loop()

    def work(job: Job) -> str:
        job.total = prepared.steps

        def show(p: training.Progress) -> None:
            job.done, job.total = p.step, p.steps
            job.message = p.phase + (f", loss {p.loss:.3f}" if p.loss is not None else "")

        try:
            record = training.run(prepared, show, job.cancel, busy=(lambda: serving_busy(services)) if body.yield_to_serving else None,
                                  start_at=body.start_at)
        except training.TrainCancelled as exc:
            raise JobCancelled(str(exc)) from None
        target = training.install(prepared, Path(config))
        job.done = job.total = record["steps"]
        spec = prepared.spec
        return (f"trained {spec.student}:{spec.adapter} ({spec.example_count} examples, final loss {record['final_loss']:.3f}); "
                f"wrote {target} and registered it in {config}" + apply_from_thread(services, loop))

    resumed = " (resuming)" if prepared.resume else ""
    try:
        job = services.jobs.start("train", f"{prepared.spec.student}:{prepared.spec.adapter} from {data.name}{resumed}", work,
                                  unit="steps", cancellable=True)
    except JobBusy as exc:
        raise APIError(409, str(exc), code="job_running") from None
    return {"job": job.view(), "examples": prepared.spec.example_count, "left_out_lines": list(prepared.left_out),
            "steps": prepared.steps, "resume": prepared.resume}


def serving_busy(services: Services) -> bool:
    """Whether a model this machine runs has requests running or waiting (upstream ones use no CPU here)."""
    for model in services.registry.all():
        if isinstance(model.settings, LocalModel):
            stats = model.engine.stats()
            if stats.slots_busy or stats.queue_depth:
                return True
    return False


ROUTES = [train_adapter]
