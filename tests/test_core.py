"""The local engines' shared core (engines/core.py): the host-RAM prefix tier and logprobs as pure
parts, and what a model's owner reads and does (busy, idle since, drain, abort, close) on the real
llama.cpp engine with the bundled model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.fleet.files import package_file
from engines.interface import EngineClosed, EngineOverloaded, FinishEvent, GenerationRequest, PrefixStats, SamplingParams, TokenEvent
from engines.llamacpp.engine import LlamaCppConfig, LlamaCppEngine
from engines.logprobs import log_softmax, token_logprob, top_tokens
from engines.occupancy import Occupancy
from engines.prefix import HostCache, PrefixIndex
from tests.conftest import MODEL_FILE


def test_host_cache_keeps_the_most_recently_used_under_its_budget() -> None:
    index, stats = PrefixIndex(), PrefixStats()
    host: HostCache[str] = HostCache(index, 100, stats)
    for n in range(3):
        host.put("base", (n, n), f"state{n}", 40)
    assert (stats.host_saves, stats.host_evictions, stats.host_bytes, stats.host_entries) == (3, 1, 80, 2)
    assert ("host", 0) not in index and index.match("base", (1, 1)) == {("host", 1): 2, ("host", 2): 0}  # the oldest went
    assert host.get(1) == "state1"  # now the most recently used: the next save evicts entry 2
    host.put("base", (3,), "state3", 40)
    assert set(index.holders()) == {("host", 1), ("host", 3)}
    host.put("lora", (4,), "state4", 40, protect=1)  # room is never made by dropping the protected entry
    assert set(index.holders()) == {("host", 1), ("host", 4)}
    host.put("base", (5,), "too big", 101)
    assert stats.host_saves == 5 and ("host", 5) not in index
    host.drop(4)
    assert (stats.host_bytes, stats.host_entries, index.holders()) == (40, 1, [("host", 1)])


def test_occupancy_counts_requests_in_and_out_and_drains() -> None:
    async def run() -> None:
        o = Occupancy(slots=1, max_queue=1)
        o.take()
        o.admit()
        o.take()
        with pytest.raises(EngineOverloaded):  # one running, one queued: the slot and the queue are full
            o.take()
        assert (o.running, o.queued, o.unfinished, o.idle_since) == (1, 1, 2, None)
        drained = asyncio.create_task(o.drain(timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(EngineClosed, match="unloaded"):
            o.take()
        o.settle(running=True)
        assert not drained.done()
        o.settle(queued=True)
        assert await drained is True and o.idle_since is not None and (o.running, o.queued) == (0, 0)
        o.accepting = True
        o.take()
        assert await o.drain(timeout=0.01) is False

    asyncio.run(run())


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=40), st.integers(0, 45))
def test_top_tokens_are_a_full_stable_sort_cut_at_k(values: list[int], k: int) -> None:
    row = np.array(values, dtype=np.float64)
    assert top_tokens(row, k).tolist() == np.argsort(-row, kind="stable")[:k].tolist()


def test_token_logprob_reads_a_normalised_row() -> None:
    logprobs = log_softmax(np.array([2.0, 0.5, 2.0, -1.0], dtype=np.float32))
    assert np.exp(logprobs).sum() == pytest.approx(1.0)
    entry = token_logprob(logprobs, 1, 2, lambda t: b"tok%d" % t)
    assert (entry.token, entry.token_bytes, entry.logprob) == ("tok1", b"tok1", pytest.approx(logprobs[1]))
    assert [t.token for t in entry.top] == ["tok0", "tok2"]  # equal logits: the lower id first


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    # One slot: a second request waits in the queue.
    engine = LlamaCppEngine(LlamaCppConfig(package_file(MODEL_FILE), slots=1, context_length=512, batch_tokens=128, threads=2, max_queue=4))
    yield engine
    engine.close()


def request(engine: LlamaCppEngine, name: str, max_tokens: int) -> GenerationRequest:
    tokens = engine.tokenize("<|im_start|>user\nWrite a long story about a fox.<|im_end|>\n<|im_start|>assistant\n",
                             add_special=False, parse_special=True)
    return GenerationRequest(name, tuple(tokens), max_tokens, SamplingParams(temperature=0))


async def collect(stream) -> tuple[int, FinishEvent]:  # type: ignore[no-untyped-def]
    tokens = 0
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens += 1
        else:
            return tokens, event
    raise AssertionError("no finish event")


def test_drain_refuses_new_requests_and_finishes_running_and_queued_ones(engine: LlamaCppEngine) -> None:
    async def run() -> None:
        assert engine.busy == 0 and engine.idle_since is not None
        running, queued = engine.generate(request(engine, "a", 24)), engine.generate(request(engine, "b", 8))
        await running.peek()
        assert engine.busy == 2 and engine.idle_since is None and engine.stats().queue_depth == 1
        drained = asyncio.create_task(engine.drain(timeout=60))
        await asyncio.sleep(0)
        with pytest.raises(EngineClosed, match="unloaded"):
            engine.generate(request(engine, "c", 4))
        first, second = await asyncio.gather(collect(running), collect(queued))
        assert await drained is True
        assert (first[0], first[1].reason, second[0], second[1].reason) == (24, "length", 8, "length")
        assert engine.busy == 0 and engine.idle_since is not None and engine.idle_since <= time.monotonic()
        engine.resume()
        assert (await collect(engine.generate(request(engine, "d", 3))))[1].usage.completion_tokens == 3

    asyncio.run(run())


def test_a_drain_times_out_while_a_request_runs_and_a_cancel_ends_it(engine: LlamaCppEngine) -> None:
    async def run() -> None:
        stream = engine.generate(request(engine, "long", 400))
        await stream.peek()
        assert await engine.drain(timeout=0.05) is False
        await stream.aclose()  # a client gone: the slot is freed at the next step
        assert await engine.drain(timeout=10) is True and engine.busy == 0
        engine.resume()

    asyncio.run(run())


def test_embeddings_run_on_the_model_thread_and_count_as_busy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LlamaCppEngine(LlamaCppConfig(package_file(MODEL_FILE), slots=1, context_length=256, batch_tokens=64, threads=2,
                                           max_queue=4, embeddings=True))
    try:
        async def run() -> None:
            tokens = engine.tokenize("a fox " * 10, add_special=True, parse_special=False)
            pending = asyncio.create_task(engine.embed([tokens] * 4))  # long enough (a second or so) to be seen running
            await asyncio.sleep(0)
            assert engine.busy == 1
            vectors = await pending
            assert len(vectors) == 4 and (vectors[0] == vectors[-1]).all() and len(vectors[0]) > 100
            assert engine.busy == 0
            assert await engine.drain() is True
            with pytest.raises(EngineClosed):
                await engine.embed([tokens])

        asyncio.run(run())
    finally:
        engine.close()


def test_abort_then_close_ends_every_request_and_stops_at_once() -> None:
    engine = LlamaCppEngine(LlamaCppConfig(package_file(MODEL_FILE), slots=1, context_length=512, batch_tokens=128, threads=2, max_queue=4))
    late = request(engine, "late", 4)

    async def run() -> list[FinishEvent]:
        streams = [engine.generate(request(engine, f"r{i}", 400)) for i in range(2)]
        await streams[0].peek()
        engine.abort_all("the server is stopping")
        started = time.monotonic()
        engine.close()  # its stop request lands behind the abort in the inbox
        assert time.monotonic() - started < 10
        return [(await collect(s))[1] for s in streams]

    finishes = asyncio.run(run())
    assert [(f.reason, f.error_status, f.error_code) for f in finishes] == [("error", 503, "server_shutting_down")] * 2
    assert engine.busy == 0
    with pytest.raises(EngineClosed):
        engine.generate(late)
