"""LoRA adapters on the bundled model, over real HTTP. The adapters are real GGUF LoRA files the
test writes with appliance/fleet/lora_files.py (random low-rank updates to every layer's Q and V)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from appliance.fleet.lora_files import BaseShape, LoraAdapter, LoraPair, write_gguf
from appliance.config.settings import ConfigError, parse_settings
from engines.llama_layout import rope_unpermute
from tests.conftest import CHAT_MODEL, INVARIANT, Server, config_text, start_server, stop_server

LAYERS, EMBED, KV = 30, 576, 192  # SmolLM2-135M: 30 layers, 576 wide, 3 KV heads of 64
QUESTION = "Name three colours of the rainbow."


def write_lora(path: Path, seed: int, rank: int = 8) -> Path:
    """Random low-rank updates to every layer's Q and V, written as training writes its adapters."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for layer in range(LAYERS):
        for name, out in (("q_proj", EMBED), ("v_proj", KV)):
            a, b = rng.normal(0, 0.15, (rank, EMBED)), rng.normal(0, 0.15, (out, rank))
            # In Hugging Face's row order, which the writer puts back into llama.cpp's: the file holds
            # these draws as they are (the texts the tests compare come from them).
            pairs[f"model.layers.{layer}.self_attn.{name}"] = LoraPair(a, rope_unpermute(b, 9) if name == "q_proj" else b)
    return write_gguf(LoraAdapter(pairs, alpha=float(rank)), path, BaseShape("llama", heads=9, kv_heads=3, layers=LAYERS))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("lora")
    return {name: write_lora(folder / f"{name}.gguf", seed) for name, seed in (("warm", 1), ("cold", 2), ("late", 3))}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[Server]:
    extra = "".join(f'\n[[models.adapters]]\nname = "{n}"\npath = "{adapters[n]}"\n' for n in ("warm", "cold"))
    extra += f'\n[[routes]]\nalias = "distilled"\ntiers = ["{CHAT_MODEL}:warm", "{CHAT_MODEL}"]\n'  # a distilled tier below its base
    srv = start_server(tmp_path_factory.mktemp("lora-server"), config_text(slots=8, embeddings=False, model_extra=INVARIANT + extra))
    yield srv
    stop_server(srv)


def ask(server: Server, model: str = CHAT_MODEL, adapters: list[dict] | None = None, max_tokens: int = 24) -> str:
    extra = {"adapters": adapters} if adapters is not None else None
    r = server.client(timeout=300).chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0, extra_body=extra)
    return r.choices[0].message.content or ""


def test_adapters_are_listed_as_models(server: Server) -> None:
    ids = {m.id for m in server.client().models.list().data}
    assert {CHAT_MODEL, f"{CHAT_MODEL}:warm", f"{CHAT_MODEL}:cold"} <= ids


def test_scale_zero_is_the_base_model_and_a_scale_changes_the_text(server: Server) -> None:
    base = ask(server)
    assert base
    assert ask(server, adapters=[{"name": "warm", "scale": 0.0}]) == base
    warm = ask(server, f"{CHAT_MODEL}:warm")
    assert warm != base
    assert ask(server, adapters=[{"name": "warm", "scale": 1.0}]) == warm  # the alias uses the configured scale
    assert ask(server, adapters=[{"name": "warm", "scale": 0.5}]) not in (warm, base)
    assert ask(server, f"{CHAT_MODEL}:cold") not in (warm, base)


def test_two_adapters_at_once_give_the_text_each_gives_alone(server: Server) -> None:
    alone = {name: ask(server, f"{CHAT_MODEL}:{name}", max_tokens=48) for name in ("warm", "cold")}
    alone["base"] = ask(server, max_tokens=48)

    async def together() -> list[str]:
        async with server.async_client(timeout=300) as client:
            async def one(model: str) -> str:
                r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=48, temperature=0)
                return r.choices[0].message.content or ""
            return list(await asyncio.gather(one(f"{CHAT_MODEL}:warm"), one(f"{CHAT_MODEL}:cold"), one(CHAT_MODEL)))

    assert asyncio.run(together()) == [alone["warm"], alone["cold"], alone["base"]]


def test_no_adapter_group_starves(server: Server) -> None:
    """4 clients on two adapters and 4 on the base model at once: every group makes progress
    while the others run (they take turns by step), so every request's first token comes before
    any request finishes."""
    models = [f"{CHAT_MODEL}:warm"] * 2 + [f"{CHAT_MODEL}:cold"] * 2 + [CHAT_MODEL] * 4

    async def run() -> list[tuple[float, float]]:
        async with server.async_client(timeout=300) as client:
            start = time.perf_counter()

            async def one(model: str, i: int) -> tuple[float, float]:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Write a long story about the number {i}."}],
                    max_tokens=96, temperature=0, stream=True)
                first = None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and first is None:
                        first = time.perf_counter() - start
                return first or float("inf"), time.perf_counter() - start

            return list(await asyncio.gather(*(one(m, i) for i, m in enumerate(models))))

    timings = asyncio.run(run())
    assert max(first for first, _ in timings) < min(done for _, done in timings), timings


