"""Start and stop `appliance serve` for a bench: a config written to a work folder, its own data
directory, a free port, and a wait until /health answers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import tomlkit
from tomlkit.toml_document import TOMLDocument

from policy.budgets import Price

ROOT = Path(__file__).resolve().parent.parent

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


def cli(workdir: Path, *args: str) -> str:
    """An `appliance` command against the work folder's config and data directory."""
    env = {**os.environ, "APPLIANCE_HOME": str(workdir / "home")}
    done = subprocess.run([sys.executable, "-m", "appliance.cli", *args, "--config", str(workdir / "models.toml")],
                          env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout


def fleet_document(fleet: Path) -> TOMLDocument:
    """A fleet file with its relative paths (adapters, calibrations: beside the fleet file) and `~`
    made absolute, so that a copy in a work folder reads the same files."""
    doc = tomlkit.parse(fleet.read_text())
    for model in doc.get("models", []):
        if "path" in model:
            model["path"] = str(Path(str(model["path"])).expanduser())
        for adapter in model.get("adapters", []):
            adapter["path"] = str((fleet.parent / Path(str(adapter["path"])).expanduser()).resolve())
    for route in doc.get("routes", []):
        if "calibration" in route:
            route["calibration"] = str((fleet.parent / str(route["calibration"])).resolve())
    return doc


def fleet_prices(doc: TOMLDocument) -> dict[str, Price]:
    """Each model's price by alias, as the ledger charges it (an adapter costs what its base does)."""
    return {str(m["alias"]): Price.per_million(float(m.get("price_input_per_mtok", 0)), float(m.get("price_output_per_mtok", 0)))
            for m in doc.get("models", [])}


def write_config(workdir: Path, config: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "models.toml").write_text(config)


def start(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`appliance serve` on the work folder, its output in `server.log` there."""
    port = free_port()
    env = {**os.environ, "APPLIANCE_HOME": str(workdir / "home")}
    with open(workdir / "server.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(workdir / "models.toml"), "--port", str(port)],
                                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_until_up(proc, f"{base}/health", 120, "the appliance did not start")
    return proc, base


def wait_until_up(proc: subprocess.Popen[bytes], url: str, timeout_s: float, failure: str) -> None:
    """Polls `url` until it answers 200; kills the process and raises `failure` if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(failure)
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
