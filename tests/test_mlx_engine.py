"""The MLX engine over real HTTP, on the bundled GGUF converted at load (mlx[cpu] here)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from appliance.fleet.lora_files import BaseShape, LoraAdapter, LoraPair, write_mlx
from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server

pytest.importorskip("mlx_lm", reason="the installer installs mlx[cpu] and mlx-lm on Linux")


def write_mlx_adapter(folder: Path, seed: int, modules: tuple[str, ...] = ("q_proj", "v_proj"), rank: int = 8) -> Path:
    """A real mlx-lm LoRA adapter (random low-rank pairs) for the bundled model's attention."""
    from appliance.fleet.files import package_file
    from engines.llamacpp.runtime import Model

    meta = Model(package_file(MODEL_FILE), vocab_only=True)
    try:
        hidden, layers = int(meta.meta("llama.embedding_length") or 0), int(meta.meta("llama.block_count") or 0)
        heads, kv_heads = int(meta.meta("llama.attention.head_count") or 0), int(meta.meta("llama.attention.head_count_kv") or 0)
    finally:
        meta.close()
    out = {"q_proj": hidden, "k_proj": hidden // heads * kv_heads, "v_proj": hidden // heads * kv_heads, "o_proj": hidden}
    rng = np.random.default_rng(seed)
    pairs = {f"model.layers.{layer}.self_attn.{module}": LoraPair(0.02 * rng.normal(size=(rank, hidden)), 0.02 * rng.normal(size=(out[module], rank)))
             for layer in range(layers) for module in modules}
    # alpha / rank = 20, mlx-lm's default scale
    return write_mlx(LoraAdapter(pairs, alpha=20.0 * rank), folder, BaseShape("llama", heads, kv_heads, layers))


@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("mlx")
    adapter = write_mlx_adapter(work / "tone", seed=1)
    extra = f'engine = "mlx"\n\n[[models.adapters]]\nname = "tone"\npath = "{adapter}"\n'
    server = start_server(work, config_text(slots=4, embeddings=False, model_extra=extra))
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


def test_lora_adapters_per_request_without_reloading_the_base(mlx_server: Server) -> None:
    question = "Tell me about the ocean."

    def answer(model: str = CHAT_MODEL, **extra: object) -> str:
        r = mlx_server.client(timeout=300).chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0, extra_body=extra or None)
        return r.choices[0].message.content or ""

    base = answer()
    assert answer(adapters=[{"name": "tone", "scale": 0.0}]) == base  # scale 0 is the base model
    tuned = answer(f"{CHAT_MODEL}:tone")
    assert tuned != base
    assert answer(adapters=[{"name": "tone", "scale": 1.0}]) == tuned

    # Base and adapter requests at once: each set is its own batch, the sets take turns.
    async def together() -> list[str]:
        async with mlx_server.async_client(timeout=300) as client:
            async def one(model: str) -> str:
                r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                         max_tokens=12, temperature=0)
                return r.choices[0].message.content or ""
            return list(await asyncio.gather(one(CHAT_MODEL), one(f"{CHAT_MODEL}:tone"), one(CHAT_MODEL), one(f"{CHAT_MODEL}:tone")))

    assert asyncio.run(together()) == [base, tuned, base, tuned]

    # At runtime through the admin API: load a second adapter, use it, unload it.
    admin = f"{mlx_server.base_url}/admin/models/{CHAT_MODEL}/adapters"
    other = write_mlx_adapter(mlx_server.home / "adapters" / "other", seed=2, modules=("k_proj", "o_proj"))  # the API takes paths in the data dir
    loaded = httpx.put(f"{admin}/other", json={"path": str(other), "scale": 1.0}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert answer(f"{CHAT_MODEL}:other") not in (base, tuned)
    assert {a["name"] for a in httpx.get(admin, timeout=10).json()["adapters"]} == {"tone", "other"}
    assert httpx.delete(f"{admin}/other", timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError, match="has no adapter 'other'"):
        answer(f"{CHAT_MODEL}:other")
    assert answer() == base  # unloading left the base as it was
    empty = mlx_server.home / "adapters" / "empty"
    empty.mkdir(parents=True)
    broken = httpx.put(f"{admin}/bad", json={"path": str(empty)}, timeout=60)
    assert broken.status_code == 400 and "not an mlx-lm LoRA adapter" in broken.json()["error"]["message"]


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


def test_speculative_decoding_with_the_model_as_its_own_draft_equals_plain_decoding(mlx_server: Server,
                                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    draft = f'\n[[models]]\nalias = "draft"\nkind = "draft"\nengine = "mlx"\npackage_file = "{MODEL_FILE}"\ncontext_length = 2048\nslots = 1\n'
    # Fixed draft length: as its own draft the model cannot pay (a draft token costs a target step),
    # so the measured decision would never draft; this test is about the path, not the decision.
    config = config_text(slots=2, embeddings=False, model_extra='engine = "mlx"\ndraft_model = "draft"\nspeculation_fixed_tokens = 4') + draft
    speculative = start_server(tmp_path_factory.mktemp("mlx-draft"), config)
    try:
        questions = ["Count from 1 to 10.", "What is the capital of France?", "Write one sentence about rain."]
        plain = [ask(mlx_server, q, max_tokens=24).choices[0].message.content for q in questions]
        assert [ask(speculative, q, max_tokens=24).choices[0].message.content for q in questions] == plain

        async def together() -> list[str]:
            async with speculative.async_client(timeout=300) as client:
                async def one(q: str) -> str:
                    r = await client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": q}],
                                                             max_tokens=24, temperature=0)
                    return r.choices[0].message.content or ""
                return list(await asyncio.gather(*(one(q) for q in questions[:2])))

        assert asyncio.run(together()) == plain[:2]  # one speculates, the other is batched beside it
        metrics = httpx.get(f"{speculative.base_url}/metrics", timeout=10).text
        accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("appliance_speculation_accepted_tokens_total{"))
        assert accepted > 0  # its own draft agrees with it nearly always
    finally:
        stop_server(speculative)


