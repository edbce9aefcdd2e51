"""Continuous batching over real HTTP: greedy output is batch-invariant where a model asks for it
(batch_invariant = true), a full queue answers 503 with Retry-After, and a client that goes away
frees its slot."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, INVARIANT, MODEL_FILE, Server, config_text, start_server, stop_server

PROMPTS = [
    "Write a poem about the sea.",
    "Explain photosynthesis to a child.",
    "List five prime numbers and explain why each is prime.",
    "What is the capital of France? Tell me about its history.",
    "Write a Python function that reverses a list, and explain it.",
    "Describe a cat in detail.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]
# A long shared preamble pushes each sequence's KV past 512 cells, where llama.cpp's kernels
# switch paths (split-KV attention); invariance must hold there too.
PREAMBLE = "You are a careful assistant who answers questions about science, cooking and history. " * 40


@pytest.fixture(scope="module")
def invariant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("invariant"), config_text(embeddings=False, model_extra=INVARIANT))
    yield srv
    stop_server(srv)


def messages(question: str, system: str | None = None) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": "user", "content": question}]


async def ask(client: openai.AsyncOpenAI, question: str, max_tokens: int, system: str | None = None, delay: float = 0.0) -> str:
    await asyncio.sleep(delay)
    r = await client.chat.completions.create(model=CHAT_MODEL, messages=messages(question, system), max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


async def alone_and_together(server: Server, max_tokens: int, system: str | None = None) -> tuple[list[str], list[str]]:
    client = server.async_client(timeout=600)
    alone = [await ask(client, q, max_tokens, system) for q in PROMPTS]
    # staggered starts: requests join the batch mid-flight, while others prefill or decode
    together = await asyncio.gather(*(ask(client, q, max_tokens, system, delay=0.15 * i) for i, q in enumerate(PROMPTS)))
    await client.close()
    return alone, list(together)


def test_eight_concurrent_greedy_requests_match_their_solo_runs(invariant_server: Server) -> None:
    server = invariant_server
    alone, together = asyncio.run(alone_and_together(server, 96))
    assert all(alone) and sum(map(len, alone)) > 8 * 100
    for question, a, b in zip(PROMPTS, alone, together):
        assert a == b, f"{question!r} changed when batched:\nalone:    {a!r}\ntogether: {b!r}"


def test_invariance_past_512_kv_cells(invariant_server: Server) -> None:
    server = invariant_server
    alone, together = asyncio.run(alone_and_together(server, 48, PREAMBLE))
    for question, a, b in zip(PROMPTS, alone, together):
        assert a == b, f"{question!r} changed when batched:\nalone:    {a!r}\ntogether: {b!r}"


def test_same_text_whatever_shares_the_batch(invariant_server: Server) -> None:
    server = invariant_server
    async def run() -> list[str]:
        client = server.async_client(timeout=600)
        target = PROMPTS[3]
        outputs = [await ask(client, target, 64)]
        for companions in ([PROMPTS[0]], PROMPTS[4:8], PROMPTS[:3] + PROMPTS[5:]):
            results = await asyncio.gather(ask(client, target, 64, delay=0.05), *(ask(client, q, 80) for q in companions))
            outputs.append(results[0])
        await client.close()
        return outputs

    outputs = asyncio.run(run())
    assert len(set(outputs)) == 1, outputs


def _stream_and_drop(server: Server, tokens_before_drop: int) -> None:
    body = {"model": CHAT_MODEL, "messages": messages("Write a very long story about a dragon."), "max_tokens": 1500,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= tokens_before_drop:
                    break


def test_disconnected_stream_frees_its_slot(server: Server) -> None:
    server.wait_idle()
    started = time.monotonic()
    _stream_and_drop(server, 5)
    stats = server.wait_idle(timeout=5)
    assert stats["slots_busy"] == 0
    # 1,500 tokens take tens of seconds here; the slot must come back long before that
    assert time.monotonic() - started < 8
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'appliance_requests_total{{endpoint="chat",model="{CHAT_MODEL}",status="cancelled"}}' in metrics


def test_disconnected_non_streamed_request_frees_its_slot(server: Server) -> None:
    server.wait_idle()
    body = {"model": CHAT_MODEL, "messages": messages("Write a very long story about a dragon."), "max_tokens": 1500, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1.5)
    server.wait_idle(timeout=5)


@pytest.fixture()
def tiny_server(tmp_path: Path) -> Server:
    srv = start_server(tmp_path / "tiny", config_text(slots=1, max_queue=1, embeddings=False))
    yield srv
    stop_server(srv)


def test_full_queue_is_503_with_retry_after(tiny_server: Server) -> None:
    body = {"model": CHAT_MODEL, "messages": messages("Write a very long story about a dragon."), "max_tokens": 400, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as http:
            tasks = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.5)  # one generating, one waiting: the queue (size 1) is full
            rejected = await http.post("/v1/chat/completions", json=body)
            for t in tasks:
                t.cancel()
            return [rejected]

    (rejected,) = asyncio.run(run())
    assert rejected.status_code == 503
    assert rejected.headers["Retry-After"] == "1"
    assert rejected.json()["error"]["code"] == "overloaded"
    tiny_server.wait_idle(timeout=10)


@pytest.fixture(scope="module")
def kquant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The bundled model requantized to Q4_K_M by the suite: its K-quant tensors take llama.cpp's tiled
    matmul from 8 rows up and a vector kernel below, which round differently."""
    from appliance.fleet.admin import quantize
    from appliance.fleet.files import package_file

    work = tmp_path_factory.mktemp("kquant")
    source = package_file(MODEL_FILE)
    path = work / "smollm2.Q4_K_M.gguf"
    quantize(source, path, "Q4_K_M", threads=2, allow_requantize=True)
    srv = start_server(work, config_text(embeddings=False, model_extra=INVARIANT).replace(f'package_file = "{MODEL_FILE}"', f'path = "{path}"'))
    yield srv
    stop_server(srv)


def test_k_quant_weights_stay_batch_invariant(kquant_server: Server) -> None:
    alone, together = asyncio.run(alone_and_together(kquant_server, 48))
    assert all(alone)
    for question, a, b in zip(PROMPTS, alone, together):
        assert a == b, f"{question!r} changed when batched:\nalone:    {a!r}\ntogether: {b!r}"


def test_the_kernel_choice_is_made_once_and_an_explicit_environment_wins() -> None:
    script = ("import os\nfrom engines.llamacpp.kernels import choose_matmul_kernels\n"
              "choose_matmul_kernels(invariant=True)\nchoose_matmul_kernels(invariant=False)\n"
              "print(os.environ.get('GGML_CPU_TILED_MM'))\n")
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "0" and "switch kernels" not in ran.stderr
    ran = subprocess.run([sys.executable, "-c", script], env={**env, "GGML_CPU_TILED_MM": "1"}, capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "1" and "K-quant matmuls switch kernels at 8 rows" in ran.stderr
