"""The prefix cache over real HTTP: a shared system prompt is computed once and copied between
slots, an evicted prefix comes back from host RAM, and greedy output never changes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config.settings import ConfigError, parse_settings
from tests.conftest import CHAT_MODEL, INVARIANT, Server, config_text, start_server, stop_server

SYSTEM = "You are the help desk of a bicycle shop. Answer briefly and politely, and never invent prices. " * 30
QUESTIONS = ["How do I fix a flat tyre?", "What is a derailleur?", "Should I oil my chain?"]
# Long, unrelated prompts that push the shared prefix out of both slots.
OTHERS = [f"Story {i}: " + "The llama walked over the hill to see the alpaca who lived by the lake. " * 30 for i in range(2)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    on = start_server(tmp_path_factory.mktemp("prefix-on"), config_text(slots=2, embeddings=False, model_extra=INVARIANT))
    off = start_server(tmp_path_factory.mktemp("prefix-off"), config_text(slots=2, embeddings=False, model_extra=INVARIANT + "prefix_cache = false"))
    yield on, off
    stop_server(on)
    stop_server(off)


async def ask(server: Server, system: str, question: str, delay: float = 0.0) -> tuple[str, int, int]:
    await asyncio.sleep(delay)
    async with server.async_client(timeout=600) as client:
        r = await client.chat.completions.create(
            model=CHAT_MODEL, max_tokens=40, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'(appliance_prefix_\w+?)(?:_total)?\{model="' + re.escape(CHAT_MODEL) + r'"(?:,source="(\w+)")?\} (\S+)', line)
        if m:
            out[m[1] + (f":{m[2]}" if m[2] else "")] = float(m[3])
    return out


def test_shared_prefix_is_computed_once_and_the_text_is_unchanged(servers: tuple[Server, Server]) -> None:
    on, off = servers

    async def run(server: Server) -> list[tuple[str, int, int]]:
        # Two arrive together (the second waits for the first's prefill, then copies it), the
        # third arrives while both slots hold the prefix.
        first = await asyncio.gather(ask(server, SYSTEM, QUESTIONS[0]), ask(server, SYSTEM, QUESTIONS[1], delay=0.1))
        return [*first, await ask(server, SYSTEM, QUESTIONS[2])]

    cold = asyncio.run(run(off))
    warm = asyncio.run(run(on))
    assert [c[0] for c in cold] == [w[0] for w in warm] and all(c[0] for c in cold)
    assert all(c[2] == 0 for c in cold)
    prompt_tokens = cold[0][1]
    assert prompt_tokens > 600
    # the system prompt and the template around it are shared; each question is not
    assert warm[0][2] == 0
    assert all(prompt_tokens - 30 < w[2] < w[1] for w in warm[1:])
    m = metrics(on)
    assert m["appliance_prefix_reused_tokens:copy"] >= warm[1][2]
    assert 0.4 < m["appliance_prefix_cache_hit_ratio"] < 1
    assert metrics(off)["appliance_prefix_cache_hit_ratio"] == 0


def test_an_evicted_prefix_comes_back_from_host_ram(servers: tuple[Server, Server]) -> None:
    on, off = servers
    before = metrics(on)

    async def run(server: Server) -> tuple[str, int, int]:
        await asyncio.gather(*(ask(server, other, "Go on.") for other in OTHERS))
        return await ask(server, SYSTEM, QUESTIONS[0])

    text, prompt_tokens, cached = asyncio.run(run(on))
    cold_text, _, _ = asyncio.run(run(off))
    assert text == cold_text
    assert cached >= prompt_tokens - 30
    after = metrics(on)
    assert after["appliance_prefix_reused_tokens:host"] - before.get("appliance_prefix_reused_tokens:host", 0) == cached
    assert after["appliance_prefix_host_saves"] >= 1 and after["appliance_prefix_host_bytes"] > 0


def test_prefix_cache_settings_are_checked() -> None:
    base = config_text(embeddings=False)
    with pytest.raises(ConfigError, match=r"models\[0\]\.prefix_cache_host_mb"):
        parse_settings(base.replace("threads = 2", "threads = 2\nprefix_cache_host_mb = -1"), "m.toml", Path("."))
    with pytest.raises(ConfigError, match=r"models\[0\]\.prefix_cache"):
        parse_settings(base.replace("threads = 2", 'threads = 2\nprefix_cache = "yes"'), "m.toml", Path("."))


def test_host_ram_keeps_the_most_recently_used_prefixes_under_its_limit(tmp_path: Path) -> None:
    # One slot, and room in host RAM for one saved prompt (~8 MB each here), not two.
    server = start_server(tmp_path / "lru", config_text(slots=1, embeddings=False, model_extra=INVARIANT + "prefix_cache_host_mb = 12"))
    try:
        first = asyncio.run(ask(server, SYSTEM, QUESTIONS[0]))  # A in the slot
        story = asyncio.run(ask(server, OTHERS[0], "Go on."))  # B in the slot; A saved
        asyncio.run(ask(server, OTHERS[1], "Go on."))  # C in the slot; B saved, A dropped
        m = metrics(server)
        assert m["appliance_prefix_host_evictions"] == 1 and m["appliance_prefix_host_entries"] == 1
        assert 0 < m["appliance_prefix_host_bytes"] <= 12 << 20
        again = asyncio.run(ask(server, OTHERS[0], "Go on."))  # B comes back from host RAM while C is saved
        assert again[0] == story[0] and again[2] >= again[1] - 30
        assert metrics(server)["appliance_prefix_host_bytes"] <= 12 << 20
        cold = asyncio.run(ask(server, SYSTEM, QUESTIONS[0]))  # A was the least recently used: computed again
        assert cold[0] == first[0] and cold[2] < 30
    finally:
        stop_server(server)
