"""Long admin jobs (quantize a model, pull one from a hub, train an adapter) run on a thread the
server owns, one at a time, with progress the admin API and the TUI can poll. A job whose work can
stop cleanly (training) is cancellable: its work watches `job.cancel` and raises JobCancelled."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Job:
    id: str
    kind: str
    description: str
    state: str = "running"  # running | done | failed | cancelled
    done: int = 0
    total: int | None = None  # an estimate where the size is not known up front
    unit: str = "bytes"  # what done and total count: bytes (quantize, pull) or steps (training)
    message: str = ""  # while running: how it goes (a training job's loss); then: how it ended
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    cancellable: bool = False
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)  # set to ask the work to stop

    def view(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cancel"}
        out["cancel_requested"] = self.cancel.is_set()
        if self.unit == "bytes":  # the names clients read before jobs counted anything else
            out["done_bytes"], out["total_bytes"] = self.done, self.total
        if self.state == "done":
            out["fraction"] = 1.0
        elif self.total:
            out["fraction"] = min(self.done / self.total, 0.99)
        else:
            out["fraction"] = None
        return out


class JobBusy(Exception):
    pass


class JobCancelled(Exception):
    """Raised by a job's work that stopped because it was asked to; the message says what is kept."""


class JobRunner:
    def __init__(self, keep: int = 20) -> None:
        self._jobs: dict[str, Job] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._keep = keep

    def start(self, kind: str, description: str, work: Callable[[Job], str], *, unit: str = "bytes",
              cancellable: bool = False) -> Job:
        """Runs `work(job)` on a thread; it updates the job's progress and returns a closing message."""
        with self._lock:
            running = [j for j in self._jobs.values() if j.state == "running"]
            if running:
                raise JobBusy(f"{running[0].kind} job {running[0].id} is still running ({running[0].description})")
            job = Job(uuid.uuid4().hex[:12], kind, description, unit=unit, cancellable=cancellable)
            self._jobs[job.id] = job
            for old in sorted(self._jobs.values(), key=lambda j: j.started_at)[: max(0, len(self._jobs) - self._keep)]:
                if old.state != "running":
                    del self._jobs[old.id]

        def run() -> None:
            try:
                job.message = work(job)
                job.state = "done"
            except JobCancelled as exc:
                job.message = str(exc)
                job.state = "cancelled"
            except Exception as exc:  # the job's owner reads this; the server goes on
                job.message = str(exc)
                job.state = "failed"
            finally:
                job.finished_at = time.time()

        thread = threading.Thread(target=run, name=f"job:{kind}:{job.id}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return job

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.view() for j in sorted(self._jobs.values(), key=lambda j: j.started_at, reverse=True)]

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> bool:
        """Asks a running cancellable job to stop; False when it cannot be (quantize, pull)."""
        job = self._jobs.get(job_id)
        if job is None or not job.cancellable:
            return False
        job.cancel.set()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Asks cancellable jobs to stop, then waits a little for running jobs. llama.cpp's
        quantizer cannot be interrupted, so a job still running after that is left to end with the
        process (its output is removed on failure and half-written files are never registered)."""
        for job in list(self._jobs.values()):
            if job.state == "running" and job.cancellable:
                job.cancel.set()
        for thread in self._threads:
            thread.join(timeout_s)
