"""The request log records every request, and a shutdown drains in-flight streams and loses no rows."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai

from appliance.store.request_log import recent
from tests.conftest import CHAT_MODEL, Server, config_text, start_server, stop_server


def wait_for_rows(db: Path, n: int, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        rows = recent(db, limit=1000)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def test_request_log_rows(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0)
    rows = {row.id: row for row in wait_for_rows(server.home / "appliance.db", 1)}
    deadline = time.monotonic() + 5
    while r.id not in rows and time.monotonic() < deadline:
        time.sleep(0.05)
        rows = {row.id: row for row in recent(server.home / "appliance.db", limit=1000)}
    row = rows[r.id]
    assert (row.model, row.endpoint, row.status) == (CHAT_MODEL, "chat", "ok")
    assert row.prompt_tokens == r.usage.prompt_tokens and row.completion_tokens == r.usage.completion_tokens
    assert row.ttft_ms is not None and 0 < row.ttft_ms <= row.total_ms


def test_sigterm_drains_streams_and_keeps_the_log(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "drain", config_text(embeddings=False))
    try:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Write a story about a fox."}],
                "max_tokens": 60, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        srv.process.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has drained, so a service manager sees why it stopped
        assert srv.process.wait(timeout=30) in (0, -signal.SIGTERM)
        rows = recent(srv.home / "appliance.db")
        assert len(rows) == 1 and rows[0].status == "ok" and rows[0].completion_tokens > 1
    finally:
        if srv.process.poll() is None:
            stop_server(srv)
