"""An embedding model exported to ONNX (a sentence-transformers model, say), run by onnxruntime.

One thread owns the session. A request's inputs run together: packed into as few padded forward
passes as `batch_tokens` allows (engines/embedding.py), pooled over each input's real tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import AdapterInfo, EngineClosed, EngineError, EngineOverloaded, EngineStats, GenerationRequest
from engines.embedding import check_lengths, pack, pool, resolve_pooling
from engines.stream import EventStream

log = logging.getLogger("appliance.onnx")


@dataclass(frozen=True)
class OnnxConfig:
    path: Path
    tokenizer: Path  # a `tokenizers` tokenizer.json, or a WordPiece vocab.txt
    context_length: int  # tokens one input may hold
    batch_tokens: int  # padded tokens (inputs x longest) one forward pass holds
    threads: int
    max_queue: int
    pooling: str = "auto"  # mean, cls or last; auto: mean


def load_tokenizer(path: Path) -> Any:
    """A tokenizer that adds the model's special tokens itself and never truncates or pads: the
    engine refuses what is too long and pads per pass."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    if path.suffix == ".json":
        tokenizer = Tokenizer.from_file(str(path))
    else:
        vocab = path.read_text(encoding="utf-8").splitlines()
        # An uncased vocabulary has no capital letters outside its bracketed specials.
        cased = any(t != t.lower() for t in vocab if not (t.startswith("[") and t.endswith("]")))
        tokenizer = BertWordPieceTokenizer(str(path), lowercase=not cased)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class OnnxEngine:
    name = "onnx"
    supports_grammar = False
    supports_logprobs = False
    supports_embeddings = True
    supports_adapters = False
    takes_messages = False

    def __init__(self, config: OnnxConfig) -> None:
        import onnxruntime

        self.config = config
        self.pooling = resolve_pooling(config.pooling, None)  # an ONNX file declares none: mean, sentence-transformers' usual
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = config.threads
        options.inter_op_num_threads = 1
        try:
            self._session = onnxruntime.InferenceSession(str(config.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own kinds for a missing or broken file
            raise EngineError(f"onnxruntime could not load {config.path}: {exc}") from None
        self._inputs = {i.name for i in self._session.get_inputs()}
        if not {"input_ids", "attention_mask"} <= self._inputs:
            raise EngineError(f"{config.path.name} takes {sorted(self._inputs)}; an embedding model takes input_ids and attention_mask")
        self._tokenizer = load_tokenizer(config.tokenizer)
        self._pad = self._tokenizer.token_to_id("[PAD]") or 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"onnx:{config.path.name}")
        self._lock = threading.Lock()
        self._queued = 0
        self._busy = False
        self._closing = False

    # ---- the Engine interface -------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Calls taken and not finished: a replaced model is closed only once this is 0."""
        return self._queued

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special).ids)

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        """With the model's special tokens, in one call (the tokenizer runs them in parallel)."""
        return [list(e.ids) for e in self._tokenizer.encode_batch(texts, add_special_tokens=True)]

    def detokenize(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def add_bos(self) -> bool:
        return True  # the tokenizer opens (and closes) an input with the model's own special tokens

    def chat_template(self) -> str | None:
        return None

    def special_tokens(self) -> dict[str, str]:
        return {}

    def control_tokens(self) -> dict[str, int]:
        return {}

    def generate(self, request: GenerationRequest) -> EventStream:
        raise EngineError("this model serves embeddings only")

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if self._closing:
            raise EngineClosed("the model is shutting down")
        if not inputs:
            raise EngineError("no inputs to embed")
        check_lengths(inputs, self.config.context_length)
        with self._lock:
            if self._queued >= self.config.max_queue + 1:  # the one running, and those waiting
                raise EngineOverloaded(f"the queue for this model is full ({self.config.max_queue} waiting)")
            self._queued += 1
        try:
            return await asyncio.wrap_future(self._thread.submit(self._run, inputs))
        finally:
            with self._lock:
                self._queued -= 1

    def embed_now(self, inputs: list[list[int]]) -> np.ndarray:
        """On the caller's thread, for tools and benches (never the event loop)."""
        check_lengths(inputs, self.config.context_length)
        return self._thread.submit(self._run, inputs).result()

    def adapters(self) -> list[AdapterInfo]:
        return []

    def abort_all(self, message: str) -> None:
        pass  # a forward pass takes milliseconds: the requests in flight finish within the grace period

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = self._queued - (1 if self._busy else 0)
        return EngineStats(1, 1 if self._busy else 0, max(0, waiting))

    async def start(self) -> None:
        pass

    def close(self) -> None:
        self._closing = True
        self._thread.shutdown(wait=True)

    # ---- the model's thread ---------------------------------------------------------------------

    def _run(self, inputs: list[list[int]]) -> np.ndarray:
        self._busy = True
        try:
            out: np.ndarray | None = None
            for group in pack([len(t) for t in inputs], max_tokens=self.config.batch_tokens, max_rows=len(inputs), padded=True):
                rows = self._forward([inputs[i] for i in group])
                if out is None:
                    out = np.empty((len(inputs), rows.shape[1]), dtype=np.float32)
                out[group] = rows
            assert out is not None
            return out
        finally:
            self._busy = False

    def _forward(self, inputs: list[list[int]]) -> np.ndarray:
        width = max(len(t) for t in inputs)
        ids = np.full((len(inputs), width), self._pad, dtype=np.int64)
        mask = np.zeros((len(inputs), width), dtype=np.int64)
        for row, tokens in enumerate(inputs):
            ids[row, :len(tokens)] = tokens
            mask[row, :len(tokens)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        # Token states are pooled here; a model exported with its pooling gives vectors already.
        return pool(hidden, mask, self.pooling) if hidden.ndim == 3 else np.asarray(hidden, dtype=np.float32)