def test_a_draft_that_cannot_pay_is_measured_and_not_used(tmp_path: Path) -> None:
    """Without a fixed draft length the engine measures what verifying and drafting cost and
    drafts only where that pays. The model as its own draft never pays: a draft token costs a
    target step. So the request decodes in the batch, and nothing is drafted."""
    from appliance.fleet.files import package_file
    from engines.interface import GenerationRequest, SamplingParams, TokenEvent
    from engines.mlx.convert import gguf_to_mlx
    from engines.mlx.engine import MlxConfig, MlxEngine

    folder = tmp_path / "m"
    gguf_to_mlx(package_file(MODEL_FILE), folder)
    engine = MlxEngine(MlxConfig(folder, 2, 1024, 4, draft=folder, draft_max_tokens=4))
    try:
        tokens = tuple(engine.tokenize("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", add_special=False, parse_special=True))

        async def run() -> int:
            return sum([isinstance(e, TokenEvent) async for e in engine.generate(GenerationRequest("r", tokens, 6, SamplingParams(temperature=0)))])

        assert asyncio.run(run()) >= 1
        speculation = engine.stats().speculation
        assert speculation is not None and speculation.drafted == 0 and speculation.verify_steps == 0
    finally:
        engine.close()


def test_logit_bias_penalties_and_n_as_on_llamacpp(mlx_server: Server) -> None:
    """engines/sampling.py's adjustments over MLX's log-probabilities, on both of its samplers (its
    own argmax for greedy, llama.cpp's chain for a seeded draw), and n choices on seed + i."""
    from appliance.fleet.files import package_file
    from engines.llamacpp.runtime import Model

    vocab = Model(package_file(MODEL_FILE), vocab_only=True)
    (token,) = vocab.tokenize(" Paris", add_special=False, parse_special=False)
    vocab.close()
    forced = ask(mlx_server, "Hi", max_tokens=4, logit_bias={str(token): 100})
    assert forced.choices[0].message.content == " Paris" * 4
    repetitive = "Count from 1 to 20, separated by commas."  # a comma after each number: penalised from the second on
    plain = ask(mlx_server, repetitive, max_tokens=30).choices[0].message.content
    penalised = [ask(mlx_server, repetitive, max_tokens=30, frequency_penalty=2.0).choices[0].message.content for _ in range(2)]
    assert penalised[0] == penalised[1] != plain

    def draw(**kwargs: object) -> openai.types.chat.ChatCompletion:
        return mlx_server.client(timeout=300).chat.completions.create(  # type: ignore[call-overload]
            model=CHAT_MODEL, messages=[{"role": "user", "content": "Write a sentence about a cat."}], max_tokens=12,
            temperature=1.0, frequency_penalty=1.0, **kwargs)

    many, single = draw(seed=7, n=2), draw(seed=8)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[1].message.content == single.choices[0].message.content
