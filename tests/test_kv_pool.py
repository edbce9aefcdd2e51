"""A KV pool smaller than every slot at full length (kv_tokens): requests that outgrow it wait in
host RAM and resume where they stopped; every request still gets its whole answer."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from appliance.config.settings import ConfigError, parse_settings
from tests.conftest import CHAT_MODEL, config_text, start_server, stop_server


def swapped(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(rf'appliance_kv_swapped_requests_total{{model="{CHAT_MODEL}"}} (\S+)', text)
    assert match, "no appliance_kv_swapped_requests metric"
    return float(match.group(1))


def test_requests_outgrowing_a_shared_pool_all_finish(tmp_path: Path) -> None:
    # four slots that may each hold 512 tokens, sharing 512 cells: four answers of 200 tokens cannot all fit
    server = start_server(tmp_path, config_text(slots=4, context_length=512, embeddings=False, model_extra="kv_tokens = 512"))
    try:
        health = server.health()["models"][CHAT_MODEL]
        assert health["slots_total"] == 4

        async def ask(i: int) -> dict:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
                body = {"model": CHAT_MODEL, "max_tokens": 200, "temperature": 0, "logit_bias": {"0": -100, "2": -100},
                        "messages": [{"role": "user", "content": f"Tell a long story about dragon number {i}."}]}
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

        async def run() -> list[dict]:
            return await asyncio.gather(*(ask(i) for i in range(4)))

        answers = asyncio.run(run())
        for a in answers:
            assert a["choices"][0]["finish_reason"] == "length"
            assert a["usage"]["completion_tokens"] == 200
            assert len(a["choices"][0]["message"]["content"]) > 200
        assert swapped(server.base_url) >= 1
        # the pool is whole again: a request that fills a slot's context alone still runs
        server.wait_idle(timeout=30)
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
            "model": CHAT_MODEL, "max_tokens": 400, "temperature": 0, "logit_bias": {"0": -100, "2": -100},
            "messages": [{"role": "user", "content": "Tell a long story about a castle."}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
        assert "Traceback" not in server.log.read_text()
    finally:
        stop_server(server)


def test_kv_tokens_is_checked_against_the_layout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.kv_tokens: needs batch_invariant = false"):
        parse_settings(config_text(embeddings=False, model_extra="batch_invariant = true\nkv_tokens = 4096"), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"models\[0\]\.kv_tokens: expected an integer from context_length \(2048\)"):
        parse_settings(config_text(embeddings=False, model_extra="kv_tokens = 1024"), "m.toml", tmp_path)
    ok = parse_settings(config_text(slots=8, embeddings=False, model_extra="kv_tokens = 4096"), "m.toml", tmp_path)
    assert ok.models[0].kv_tokens == 4096


def test_the_memory_estimate_counts_the_shared_pool() -> None:
    from appliance.fleet.files import package_file
    from appliance.fleet.memory import estimate
    from tests.conftest import MODEL_FILE

    path = package_file(MODEL_FILE)
    whole = estimate(path, 32, 4096, "f16", kv_unified=True)
    pooled = estimate(path, 32, 4096, "f16", kv_unified=True, kv_tokens=8 * 4096)
    per_slot = estimate(path, 8, 4096, "f16", kv_unified=True)
    assert pooled.kv == per_slot.kv and whole.kv == 4 * pooled.kv