def test_adapters_load_and_unload_at_runtime(server: Server, adapters: dict[str, Path]) -> None:
    admin = httpx.Client(base_url=server.base_url, timeout=60)
    base = ask(server)
    with pytest.raises(openai.NotFoundError):
        ask(server, f"{CHAT_MODEL}:late")
    late_path = server.home / "late.gguf"  # the admin API takes paths inside the data directory (tests/test_admin_paths.py)
    late_path.write_bytes(adapters["late"].read_bytes())
    r = admin.put(f"/admin/models/{CHAT_MODEL}/adapters/late", json={"path": str(late_path), "scale": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["adapter"]["name"] == "late"
    late = ask(server, f"{CHAT_MODEL}:late")
    assert late not in (base, ask(server, f"{CHAT_MODEL}:warm"))
    names = [a["name"] for a in admin.get(f"/admin/models/{CHAT_MODEL}/adapters").json()["adapters"]]
    assert names == ["cold", "late", "warm"]
    models = admin.get("/admin/models").json()["models"]
    assert [m["alias"] for m in models] == [CHAT_MODEL] and len(models[0]["adapters"]) == 3
    assert admin.delete(f"/admin/models/{CHAT_MODEL}/adapters/late").status_code == 200
    with pytest.raises(openai.NotFoundError):
        ask(server, f"{CHAT_MODEL}:late")
    assert ask(server) == base  # the base model was never reloaded or changed
    # errors name what is wrong
    r = admin.delete(f"/admin/models/{CHAT_MODEL}/adapters/late")
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    r = admin.put(f"/admin/models/{CHAT_MODEL}/adapters/x", json={"path": str(server.home / "nonexistent.gguf")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    not_lora = server.home / "not-a-lora.gguf"
    not_lora.write_bytes(b"GGUF" + b"\0" * 64)
    r = admin.put(f"/admin/models/{CHAT_MODEL}/adapters/x", json={"path": str(not_lora)})
    assert r.status_code == 400 and "could not load" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        ask(server, adapters=[{"name": "warm"}, {"name": "warm"}])


def test_an_adapter_registered_in_the_file_is_served_without_loading_the_base_again(server: Server, adapters: dict[str, Path]) -> None:
    """What `appliance distill train` does when it finishes: models.toml gains an adapter under the
    student and the server is asked to apply it; the running base takes the adapter in place."""
    from appliance.config.writer import append_nested

    admin = httpx.Client(base_url=server.base_url, timeout=120)
    config = server.home.parent / "models.toml"

    def row() -> dict:
        return next(m for m in admin.get("/admin/models/loaded").json()["models"] if m["alias"] == CHAT_MODEL and not m["retired"])

    base, loads, before = ask(server), row()["loads"], config.read_text()
    append_nested(config, "models", CHAT_MODEL, "adapters", {"name": "filed", "path": str(adapters["late"])})
    r = admin.post("/admin/config/reload")
    assert r.status_code == 200, r.text
    assert r.json()["change"]["adapters_changed"] == [CHAT_MODEL] and r.json()["change"]["changed"] == []
    filed = ask(server, f"{CHAT_MODEL}:filed")
    assert filed not in (base, ask(server, f"{CHAT_MODEL}:warm"))
    assert row()["loads"] == loads and not row()["retired"]  # the same engine, never loaded again
    assert [a["name"] for a in admin.get(f"/admin/models/{CHAT_MODEL}/adapters").json()["adapters"]] == ["cold", "filed", "warm"]
    config.write_text(before)  # the operator takes it out by hand
    r = admin.post("/admin/config/reload")
    assert r.status_code == 200 and r.json()["change"]["adapters_changed"] == [CHAT_MODEL], r.text
    with pytest.raises(openai.NotFoundError):
        ask(server, f"{CHAT_MODEL}:filed")
    assert ask(server) == base and row()["loads"] == loads


def test_an_adapter_file_the_engine_cannot_read_leaves_the_running_model_as_it_was(server: Server) -> None:
    from appliance.config.writer import append_nested

    admin = httpx.Client(base_url=server.base_url, timeout=120)
    config = server.home.parent / "models.toml"
    junk = server.home / "junk-adapter.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    before, base = config.read_text(), ask(server)
    append_nested(config, "models", CHAT_MODEL, "adapters", {"name": "junk", "path": str(junk)})
    r = admin.post("/admin/config/reload")
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loadable", r.text
    config.write_text(before)
    with pytest.raises(openai.NotFoundError):
        ask(server, f"{CHAT_MODEL}:junk")
    assert ask(server) == base and ask(server, f"{CHAT_MODEL}:warm")
    assert [a["name"] for a in admin.get(f"/admin/models/{CHAT_MODEL}/adapters").json()["adapters"]] == ["cold", "warm"]


def test_a_route_tier_runs_its_adapter(server: Server) -> None:
    """A route's "alias:adapter" tier answers as the adapter does, and says which tier it was."""
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
        "model": "distilled", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-route-model"] == f"{CHAT_MODEL}:warm" and r.json()["model"] == f"{CHAT_MODEL}:warm"
    assert r.json()["choices"][0]["message"]["content"] == ask(server, adapters=[{"name": "warm"}]) != ask(server)


def test_adapter_config_errors_name_the_key(tmp_path: Path) -> None:
    route = '\n[[routes]]\nalias = "r"\ntiers = ["{tier}"]\n'
    with pytest.raises(ConfigError, match=rf"routes\[0\]\.tiers: '{CHAT_MODEL}:nope': the model '{CHAT_MODEL}' has no adapter 'nope'"):
        parse_settings(config_text(embeddings=False, model_extra=route.format(tier=f"{CHAT_MODEL}:nope")), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"routes\[0\]\.tiers: 'ghost' is not the alias"):
        parse_settings(config_text(embeddings=False, model_extra=route.format(tier="ghost:a")), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapters\[0\]\.path"):
        parse_settings(config_text(embeddings=False, model_extra='[[models.adapters]]\nname = "a"'), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapters\[0\]\.name"):
        parse_settings(config_text(embeddings=False, model_extra='[[models.adapters]]\nname = "a:b"\npath = "x.gguf"'), "m.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapters\[1\]\.name"):
        parse_settings(config_text(embeddings=False, model_extra='[[models.adapters]]\nname = "a"\npath = "x"\n[[models.adapters]]\nname = "a"\npath = "y"'), "m.toml", tmp_path)
