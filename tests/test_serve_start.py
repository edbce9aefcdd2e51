"""Starting the server and setting it up: a restart right after a stop gets its port back, a server
open to other machines without keys says so at start, and `keys create` says where the key went."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from appliance.server.run import open_beyond_loopback, serve
from appliance.config.settings import parse_settings
from policy.identity import SECRET_PREFIX
from tests import conftest
from tests.conftest import MODEL_FILE, ROOT, config_text, start_server, stop_server

MODEL = f'[[models]]\nalias = "m"\npackage_file = "{MODEL_FILE}"\n'


def test_a_server_restarts_on_its_port_right_after_a_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = conftest.free_port()
    monkeypatch.setattr(conftest, "free_port", lambda: port)  # both servers on the one port
    first = start_server(tmp_path / "first", config_text(slots=1, embeddings=False))
    with httpx.Client(timeout=10) as client:  # kept alive until the server closes it at its stop
        assert client.get(f"{first.base_url}/health").status_code == 200
        stop_server(first)
    # The server closed the connection first, so its end waits in TIME_WAIT, which a plain bind counts as in use.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    second = start_server(tmp_path / "second", config_text(slots=1, embeddings=False))
    try:
        assert httpx.get(f"{second.base_url}/health", timeout=10).status_code == 200
    finally:
        stop_server(second)
    assert "beyond this machine" not in first.log.read_text()  # 127.0.0.1 in open mode: no warning


@pytest.mark.parametrize(("host", "mode", "warned"), [
    ("127.0.0.1", "open", False), ("127.0.0.2", "open", False), ("::1", "open", False), ("[::1]", "open", False),
    ("localhost", "open", False), ("0.0.0.0", "open", True), ("::", "open", True), ("192.168.1.5", "open", True),
    ("box.example.com", "open", True), ("0.0.0.0", "keys", False),
])
def test_open_mode_beyond_loopback_is_what_warns(host: str, mode: str, warned: bool) -> None:
    settings = parse_settings(f'[server]\nhost = "{host}"\n[auth]\nmode = "{mode}"\n' + MODEL, "m.toml")
    assert open_beyond_loopback(settings) is warned


def test_serve_warns_at_start_and_still_refuses_a_port_a_server_listens_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own socket
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        text = f'[server]\nhost = "0.0.0.0"\nport = {port}\n[auth]\nmode = "open"\n[auth.open_principal]\nadmin = true\n' + MODEL
        with caplog.at_level(logging.WARNING, logger="appliance"):
            assert serve(parse_settings(text, str(tmp_path / "m.toml"))) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and 'mode = "open"' in warnings[0] and "0.0.0.0" in warnings[0] and "with admin rights" in warnings[0]
    assert f"0.0.0.0:{port} is already in use" in capsys.readouterr().err


def _keys_create(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", "keys", "create", "--tenant", "t", "--app", "a", "--user", "u",
                           "--role", "r", "--config", str(config)], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)


def test_keys_create_names_the_database_and_warns_when_the_config_is_open(tmp_path: Path) -> None:
    opened = tmp_path / "open.toml"
    opened.write_text('[server]\ndata_dir = "open-data"\n[auth]\nmode = "open"\n' + MODEL)
    run = _keys_create(opened)
    assert run.returncode == 0, run.stderr
    assert f"stored in {tmp_path / 'open-data' / 'appliance.db'} (the data directory of {opened})" in run.stdout
    assert run.stderr.startswith(f'warning: {opened} has [auth] mode = "open"') and "checks no keys" in run.stderr
    assert run.stdout.splitlines()[-1].startswith(SECRET_PREFIX)  # the secret stays alone on the last line

    keyed = tmp_path / "keys.toml"
    keyed.write_text('[server]\ndata_dir = "keys-data"\n' + MODEL)
    run = _keys_create(keyed)
    assert run.returncode == 0 and run.stderr == ""
    assert f"stored in {tmp_path / 'keys-data' / 'appliance.db'}" in run.stdout


def _chat(server: conftest.Server, question: str, **headers: str) -> httpx.Response:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_the_bundled_config_starts_without_a_warning_and_says_what_it_serves(tmp_path: Path) -> None:
    """Startup names the listen address, the auth mode, the config, the data dir and each model;
    llama.cpp has nothing to warn about in the bundled config; each call gets one access line with
    its id, caller, model, tokens and cache outcome, and never the prompt's text; polls get none."""
    server = start_server(tmp_path, (ROOT / "models.toml").read_text())
    try:
        asked = [_chat(server, "Which colour is the secret zebra-quartz sky?") for _ in range(2)]
        assert [r.status_code for r in asked] == [200, 200]
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{server.base_url}/v1/nothing", timeout=10).status_code == 404
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert "WARNING" not in log, [line for line in log.splitlines() if "WARNING" in line]
    assert f"serving http://127.0.0.1:{server.base_url.rsplit(':', 1)[1]}: OpenAI /v1" in log
    assert "auth: open: every request is user 'local' of tenant 'local'" in log
    assert f"config: {(tmp_path / 'models.toml').resolve()}; data: {server.home.resolve()}" in log
    assert "models: smollm2-135m (chat, llamacpp), all-minilm-l6-v2 (embedding, onnx)" in log
    access = [line for line in log.splitlines() if "appliance.access:" in line]
    calls = [line for line in access if "/v1/chat/completions" in line]
    assert len(calls) == 2 and len(access) == 3, access  # the two calls and the 404; the health poll is left out
    for response, line in zip(asked, calls, strict=True):
        assert f"{response.headers['x-request-id']} 200 POST /v1/chat/completions" in line
        assert "tenant=local app=local user=local" in line and "model=smollm2-135m" in line
        assert f"prompt_tokens={response.json()['usage']['prompt_tokens']}" in line
    assert "cache=miss" in calls[0] and "outcome=ok" in calls[0] and "cache=hit" in calls[1] and "outcome=cache_hit" in calls[1]
    assert " 404 GET /v1/nothing " in access[2]
    assert "zebra-quartz" not in log


