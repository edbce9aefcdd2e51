"""engines/stream.py Outbox: a model thread's events reach the event loop in one wake-up a step,
in order, counted when emitted; events from any other thread go out at once."""

from __future__ import annotations

import asyncio
import threading

from engines.interface import FinishEvent, TokenEvent, Usage
from engines.stream import EventStream, Outbox


def test_a_steps_events_cross_to_the_loop_in_one_wake_up_in_order() -> None:
    loop = asyncio.new_event_loop()
    wakes = []
    real = loop.call_soon_threadsafe

    def counting(*args):  # type: ignore[no-untyped-def]
        wakes.append(args)
        return real(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    streams = [EventStream(loop) for _ in range(8)]
    outbox = Outbox()

    def model_thread() -> None:
        outbox.bind()
        emits = [outbox.emitter(s) for s in streams]
        for step in range(3):
            for emit in emits:
                emit(TokenEvent(f"t{step}", step))
            assert all(s.tokens_pushed == step + 1 for s in streams)  # counted when emitted, before delivery
            outbox.flush()
        for emit in emits:
            emit(FinishEvent("length", Usage(1, 3, 0)))
        outbox.flush()
        outbox.flush()  # nothing held: no wake-up

    t = threading.Thread(target=model_thread)
    t.start()
    t.join()
    assert len(wakes) == 4  # three steps and the finish, not 32 events

    async def read(stream: EventStream) -> list[str]:
        return [e.text if isinstance(e, TokenEvent) else e.reason async for e in stream]  # type: ignore[union-attr]

    async def read_all() -> list[list[str]]:
        return list(await asyncio.gather(*(read(s) for s in streams)))

    got = loop.run_until_complete(read_all())
    assert got == [["t0", "t1", "t2", "length"]] * 8
    loop.close()


def test_events_from_another_thread_are_not_held() -> None:
    loop = asyncio.new_event_loop()
    stream = EventStream(loop)
    outbox = Outbox()
    ready = threading.Event()
    threading.Thread(target=lambda: (outbox.bind(), ready.set())).start()
    ready.wait(5)
    # a grammar worker's refusal, or a shutdown after the model thread ended: straight to the loop
    outbox.emitter(stream)(FinishEvent("error", Usage(0, 0, 0), error="bad grammar"))

    async def first() -> str:
        event = await stream.peek()
        assert isinstance(event, FinishEvent)
        return event.reason

    assert loop.run_until_complete(asyncio.wait_for(first(), 5)) == "error"
    loop.close()
