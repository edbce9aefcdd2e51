"""KV cache quantization per model: every offered type runs, batch-invariant where promised, and a
combination llama.cpp cannot run is refused at config time, naming the key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appliance.fleet.files import package_file
from appliance.config.settings import ConfigError, parse_settings
from engines.interface import GenerationRequest, SamplingParams, TokenEvent
from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine
from tests.conftest import MODEL_FILE, config_text

PROMPTS = ["The three primary colours are", "A good way to learn a language is"]


async def _generate(engine: LlamaCppEngine, prompt: str) -> list[int]:
    tokens = tuple(engine.tokenize(prompt, add_special=True, parse_special=False))
    out = []
    async for event in engine.generate(GenerationRequest(prompt, tokens, 24, SamplingParams(temperature=0))):
        if isinstance(event, TokenEvent):
            out.append(event.token_id)
    return out


@pytest.mark.parametrize("k, v, invariant", [("q4_0", "q4_0", True), ("q5_1", "q8_0", True), ("bf16", "bf16", True), ("f16", "q4_0", False)])
def test_kv_types_generate_and_stay_invariant(k: str, v: str, invariant: bool) -> None:
    engine = LlamaCppEngine(LlamaCppConfig(package_file(MODEL_FILE), slots=2, context_length=256, batch_tokens=64, threads=2,
                                           max_queue=4, batch_invariant=invariant, kv_type=k, kv_type_v=v))
    try:
        async def run() -> tuple[list[list[int]], list[list[int]]]:
            alone = [await _generate(engine, p) for p in PROMPTS]
            together = await asyncio.gather(*(_generate(engine, p) for p in PROMPTS))
            return alone, list(together)

        alone, together = asyncio.run(run())
        assert all(len(a) == 24 for a in alone)
        if invariant:
            assert alone == together
    finally:
        engine.close()


def test_kv_type_combinations_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.kv_cache_type_v: with batch_invariant = true"):
        parse_settings(config_text(embeddings=False, model_extra='batch_invariant = true\nkv_cache_type_k = "f16"\nkv_cache_type_v = "q4_0"'), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"models\[0\]\.kv_cache_type_k"):
        parse_settings(config_text(embeddings=False, model_extra='kv_cache_type_k = "q3_k"'), "m.toml", tmp_path)
    ok = parse_settings(config_text(embeddings=False, model_extra='batch_invariant = false\nkv_cache_type_k = "f16"\nkv_cache_type_v = "q4_0"'), "m.toml", tmp_path)
    assert (ok.models[0].kv_cache_type, ok.models[0].kv_cache_type_v) == ("f16", "q4_0")
