"""An OpenAI-compatible server that streams scripted deltas: a tier that writes what a test needs
(a program a caller steered it to, a thinking model's reasoning) where no real model here would."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# The request body, to the deltas of the reply (each a chunk's `delta`), streamed in order.
Script = Callable[[dict[str, Any]], list[dict[str, Any]]]
# The usage the reply reports: (the request body, its deltas) to the usage object, or None for the default.
Usage = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]


class ScriptedUpstream:
    def __init__(self, script: Script, usage: Usage | None = None) -> None:
        self.asked: list[dict[str, Any]] = []
        asked = self.asked

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self._send(b'{"object": "list", "data": []}', "application/json")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                asked.append(body)
                deltas = script(body)
                chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                counts = usage(body, deltas) if usage is not None else {"prompt_tokens": 20, "completion_tokens": len(deltas)}
                chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": counts})
                self._send(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n",
                           "text/event-stream")

            def _send(self, payload: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