def test_json_logs_are_one_object_a_line_and_access_lines_carry_their_fields(tmp_path: Path) -> None:
    text = config_text(slots=1, embeddings=False).replace("[server]\n", '[server]\nlog_format = "json"\naccess_log = "all"\n', 1)
    server = start_server(tmp_path, text)
    try:
        reply = _chat(server, "Name a colour.")
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        stop_server(server)
    lines = [line for line in server.log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, uvicorn's and llama.cpp's included
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
    access = [r for r in records if r["logger"] == "appliance.access"]
    (chat,) = [r for r in access if r["path"] == "/v1/chat/completions"]
    health = access[-1]  # with access_log = "all", polls too: the start's and the test's
    assert chat["request_id"] == reply.headers["x-request-id"] and chat["status"] == 200 and chat["path"] == "/v1/chat/completions"
    assert chat["completion_tokens"] == reply.json()["usage"]["completion_tokens"] and chat["model"] == "smollm2-135m"
    assert isinstance(chat["ms"], float) and chat["tenant"] and health["path"] == "/health" and health["status"] == 200
    assert any(r["logger"].startswith("uvicorn") for r in records)


@pytest.mark.parametrize(("method", "path", "quiet"), [
    ("GET", "/health", True), ("HEAD", "/metrics", True), ("GET", "/admin/traces", True), ("GET", "/admin", True),
    ("POST", "/admin/keys", False), ("DELETE", "/admin/keys/k", False), ("GET", "/healthz", False), ("GET", "/administer", False),
    ("GET", "/v1/models", False),
])
def test_calls_mode_leaves_out_polls_only(method: str, path: str, quiet: bool) -> None:
    from appliance.server.access_log import polled

    assert polled(method, path) is quiet
