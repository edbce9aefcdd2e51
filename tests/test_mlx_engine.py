"""The MLX engine over real HTTP, on the bundled GGUF converted at load (mlx[cpu] here)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server

pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")


@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("mlx"), config_text(slots=4, embeddings=False, model_extra='engine = "mlx"'))
    yield server
    stop_server(server)


def ask(server: Server, question: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return server.client(timeout=300).chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": question}], temperature=0, **kwargs)  # type: ignore[arg-type]


def test_chat_answers_and_counts_tokens(mlx_server: Server) -> None:
    listed = {m.id: m for m in mlx_server.client().models.list().data}
    assert listed[CHAT_MODEL].model_extra["meta"]["engine"] == "mlx"  # type: ignore[index]
    r = ask(mlx_server, "What is the capital of France?", max_tokens=16)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.prompt_tokens > 20 and 0 < r.usage.completion_tokens <= 16


def test_streaming_stop_strings_and_max_tokens(mlx_server: Server) -> None:
    stream = mlx_server.client(timeout=300).chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}], temperature=0,
        max_tokens=60, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "1" in text and usage is not None
    cut = ask(mlx_server, "Count from 1 to 20, separated by commas.", max_tokens=60, stop=["5"])
    assert cut.choices[0].finish_reason == "stop" and "5" not in (cut.choices[0].message.content or "")
    short = ask(mlx_server, "Write a long poem about the sea.", max_tokens=5)
    assert short.choices[0].finish_reason == "length" and short.usage is not None and short.usage.completion_tokens == 5


def test_concurrent_requests_join_one_batch(mlx_server: Server) -> None:
    questions = ["What is the capital of France?", "What is 2 + 2?", "Name a colour of the sky.", "What is the capital of Italy?"]

    async def together() -> list[str]:
        async with mlx_server.async_client(timeout=300) as client:
            async def one(q: str) -> str:
                r = await client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": q}], max_tokens=12, temperature=0)
                return r.choices[0].message.content or ""
            return list(await asyncio.gather(*(one(q) for q in questions)))

    answers = asyncio.run(together())
    assert all(answers) and "Paris" in answers[0] and "4" in answers[1] and "blue" in answers[2]
    alone = [ask(mlx_server, q, max_tokens=12).choices[0].message.content for q in questions]
    assert alone == answers  # greedy: batched equals alone


def test_json_schema_output_and_seeds(mlx_server: Server) -> None:
    """llama.cpp's grammar and seeded sampler over MLX's logits, through the GGUF's vocabulary."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    shaped = ask(mlx_server, "Describe the weather in Paris as JSON.", max_tokens=40,
                 response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    value = json.loads(shaped.choices[0].message.content or "")
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)

    def draw(seed: int) -> str:
        r = mlx_server.client(timeout=300).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "Write a sentence about a cat."}], max_tokens=12,
            temperature=1.0, seed=seed)
        return r.choices[0].message.content or ""

    first = draw(7)
    assert draw(7) == first  # the same seed, the same draw
    assert len({first, draw(8), draw(9)}) > 1  # and other seeds, other draws


def test_what_mlx_cannot_do_yet_is_refused_clearly(mlx_server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match="has no adapter 'x'"):
        mlx_server.client(timeout=300).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            extra_body={"adapters": [{"name": "x"}]})


def test_a_shared_prefix_is_served_from_the_prompt_cache(mlx_server: Server) -> None:
    system = "You answer questions about the weather for a small sailing club, briefly and politely. " * 6

    def chat(question: str) -> openai.types.chat.ChatCompletion:
        return mlx_server.client(timeout=300).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=10, temperature=0)

    first = chat("Is it windy today?")
    again = chat("Is it windy today?")
    other = chat("Will it rain tomorrow?")
    assert first.usage is not None and again.usage is not None and other.usage is not None
    assert first.usage.prompt_tokens > 100
    cached = [r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0 for r in (first, again, other)]  # type: ignore[union-attr]
    assert cached[1] == again.usage.prompt_tokens - 1  # all but the last token, which is computed for its logits
    assert first.usage.prompt_tokens - 20 < cached[2] < other.usage.prompt_tokens  # the system prompt, not the question
    assert again.choices[0].message.content == first.choices[0].message.content
