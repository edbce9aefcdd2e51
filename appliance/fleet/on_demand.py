"""A local model loaded on its first request: the Engine the rest of the appliance sees for it.

It keeps the model's vocabulary alone (engines/vocabulary.py: llama.cpp's vocab_only load, an MLX
folder's tokenizer, an ONNX model's tokenizer; a few MB) and its engine's capabilities, so
templating, tokenizing and the API's checks never need the weights. A request while the model is loaded goes straight to its
engine, with that engine's own checks and stream. A request while it is not gets a stream at once;
a task asks the manager to load the model (or to wait for room), then hands the request to the
engine and relays its events. Whatever goes wrong before the first event (the load timed out, the
model can never fit, the engine refused the request) ends that stream with an error event carrying
the status the API answers with.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec

from appliance.config.settings import AdapterSettings, LocalModel
from appliance.fleet.change import AdapterSwap
from appliance.fleet.manager import Entry, ModelManager, ModelUnavailable
from engines.interface import (
    AdapterInfo,
    Capabilities,
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineStats,
    FinishEvent,
    GenerationRequest,
    UnknownAdapter,
    Usage,
    check_context,
    refuse_unsupported,
)
from engines.stream import EventStream
from engines.vocabulary import SpeaksVocabulary, Vocabulary

log = logging.getLogger("appliance.fleet.on_demand")


def _error_event(request: GenerationRequest, exc: EngineError) -> FinishEvent:
    """The error event for a refusal the engine would have raised had it been loaded."""
    status, code, retry = 400, None, None
    if isinstance(exc, ModelUnavailable):
        status, code, retry = exc.status, exc.code, exc.retry_after_s
    elif isinstance(exc, ContextLengthExceeded):
        code = "context_length_exceeded"
    elif isinstance(exc, EngineOverloaded):
        status, code, retry = 503, "overloaded", exc.retry_after_s
    elif isinstance(exc, UnknownAdapter):
        status, code = 404, "model_not_found"
    return FinishEvent("error", Usage(len(request.prompt_tokens), 0), error=str(exc), error_status=status, error_code=code,
                       retry_after_s=retry)


class OnDemandEngine(SpeaksVocabulary):
    name: str  # these five from the engine's Capabilities
    supports_grammar: bool
    supports_logprobs: bool
    supports_embeddings: bool
    supports_adapters: bool
    takes_messages = False

    def __init__(self, settings: LocalModel, vocabulary: Vocabulary, capabilities: Capabilities, manager: ModelManager, need: int, *,
                 pinned: bool = False) -> None:
        self.vocabulary = vocabulary  # loaded alone; closed with this engine
        capabilities.apply(self)  # what the engine will serve once loaded
        self._manager = manager
        self.entry: Entry = manager.add(settings, need, None, pinned=pinned)
        self._context_length = settings.context_length  # until a load says what the engine made of it
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def loaded(self) -> bool:
        return self.entry.real is not None

    @property
    def context_length(self) -> int:
        if self.entry.real is not None:
            self._context_length = self.entry.real.context_length
        return self._context_length

    # ---- requests ----------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> EventStream:
        real = self.entry.real
        if real is not None:
            return real.generate(request)  # loaded: the engine's own checks and stream
        # What the engine would refuse at once, refused at once here too.
        refuse_unsupported(self, request)
        check_context(request, self.context_length)
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty")
        known = {a.name for a in self.entry.settings.adapters}  # type: ignore[union-attr]
        missing = [name for name, _ in request.adapters if name not in known]
        if missing:
            raise UnknownAdapter(f"no adapter named {missing[0]!r} is loaded on this model")
        out = EventStream(asyncio.get_running_loop())
        task = asyncio.create_task(self._cold(request, out))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        out.on_close = task.cancel  # a client gone stops the wait, or the relay (which cancels the engine's request)
        return out

    async def _cold(self, request: GenerationRequest, out: EventStream) -> None:
        try:
            async with self._manager.hold(self.entry) as real:
                inner = real.generate(request)
        except EngineError as exc:
            out.push(_error_event(request, exc))
            return
        async for event in inner:  # cancelled here, the inner stream closes and the engine drops the request
            out.push(event)

    async def embed(self, inputs: list[list[int]]) -> Any:
        if not self.supports_embeddings:
            raise EngineError("this model is not configured for embeddings")
        async with self._manager.hold(self.entry) as real:
            return await real.embed(inputs)

    # ---- adapters: loaded on the model; remembered so a reload brings them back ------------------

    def adapters(self) -> list[AdapterInfo]:
        if self.entry.real is not None:
            return self.entry.real.adapters()
        return [AdapterInfo(a.name, str(a.path), a.scale) for a in sorted(self.entry.settings.adapters, key=lambda a: a.name)]  # type: ignore[union-attr]

    async def load_adapter(self, name: str, path: Path, scale: float = 1.0) -> AdapterInfo:
        async with self._manager.hold(self.entry) as real:
            info = await real.load_adapter(name, path, scale)  # type: ignore[attr-defined]
        self._remember_adapters([*(a for a in self._adapter_settings() if a.name != name), AdapterSettings(name=name, path=path, scale=scale)])
        return info

    async def unload_adapter(self, name: str) -> None:
        async with self._manager.hold(self.entry) as real:
            await real.unload_adapter(name)  # type: ignore[attr-defined]
        self._remember_adapters([a for a in self._adapter_settings() if a.name != name])

    async def swap_adapters(self, swap: AdapterSwap, adapters: tuple[AdapterSettings, ...]) -> None:
        """Serves `adapters` from now on without reloading the base: a loaded model (or one loading)
        swaps them in its engine; an unloaded one remembers them for its next load. Raises
        EngineError when the engine refuses (an adapter being replaced or removed is serving
        requests), with whatever it had swapped put back."""
        if self.entry.real is not None or self.entry.loading:
            async with self._manager.hold(self.entry) as real:
                await apply_swap(real, swap, self._adapter_settings())
        self._remember_adapters(list(adapters))

    def _adapter_settings(self) -> tuple[AdapterSettings, ...]:
        return self.entry.settings.adapters  # type: ignore[union-attr]

    def _remember_adapters(self, adapters: list[AdapterSettings]) -> None:
        self.entry.settings = msgspec.structs.replace(self.entry.settings, adapters=tuple(adapters))  # type: ignore[arg-type]

    # ---- the rest of the protocol ----------------------------------------------------------------

    def abort_all(self, message: str) -> None:
        if self.entry.real is not None:
            self.entry.real.abort_all(message)

    def stats(self) -> EngineStats:
        if self.entry.real is not None:
            return self.entry.real.stats()
        return EngineStats(self.entry.settings.slots, 0, self.entry.pending, loaded=False)  # requests waiting for the load are queued

    async def start(self) -> None:
        pass  # the manager starts the engine when it loads

    def close(self) -> None:
        """The manager closes the engine; this closes the vocabulary."""
        self.vocabulary.close()


async def apply_swap(engine: Any, swap: AdapterSwap, before: tuple[AdapterSettings, ...]) -> None:
    """Swaps a loaded engine's adapters (`before` are the ones it has): loads first, then unloads;
    on a refusal, each adapter touched goes back as it was and EngineError is raised."""
    old = {a.name: a for a in before}
    touched: list[str] = []
    try:
        for a in swap.load:
            await engine.load_adapter(a.name, a.path, a.scale)
            touched.append(a.name)
        for name in swap.unload:
            try:
                await engine.unload_adapter(name)
            except UnknownAdapter:
                pass  # already unloaded through the admin API
            touched.append(name)
    except EngineError:
        for name in reversed(touched):
            try:
                if name in old:
                    await engine.load_adapter(name, old[name].path, old[name].scale)
                else:
                    await engine.unload_adapter(name)
            except EngineError as exc:  # logged: the caller's error is the one that matters
                log.error("adapter %s: could not be put back: %s", name, exc)
        raise
