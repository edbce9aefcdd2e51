"""Starting the server and setting it up: a restart right after a stop gets its port back, a server
open to other machines without keys says so at start, and `keys create` says where the key went."""

from __future__ import annotations

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
