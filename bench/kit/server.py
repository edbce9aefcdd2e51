"""The one launcher: a server process (ours, a peer such as llama-server, llama_cpp.server or
mlx_lm.server) started in its own session with its output in a log file, waited for until its
health URL answers, and stopped with SIGTERM and then its whole process group; plus `appliance
serve` on a work folder (a config there, its own data directory) and `appliance` commands against
that folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.kit.machine import log
from bench.kit.paths import ROOT

# The top of a config for benches of the engine alone: no keys, budgets, semantic cache or trace store.
ENGINE_ONLY = """[auth]
mode = "open"
[budgets]
enabled = false
[cache]
enabled = false
[tracing]
store = false
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    health_path: str
    model: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        """Start the process and wait until its health URL answers 200; on an early exit or a timeout
        the process group is killed and ServerFailed says why, with the log's tail."""
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "wb")  # the child keeps its own descriptor
        log(f"{self.name}: starting: {' '.join(self.cmd)}")
        self.proc = subprocess.Popen(
            self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
        )
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base + self.health_path, timeout=2.0)
                if r.status_code == 200:
                    log(f"{self.name}: up (pid {self.proc.pid}, port {self.port})")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self._kill_group()
        raise ServerFailed(f"{self.name} was not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def peak_rss_kib(self) -> int | None:
        """VmHWM of the server process (the python interpreter or the llama-server binary)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def children(self) -> list[int]:
        if self.proc is None:
            return []
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait for a clean exit, SIGKILL the process group after `grace` seconds."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: no exit {grace:.0f} s after SIGTERM; killing it")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        # anything it started in its own session goes with it
        self._kill_group()
        code = self.proc.returncode
        # uvicorn re-raises the SIGTERM it caught once it has shut down cleanly, hence -15
        log(f"{self.name}: stopped (exit status {code}{' = SIGTERM' if code == -signal.SIGTERM else ''})")
        return self.proc.returncode

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# --- `appliance serve` on a work folder -----------------------------------------------------------

def write_config(workdir: Path, config: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "models.toml").write_text(config)


def start(workdir: Path, timeout: float = 120.0) -> Server:
    """`appliance serve` on the work folder's models.toml, its data in `home` and its output in
    `server.log` there; returns once /health answers (its URL is `.base`; stop it with `.stop()`)."""
    port = free_port()
    server = Server("appliance", [sys.executable, "-m", "appliance.cli.main", "serve", "--config", str(workdir / "models.toml"),
                                  "--port", str(port)],
                    port, "/health", "", env={"APPLIANCE_HOME": str(workdir / "home")}, log_path=workdir / "server.log", cwd=ROOT)
    server.start(timeout)
    return server


def cli(workdir: Path, *args: str) -> str:
    """An `appliance` command against the work folder's config and data directory."""
    env = {**os.environ, "APPLIANCE_HOME": str(workdir / "home")}
    done = subprocess.run([sys.executable, "-m", "appliance.cli.main", *args, "--config", str(workdir / "models.toml")],
                          env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout
