"""Changing the fleet while the server runs, through HTTP and the CLI on the real engine: models added,
edited and removed through the admin API and `appliance models`, a file edited by hand and applied,
load and unload on request. The file keeps the operator's comments; a change the fleet cannot take
leaves the file and the fleet as they were; a replaced model finishes its running requests first."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance.fleet.files import package_file
from appliance.config.settings import load_settings
from tests.conftest import MODEL_FILE, ROOT, Server, start_server, stop_server

COMMENT = "# the operator's note: keep me"


def _model(alias: str, extra: str = "") -> str:
    return f"""
[[models]]
alias = "{alias}"  # {alias}'s own comment
package_file = "{MODEL_FILE}"
context_length = 512
slots = 2
threads = 2
{extra}"""


def _config() -> str:
    return f"""{COMMENT}
[server]
model_dirs = ["{package_file(MODEL_FILE).parent}"]

[auth]
mode = "open"

[auth.open_principal]
admin = true

[cache]
enabled = false
""" + _model("base") + _model("lazy", 'preload = false\nkeep_alive = "10m"\n') + """
[[routes]]
alias = "auto"
tiers = ["base"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("hot-config"), _config())
    yield srv
    stop_server(srv)


def config_file(server: Server) -> Path:
    return server.home.parent / "models.toml"


