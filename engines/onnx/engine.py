"""An embedding model exported to ONNX (a sentence-transformers model, say), run by onnxruntime.

One thread owns the session. A request's inputs are packed into as few padded forward passes as
`batch_tokens` allows (engines/embedding.py), pooled over each input's real tokens; requests take
turns on the thread pass by pass, and one cancelled stops at its next pass.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.embedding import check_lengths, embed_in_passes, pack, place, pool, resolve_pooling
from engines.interface import AdapterInfo, Capabilities, EngineError, EngineStats, GenerationRequest
from engines.occupancy import Occupancy
from engines.onnx.vocabulary import OnnxVocabulary
from engines.stream import EventStream
from engines.vocabulary import SpeaksVocabulary

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


class OnnxEngine(SpeaksVocabulary):
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
        self.vocabulary = OnnxVocabulary(config.tokenizer)
        self._pad = self.vocabulary.tokenizer.token_to_id("[PAD]") or 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"onnx:{config.path.name}")
        self._occupancy = Occupancy(1, config.max_queue)  # one call runs at a time

    # ---- the Engine interface -------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities.of(cls)

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        """With the model's special tokens, in one call (the tokenizer runs them in parallel)."""
        return [list(e.ids) for e in self.vocabulary.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def generate(self, request: GenerationRequest) -> EventStream:
        raise EngineError("this model serves embeddings only")

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self._occupancy.refuse_if_closed()
        groups = self._groups(inputs)
        self._occupancy.take()  # max_queue waiting; busy until the thread is done with its last pass
        started = False  # the session thread's to change

        def one(batch: list[list[int]]) -> np.ndarray:
            nonlocal started
            if not started:
                started = True
                self._occupancy.admit()
            return self._forward(batch)

        def settle() -> None:
            self._occupancy.settle(queued=not started, running=started)

        try:
            rows = await embed_in_passes(inputs, groups, lambda batch: asyncio.wrap_future(self._thread.submit(one, batch)))
        except BaseException:
            # Counted out behind its pass in flight on the one thread (one not begun was cancelled with its caller).
            try:
                self._thread.submit(settle)
            except RuntimeError:  # shut down: nothing runs any more
                settle()
            raise
        settle()  # every pass has returned: counted out before the caller wakes
        return rows

    def embed_now(self, inputs: list[list[int]]) -> np.ndarray:
        """On the caller's thread, for tools and benches (never the event loop)."""
        return self._thread.submit(self._run, inputs, self._groups(inputs)).result()

    def adapters(self) -> list[AdapterInfo]:
        return []

    def abort_all(self, message: str) -> None:
        pass  # a forward pass takes milliseconds: the requests in flight finish within the grace period

    def stats(self) -> EngineStats:
        return EngineStats(1, self._occupancy.running, self._occupancy.queued)

    @property
    def busy(self) -> int:
        """Calls taken and not finished: a model is unloaded, or a replaced one closed, only at 0."""
        return self._occupancy.unfinished

    @property
    def idle_since(self) -> float | None:
        """When the last call finished (or the model loaded), `time.monotonic()`; None while busy."""
        return self._occupancy.idle_since

    async def drain(self, timeout: float | None = None) -> bool:
        return await self._occupancy.drain(timeout)

    async def start(self) -> None:
        pass

    def close(self) -> None:
        self._occupancy.closing = True
        self._thread.shutdown(wait=True)

    # ---- the model's thread ---------------------------------------------------------------------

    def _groups(self, inputs: list[list[int]]) -> list[list[int]]:
        if not inputs:
            raise EngineError("no inputs to embed")
        check_lengths(inputs, self.config.context_length)
        return pack([len(t) for t in inputs], max_tokens=self.config.batch_tokens, max_rows=len(inputs), padded=True)

    def _run(self, inputs: list[list[int]], groups: list[list[int]]) -> np.ndarray:
        out: np.ndarray | None = None
        for group in groups:
            out = place(out, len(inputs), group, self._forward([inputs[i] for i in group]))
        assert out is not None
        return out

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
