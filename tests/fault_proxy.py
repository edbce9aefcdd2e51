"""A TCP proxy in front of a real server that misbehaves on demand: it drops connections, delays
them, answers 500 or 400 itself, or cuts a response after a number of stream events. The tests
start it on its own thread and switch its mode between requests; it counts what it saw.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass


@dataclass
class Mode:
    kind: str = "pass"  # pass, drop, delay, status, cut
    seconds: float = 0.0  # delay: before the request is forwarded
    status: int = 500  # status: the answer given instead of the server's
    message: str = "injected failure"
    events: int = 2  # cut: stream events passed on before the connection is cut
    times: int | None = None  # misbehave for this many requests, then pass; None: until changed


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.requests = 0  # requests seen (a connection that sent a request line)
        self._mode = Mode()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def set(self, **kwargs: object) -> None:
        with self._lock:
            self._mode = Mode(**kwargs)  # type: ignore[arg-type]

    def reset_count(self) -> None:
        with self._lock:
            self.requests = 0

    def stop(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def open_server() -> None:
            # One request per connection: each is judged by the mode at its arrival.
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(open_server())
        self._ready.set()
        self._loop.run_forever()

    def _take_mode(self) -> Mode:
        with self._lock:
            self.requests += 1
            mode = self._mode
            if mode.kind != "pass" and mode.times is not None:
                mode.times -= 1
                if mode.times <= 0:
                    self._mode = Mode()
            return mode

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()
            return
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        # Health checks (GET) are not counted, and a down server (drop) is down for them too;
        # the other faults are the completions' only.
        if head.startswith(b"GET "):
            if self._mode.kind == "drop":
                writer.transport.abort()
            else:
                await self._forward(head, body, writer, None)
            return
        mode = self._take_mode()
        if mode.kind == "drop":
            writer.transport.abort()
            return
        if mode.kind == "delay":
            await asyncio.sleep(mode.seconds)
        if mode.kind == "status":
            payload = json.dumps({"error": {"message": mode.message, "type": "server_error", "code": None}}).encode()
            writer.write(b"HTTP/1.1 %d Injected\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                         % (mode.status, len(payload)) + payload)
            await writer.drain()
            writer.close()
            return
        await self._forward(head, body, writer, mode.events if mode.kind == "cut" else None)

    async def _forward(self, head: bytes, body: bytes, writer: asyncio.StreamWriter, cut_after: int | None) -> None:
        # Ask the server to close after its answer, so the end of the answer is the end of the connection.
        lines = [ln for ln in head.split(b"\r\n") if ln and not ln.lower().startswith(b"connection:")]
        head = b"\r\n".join(lines) + b"\r\nconnection: close\r\n\r\n"
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        up_writer.write(head + body)
        await up_writer.drain()
        seen = 0
        try:
            while True:
                data = await up_reader.read(4096)
                if not data:
                    break
                if cut_after is not None:
                    # Pass the role chunk and `cut_after` more events, then a torn fragment, then cut.
                    at = data.find(b"data: {")
                    while at != -1:
                        seen += 1
                        if seen > cut_after + 1:
                            writer.write(data[: at + 3])
                            await writer.drain()
                            writer.transport.abort()
                            return
                        at = data.find(b"data: {", at + 1)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            up_writer.close()
        writer.close()