def admin(server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", timeout=120, **kwargs)


def ask(server: Server, alias: str, max_tokens: int = 4) -> str:
    reply = server.client(timeout=120).chat.completions.create(
        model=alias, messages=[{"role": "user", "content": "Say hi."}], max_tokens=max_tokens, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.choices[0].message.content or ""


def served(server: Server) -> set[str]:
    return {m.id for m in server.client().models.list().data}


def row(server: Server, alias: str) -> dict[str, Any]:
    rows = admin(server, "GET", "/admin/models/loaded").json()["models"]
    return next(m for m in rows if m["alias"] == alias and not m["retired"])


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args, "--config", str(config_file(server)), "--url", server.base_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_model_added_through_the_api_answers_at_once_and_the_file_keeps_its_comments(server: Server) -> None:
    r = admin(server, "POST", "/admin/models", json={"path": str(package_file(MODEL_FILE)), "alias": "added", "like": "base"})
    assert r.status_code == 201, r.text
    assert r.json()["change"]["added"] == ["added"] and "added" in r.json()["models"]
    assert r.json()["change"]["restart_needed_for"] == []  # `serve --port` is not a change in the file
    assert "added" in served(server)
    assert ask(server, "added")
    text = config_file(server).read_text()
    assert COMMENT in text and "# base's own comment" in text and 'alias = "added"' in text
    model = load_settings(config_file(server)).model("added")
    assert model is not None and model.slots == 2 and model.context_length == 512  # taken from "base"


def test_an_edit_serves_the_model_again_after_its_running_stream_ends(server: Server) -> None:
    client = server.client(timeout=120)
    stream = client.chat.completions.create(model="added", messages=[{"role": "user", "content": "Count to fifty."}],
                                            max_tokens=40, temperature=0.0, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices
    result: dict[str, Any] = {}
    editor = threading.Thread(target=lambda: result.update(r=admin(server, "PATCH", "/admin/models/added", json={"slots": 1})))
    editor.start()
    finish = None
    for chunk in chunks:  # the old model keeps serving this stream to its end
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    editor.join(timeout=120)
    assert finish == "length"
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["change"]["changed"] == ["added"]
    assert ask(server, "added")
    assert server.health()["models"]["added"]["slots_total"] == 1
    assert load_settings(config_file(server)).model("added").slots == 1  # type: ignore[union-attr]
    assert "# base's own comment" in config_file(server).read_text()


def test_bad_changes_leave_the_file_and_the_fleet_as_they_were(server: Server) -> None:
    before = config_file(server).read_text()
    cases = [
        ("PATCH", "/admin/models/added", {"slots": 0}, 400, "slots"),
        ("PATCH", "/admin/models/added", {"colour": "blue"}, 400, "colour"),
        ("PATCH", "/admin/models/added", {"alias": "renamed"}, 400, "alias"),
        ("PATCH", "/admin/models/nope", {"slots": 1}, 404, "nope"),
        ("DELETE", "/admin/models/base", None, 400, "routes"),  # the route "auto" names it
        ("POST", "/admin/models", {"path": "/etc/passwd"}, 403, "path"),
        ("POST", "/admin/models", {"path": str(package_file(MODEL_FILE)), "alias": "base"}, 409, "base"),
        ("POST", "/admin/models", {"path": str(package_file(MODEL_FILE)), "alias": "x", "sha256": "00" * 32}, 400, "sha256"),
    ]
    for method, path, body, status, named in cases:
        r = admin(server, method, path, json=body) if body is not None else admin(server, method, path)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert named in error["message"] or named == error.get("param"), (path, body, error)
    assert config_file(server).read_text() == before
    assert served(server) >= {"base", "lazy", "added", "auto"}


def test_a_model_file_the_engine_cannot_read_is_refused_and_the_file_is_put_back(server: Server) -> None:
    junk = server.home / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    before = config_file(server).read_text()
    r = admin(server, "POST", "/admin/models", json={"path": str(junk), "alias": "junk"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loadable", r.text
    assert config_file(server).read_text() == before
    assert "junk" not in served(server)
    assert ask(server, "base")  # the fleet serves as before


def test_load_and_unload_on_request(server: Server) -> None:
    assert not row(server, "lazy")["loaded"]
    r = admin(server, "POST", "/admin/models/lazy/load")
    assert r.status_code == 200 and row(server, "lazy")["loaded"]
    r = admin(server, "POST", "/admin/models/lazy/unload")
    assert r.status_code == 200 and r.json()["unloaded"] is True and not row(server, "lazy")["loaded"]
    r = admin(server, "POST", "/admin/models/base/unload")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_preloaded"
    assert admin(server, "POST", "/admin/models/nope/load").status_code == 404


def test_a_hand_edit_is_applied_by_reload_and_server_keys_wait_for_a_restart(server: Server) -> None:
    config = config_file(server)
    config.write_text(config.read_text().replace("[server]\n", "[server]\nmax_queue = 7\n") + _model("by-hand"))
    r = cli(server, "config", "reload")
    assert r.returncode == 0, r.stderr
    assert "added by-hand" in r.stdout and "a restart applies the changes to [server]" in r.stdout
    assert ask(server, "by-hand")


def test_the_cli_changes_a_running_server(server: Server) -> None:
    r = cli(server, "models", "add", str(package_file(MODEL_FILE)), "--alias", "from-cli")
    assert r.returncode == 0, r.stderr
    assert "applied it (added from-cli)" in r.stdout and ask(server, "from-cli")
    r = cli(server, "models", "set", "from-cli", "keep_alive=0", "preload=false")
    assert r.returncode == 0 and "changed from-cli" in r.stdout, r.stdout + r.stderr
    assert ask(server, "from-cli")
    r = cli(server, "models", "set", "from-cli", "slots=0")
    assert r.returncode == 1 and "slots" in r.stderr
    r = cli(server, "models", "remove", "from-cli")
    assert r.returncode == 0 and "removed from-cli" in r.stdout, r.stdout + r.stderr
    with pytest.raises(openai.NotFoundError):
        ask(server, "from-cli")
    assert load_settings(config_file(server)).model("from-cli") is None


def test_a_removed_model_finishes_its_stream_then_goes(server: Server) -> None:
    stream = server.client(timeout=120).chat.completions.create(
        model="by-hand", messages=[{"role": "user", "content": "Count to fifty."}], max_tokens=40, temperature=0.0, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices
    r = admin(server, "DELETE", "/admin/models/by-hand")
    assert r.status_code == 200 and r.json()["change"]["removed"] == ["by-hand"]
    assert "by-hand" not in served(server)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    deadline = time.monotonic() + 10
    while any(m["alias"] == "by-hand" for m in admin(server, "GET", "/admin/models/loaded").json()["models"]):
        assert time.monotonic() < deadline, "the removed model was never unloaded"
        time.sleep(0.1)


def test_under_a_memory_budget_a_replaced_model_makes_room_before_its_successor_loads(tmp_path: Path) -> None:
    """A budget that holds one model: the model is edited while it streams; the next request waits
    for the old one to finish and unload, and memory never goes over the budget."""
    budget_mib = 350  # one SmolLM2 at 2 slots x 512 tokens is estimated at about 227 MiB
    config = f'[server]\nmemory_budget = "{budget_mib}MiB"\n\n[auth]\nmode = "open"\n\n[auth.open_principal]\nadmin = true\n\n' \
             '[cache]\nenabled = false\n' + _model("swapped", 'keep_alive = "10m"\n')
    srv = start_server(tmp_path, config)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(admin(srv, "GET", "/admin/models/loaded").json()["loaded_bytes"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    try:
        ask(srv, "swapped")
        watcher.start()
        stream = srv.client(timeout=120).chat.completions.create(
            model="swapped", messages=[{"role": "user", "content": "Count to fifty."}], max_tokens=200, temperature=0.0,
            stream=True, logit_bias={"0": -100, "2": -100})  # no end of turn: it runs for a while
        chunks = iter(stream)
        assert next(chunks).choices
        assert admin(srv, "PATCH", "/admin/models/swapped", json={"slots": 1}).json()["change"]["changed"] == ["swapped"]
        answered: dict[str, Any] = {}
        asker = threading.Thread(target=lambda: answered.update(text=ask(srv, "swapped"), at=time.monotonic()))
        asker.start()
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        stream_done = time.monotonic()
        asker.join(timeout=120)
        assert finish == ["length"] and answered["at"] >= stream_done - 0.05  # the successor waited for the old one
        rows = admin(srv, "GET", "/admin/models/loaded").json()["models"]
        assert [(m["alias"], m["slots_total"], m["retired"]) for m in rows] == [("swapped", 1, False)]
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        stop_server(srv)
    assert seen and max(seen) <= budget_mib * 2**20
