"""The wheel `pipx install` and `uv tool install` take: it carries what serving reads besides code
(the bundled config, the console's stylesheet, the cache's traps and vocabulary), and a first
`serve` with no config anywhere starts from the bundled one, copied into the data directory."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from appliance.config.settings import config_to_serve, load_settings
from tests.conftest import ROOT


def test_the_wheel_carries_the_bundled_config_and_the_data_files(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("appliance-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert archive.read("appliance/data/models.toml") == (ROOT / "models.toml").read_bytes()  # the file, not a link
    assert {"tui/app.tcss", "appliance/data/cache_traps.jsonl", "appliance/data/all-minilm-l6-v2/vocab.txt"} <= names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)


def test_a_first_start_with_no_config_copies_the_bundled_one_into_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./models.toml
    monkeypatch.delenv("APPLIANCE_CONFIG", raising=False)
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path / "data"))
    path = config_to_serve(None)
    assert path == tmp_path / "data" / "models.toml" and path.read_text() == (ROOT / "models.toml").read_text()
    assert load_settings(path).model("smollm2-135m") is not None
    path.write_text(path.read_text() + "\n# the operator's edit\n")
    assert config_to_serve(None).read_text().endswith("# the operator's edit\n")  # never written over
    named = tmp_path / "mine.toml"
    assert config_to_serve(named) == named and not named.exists()  # a named config is never made up
