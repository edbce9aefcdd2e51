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
    def __init__(self, files: dict[str, Path], *, etags: dict[str, str] | None = None, drop_after: int | None = None) -> None:
        """files: 'owner/repo/filename' -> local file. etags: a hash to name a file by instead of
        its sha256 (a hub that serves other bytes than it names). drop_after: the first GET of each
        file sends this many bytes of the body and closes the connection (a transfer that breaks off)."""
        self.files = files
        self.etags = etags or {}
        self.drop_after = drop_after
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[str | None] = []  # each GET's Range header
        self._dropped: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _key(self) -> str | None:
                parts = self.path.split("?")[0].strip("/").split("/")
                # owner/repo/resolve/revision/filename
                if len(parts) >= 5 and parts[2] == "resolve":
                    return "/".join(parts[:2] + parts[4:])
                return None

            def _lookup(self) -> Path | None:
                key = self._key()
                return hub.files.get(key) if key else None

            def _headers(self, path: Path, start: int = 0) -> None:
                data = path.read_bytes()
                etag = hub.etags.get(self._key() or "", hashlib.sha256(data).hexdigest())
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
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
                hub.ranges.append(self.headers.get("Range"))
                path = self._lookup()
                if path is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                wanted = self.headers.get("Range", "")
                start = int(wanted[len("bytes="):].split("-")[0]) if wanted.startswith("bytes=") else 0
                self._headers(path, start)
                body = path.read_bytes()[start:]
                key = self._key() or ""
                if hub.drop_after is not None and key not in hub._dropped:
                    hub._dropped.add(key)
                    self.wfile.write(body[: hub.drop_after])
                    self.wfile.flush()
                    self.close_connection = True  # the rest never comes
                    return
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
