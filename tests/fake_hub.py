"""A minimal Hugging Face-compatible file server for tests: the resolve endpoint, as the real hub
serves it to huggingface-hub (HEAD for metadata, GET for bytes). Model hubs are unreachable here;
this lets the real download code run."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, files: dict[str, Path]) -> None:
        """files: 'owner/repo/filename' -> local file."""
        self.files = files
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _lookup(self) -> Path | None:
                parts = self.path.split("?")[0].strip("/").split("/")
                # owner/repo/resolve/revision/filename
                if len(parts) >= 5 and parts[2] == "resolve":
                    return hub.files.get("/".join(parts[:2] + parts[4:]))
                return None

            def _headers(self, path: Path) -> None:
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()

            def do_HEAD(self) -> None:  # noqa: N802
                hub.requests.append(("HEAD", self.path))
                path = self._lookup()
                if path is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                self._headers(path)

            def do_GET(self) -> None:  # noqa: N802
                hub.requests.append(("GET", self.path))
                path = self._lookup()
                if path is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._headers(path)
                self.wfile.write(path.read_bytes())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
