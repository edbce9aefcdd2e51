"""Paths and names the admin API is given, over real HTTP to a real server: a path must resolve
(symlinks too) inside the data directory or a [server] model_dirs folder, and the refusal reads the
same whether or not the file exists; an alias must be a name before anything is written."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance.fleet.files import package_file
from appliance.config.settings import load_settings
from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server
from tests.test_lora import write_lora


@dataclass(frozen=True)
class Places:
    outside: Path  # a folder the config does not name, holding real.gguf and not missing.gguf
    home: Path  # the server's HOME, holding real.gguf


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Places:
    found = Places(tmp_path_factory.mktemp("outside"), tmp_path_factory.mktemp("fake-home"))
    for folder in (found.outside, found.home):
        (folder / "real.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, places: Places) -> Iterator[Server]:
    text = config_text(slots=2, embeddings=False).replace("[server]\n", '[server]\nmodel_dirs = ["extra-models"]\n', 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(places.home))  # so that "~/real.gguf" names a file that exists
        srv = start_server(tmp_path_factory.mktemp("paths"), text)
    (srv.home.parent / "extra-models").mkdir()
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def admin(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def bad_paths(server: Server, places: Places, kind: str) -> tuple[str, str]:
    """Two paths the API must refuse alike: the first names a file that exists, the second none."""
    data = server.home
    if kind == "traversal":
        return "../" * 30 + "etc/passwd", "../" * 30 + "etc/no-such-file"
    if kind == "relative":
        return os.path.relpath(places.outside / "real.gguf", data), os.path.relpath(places.outside / "missing.gguf", data)
    if kind == "absolute":
        return str(places.outside / "real.gguf"), str(places.outside / "missing.gguf")
    if kind == "system":
        return "/etc/shadow", "/etc/no-such-file"
    if kind == "home":
        return "~/real.gguf", "~/missing.gguf"
    assert kind == "symlink"  # links inside the data directory, to a file outside and to nothing there
    for name in ("real", "missing"):
        link = data / f"link-{name}.gguf"
        if not link.is_symlink():
            link.symlink_to(places.outside / f"{name}.gguf")
    return "link-real.gguf", str(data / "link-missing.gguf")


@pytest.mark.parametrize("route", ["adapter", "quantize"])
@pytest.mark.parametrize("kind", ["traversal", "relative", "absolute", "system", "home", "symlink"])
def test_a_path_outside_is_refused_alike_whether_or_not_it_exists(server: Server, places: Places, admin: httpx.Client,
                                                                   route: str, kind: str) -> None:
    def ask(path: str) -> httpx.Response:
        if route == "adapter":
            return admin.put(f"/admin/models/{CHAT_MODEL}/adapters/x", json={"path": path})
        return admin.post("/admin/models/quantize", json={"source": path, "type": "Q8_0", "allow_requantize": True})

    existing, missing = bad_paths(server, places, kind)
    first, second = ask(existing), ask(missing)
    assert first.status_code == second.status_code == 403
    assert first.json() == second.json()
    error = first.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("path" if route == "adapter" else "source", "path_not_allowed", "permission_error")
    assert "real" not in error["message"] and "exist" not in error["message"]
    assert admin.get(f"/admin/models/{CHAT_MODEL}/adapters").json()["adapters"] == []
    assert not any(j["kind"] == "quantize" and "real" in j["description"] for j in admin.get("/admin/jobs").json()["jobs"])


def test_adapters_inside_the_data_dir_or_a_model_dir_load(server: Server, admin: httpx.Client) -> None:
    data, extra = server.home, server.home.parent / "extra-models"
    (data / "adapters").mkdir(exist_ok=True)
    write_lora(data / "adapters" / "mine.gguf", seed=5)
    write_lora(extra / "theirs.gguf", seed=6)
    (data / "linked.gguf").symlink_to(extra / "theirs.gguf")  # a link that stays inside is followed
    wanted = {"mine": "adapters/mine.gguf", "theirs": str(extra / "theirs.gguf"), "linked": str(data / "linked.gguf")}
    try:
        for name, path in wanted.items():
            r = admin.put(f"/admin/models/{CHAT_MODEL}/adapters/{name}", json={"path": path})
            assert r.status_code == 200, r.text
        assert sorted(a["name"] for a in admin.get(f"/admin/models/{CHAT_MODEL}/adapters").json()["adapters"]) == sorted(wanted)
    finally:
        for name in wanted:
            admin.delete(f"/admin/models/{CHAT_MODEL}/adapters/{name}")
    # inside, a missing file is said to be missing
    r = admin.put(f"/admin/models/{CHAT_MODEL}/adapters/x", json={"path": "adapters/none.gguf"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path" and "There is no file or folder" in r.json()["error"]["message"]


def _finished(admin: httpx.Client, job_id: str, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = next(j for j in admin.get("/admin/jobs").json()["jobs"] if j["id"] == job_id)
        if job["state"] != "running":
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)


def test_quantize_writes_only_inside_the_allowed_folders(server: Server, admin: httpx.Client) -> None:
    """A file from a model dir is quantized beside itself; the packaged model, whose folder the
    config does not name, into the data directory rather than beside it."""
    config = server.home.parent / "models.toml"
    extra = server.home.parent / "extra-models"
    shutil.copy(package_file(MODEL_FILE), extra / "copy.Q4_1.gguf")
    r = admin.post("/admin/models/quantize", json={"source": str(extra / "copy.Q4_1.gguf"), "type": "Q8_0", "allow_requantize": True})
    assert r.status_code == 202, r.text
    job = _finished(admin, r.json()["job"]["id"])
    assert job["state"] == "done", job
    assert load_settings(config).model("copy.q8_0").path == extra / "copy.Q8_0.gguf"

    r = admin.post("/admin/models/quantize", json={"source": CHAT_MODEL, "type": "Q8_0", "allow_requantize": True})
    assert r.status_code == 202, r.text
    job = _finished(admin, r.json()["job"]["id"])
    assert job["state"] == "done", job
    written = server.home / "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert written.is_file() and not (package_file(MODEL_FILE).parent / written.name).exists()
    added = load_settings(config).model(f"{CHAT_MODEL}-q8_0")
    assert added is not None and added.path == written and added.slots == 2  # settings copied from the source model


@pytest.mark.parametrize(("body", "param"), [
    ({"repo": "acme/x-GGUF", "file": "x.gguf", "alias": 'x"\ntier = "frontier"\nprice_input_per_mtok = 0.0\n#'}, "alias"),
    ({"repo": "acme/x-GGUF", "file": "x.gguf", "alias": f"{CHAT_MODEL}:evil"}, "alias"),
    ({"repo": "acme/x-GGUF", "file": "../../x.gguf"}, "file"),
    ({"repo": "acme/x-GGUF", "file": "/etc/x.gguf"}, "file"),
])
def test_pull_refuses_what_it_could_not_write_safely_before_starting(server: Server, admin: httpx.Client, body: dict, param: str) -> None:
    config = server.home.parent / "models.toml"
    before = config.read_text()
    r = admin.post("/admin/models/pull", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not [j for j in admin.get("/admin/jobs").json()["jobs"] if j["kind"] == "pull"]
    assert config.read_text() == before
