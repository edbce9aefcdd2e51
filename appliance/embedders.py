"""Sentence embedders for the semantic cache, behind one small interface: `embed(texts)` gives
L2-normalised float32 rows. Each embedder's model is owned by one thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from appliance.registry import LoadedModel


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


def _normalise(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


class EngineEmbedder:
    """An embedding model served by one of the appliance's own engines (`kind = "embedding"`)."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.name = f"engine-{model.settings.alias}"
        self.dimension = 0  # known after `start()`

    async def start(self) -> None:
        self.dimension = int((await self.embed(["probe"])).shape[1])

    async def embed(self, texts: list[str]) -> np.ndarray:
        engine = self.model.engine
        tokens = [engine.tokenize(t, add_special=engine.add_bos(), parse_special=False) for t in texts]
        return _normalise(np.asarray(await engine.embed(tokens), dtype=np.float32))

    def close(self) -> None:
        pass  # the registry owns the engine


class OnnxSentenceEmbedder:
    """A sentence-transformers model exported to ONNX, run by onnxruntime on its own thread:
    WordPiece tokens in, mean-pooled over the attention mask, L2-normalised."""

    def __init__(self, name: str, model_path: str, vocab_path: str, threads: int = 1, max_tokens: int = 128) -> None:
        """`vocab_path`: the model's WordPiece vocabulary (uncased). One thread: beside llama.cpp's
        threads on a small box, a second one made embedding slower, not faster."""
        import onnxruntime
        from tokenizers import BertWordPieceTokenizer

        self.name = name
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = BertWordPieceTokenizer(vocab_path, lowercase=True)
        self._tokenizer.enable_truncation(max_tokens)
        self._tokenizer.enable_padding()  # to the longest input of a batch
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"embedder-{name}")
        self.dimension = int(self._run(["probe"]).shape[1])

    def _run(self, texts: list[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        if hidden.ndim == 3:  # token states: mean over the real tokens
            weights = mask[:, :, None].astype(np.float32)
            hidden = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return _normalise(hidden)

    def embed_now(self, texts: list[str]) -> np.ndarray:
        """On the caller's thread: for tools and benches, not the event loop."""
        return self._thread.submit(self._run, texts).result()

    async def embed(self, texts: list[str]) -> np.ndarray:
        return await asyncio.wrap_future(self._thread.submit(self._run, texts))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
