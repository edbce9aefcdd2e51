"""Each setting is declared once (appliance/config/settings.py); the reader, the writer and the reference
(docs/config.md) all follow that declaration, and every error names the file and the dotted key."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from appliance.config.doc import render
from appliance.config.schema import Where, decode, keys_of, strip, table_keys, to_toml
from appliance.config.values import KeepAlive, MemoryBudget
from appliance.config.writer import append_table
from appliance.config.settings import SECTIONS, ConfigError, LocalModel, Settings, UpstreamModel, load_settings, parse_settings
from tests.conftest import MODEL_FILE, ROOT

MODEL = f'[[models]]\nalias = "m"\npackage_file = "{MODEL_FILE}"\n'
UPSTREAM = '[[models]]\nalias = "big"\nengine = "openai"\nbase_url = "http://gpu1:8000/v1"\n'


def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_settings(text, "fleet.toml")
    assert str(info.value).startswith(f"fleet.toml: {info.value.key}: ") and "\n" not in str(info.value)
    return info.value


def test_the_reference_is_generated_from_the_declarations() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == render(), "run: appliance config docs > docs/config.md"
    cli = subprocess.run([sys.executable, "-m", "appliance.cli.main", "config", "docs"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert cli.returncode == 0 and cli.stdout == render()


def _declared(cls: type) -> list:
    out = []
    for k in keys_of(cls):
        out += _declared(strip(k.type)) if k.extra.get("flatten") else [k]
    return out


def test_every_key_is_described_and_in_the_reference() -> None:
    reference = render()
    for section in SECTIONS:
        for cls in section.types:
            msgspec.inspect.type_info(cls)  # a declaration msgspec (and so Litestar) can read
            for k in _declared(cls):
                assert k.doc, f"{cls.__name__}.{k.name} has no description"
                assert f"| `{k.name}` |" in reference
    msgspec.inspect.type_info(Settings)


def _bounded() -> list[tuple[str, str, object, str]]:
    """(section, key, a value just out of bounds, the words of the bound) for every bounded number
    declared in a table, or in a local model."""
    cases = []
    for section in SECTIONS:
        cls = section.types[0]
        if section.array and cls is not LocalModel:
            continue
        for k in _declared(cls):
            metas = [m for m in getattr(k.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
            low = next((m.ge for m in metas if m.ge is not None), None)
            if strip(k.type) in (int, float) and low is not None:
                cases.append((section.name, k.name, low - 1, f"{low}"))
    return cases


@pytest.mark.parametrize(("section", "name", "value", "bound"), _bounded())
def test_each_declared_bound_is_enforced_naming_the_key(section: str, name: str, value: object, bound: str) -> None:
    if section == "models":
        text, key = MODEL + f"{name} = {value}\n", f"models[0].{name}"
    else:
        text, key = f"[{section}]\n{name} = {value}\n" + MODEL, f"{section}.{name}"
    error = _error(text)
    assert error.key == key and bound in error.problem and f"got {value}" in error.problem


@pytest.mark.parametrize(("value", "seconds"), [('"5m"', 300.0), ('"30s"', 30.0), ('"1h"', 3600.0), ('"1h30m"', 5400.0),
                                                ('"0.5s"', 0.5), ("0", 0.0), ("-1", None)])
def test_keep_alive_is_read_as_seconds(value: str, seconds: float | None) -> None:
    model = parse_settings(MODEL + f"keep_alive = {value}\n", "m.toml").models[0]
    assert isinstance(model, LocalModel) and model.keep_alive_s == seconds


@pytest.mark.parametrize("value", ['"5 minutes"', '"5"', '""', "300", "-2", "true", '"-1"'])
def test_a_bad_keep_alive_names_the_key_and_the_forms(value: str) -> None:
    error = _error(MODEL + f"keep_alive = {value}\n")
    assert error.key == "models[0].keep_alive" and '"5m"' in error.problem and "-1" in error.problem


def test_the_new_model_settings_default_and_parse() -> None:
    model = parse_settings(MODEL, "m.toml").models[0]
    assert isinstance(model, LocalModel)
    assert (model.keep_alive_s, model.preload, model.gpu_layers) == (300.0, None, "auto")
    model = parse_settings(MODEL + 'preload = true\ngpu_layers = "auto"\n', "m.toml").models[0]
    assert (model.preload, model.gpu_layers) == (True, "auto")
    assert parse_settings(MODEL + "gpu_layers = 28\n", "m.toml").models[0].gpu_layers == 28
    for bad in ("-1", '"all"', "1.5"):
        error = _error(MODEL + f"gpu_layers = {bad}\n")
        assert error.key == "models[0].gpu_layers" and error.problem.startswith('expected "auto" or an integer between 0 and 10000, got ')
    assert _error(MODEL + 'preload = "yes"\n').key == "models[0].preload"


@pytest.mark.parametrize("key", ["keep_alive = \"1m\"", "preload = true", "gpu_layers = 1", "slots = 2"])
def test_an_upstream_model_refuses_what_only_a_local_one_has(key: str) -> None:
    error = _error(MODEL + UPSTREAM + key + "\n")
    assert error.key == f"models[1].{key.split(' ')[0]}" and "local engines only" in error.problem


@pytest.mark.parametrize(("value", "size", "share"), [('"16GiB"', 16 * 2**30, None), ('"512MiB"', 512 * 2**20, None),
                                                      ('"8GB"', 8 * 10**9, None), ('"1.5 GiB"', 3 * 2**29, None),
                                                      ('"80%"', None, 0.8), ('"100%"', None, 1.0)])
def test_a_memory_budget_is_a_size_or_a_share(value: str, size: int | None, share: float | None) -> None:
    budget = parse_settings(f"[server]\nmemory_budget = {value}\n" + MODEL, "m.toml").server.memory_budget
    assert budget is not None and budget.size_bytes == size and (budget.share is None) == (share is None)
    assert share is None or math.isclose(budget.share, share)
    assert budget.bytes_of(64 * 2**30) == (size if size is not None else int(64 * 2**30 * share))


def test_no_memory_budget_by_default_and_a_bad_one_names_the_key() -> None:
    assert parse_settings(MODEL, "m.toml").server.memory_budget is None
    for bad in ('"0%"', '"120%"', '"16"', "16", '"16 parsecs"', '"0GiB"'):
        error = _error(f"[server]\nmemory_budget = {bad}\n" + MODEL)
        assert error.key == "server.memory_budget" and '"16GiB"' in error.problem and '"80%"' in error.problem


def test_local_and_upstream_models_are_separate_types() -> None:
    settings = parse_settings(MODEL + UPSTREAM, "m.toml")
    local, upstream = settings.models
    assert isinstance(local, LocalModel) and isinstance(upstream, UpstreamModel)
    assert {"slots", "keep_alive", "path"} <= table_keys(LocalModel) and not {"slots", "keep_alive", "path"} & table_keys(UpstreamModel)
    assert {"base_url", "read_timeout_s"} <= table_keys(UpstreamModel) and not {"base_url", "read_timeout_s"} & table_keys(LocalModel)
    assert upstream.upstream.read_timeout_s == 60.0 and upstream.upstreams[0].model == "big"


def test_what_the_writer_writes_the_reader_reads_back() -> None:
    """Every model in the repository's configs, written as TOML from its declaration, reads back equal."""
    for path in [ROOT / "models.toml", ROOT / "bench" / "fleets" / "fleet.toml"]:
        for i, model in enumerate(load_settings(path).models):
            assert isinstance(model, LocalModel)
            assert decode(LocalModel, to_toml(model), f"models[{i}]", Where(str(path), path.resolve().parent)) == model


def test_the_writer_checks_a_value_against_its_declaration_before_touching_the_file(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text("# mine\n" + MODEL)
    before = config.read_text()
    with pytest.raises(ConfigError, match=r"^.*models\.toml: models\[1\]\.slots: expected an integer between 1 and 256, got 0$"):
        append_table(config, "models", {"alias": "copy", "path": "copy.gguf", "slots": 0})
    with pytest.raises(ConfigError, match=r"models\[1\]\.colour: unknown key"):
        append_table(config, "models", {"alias": "copy", "path": "copy.gguf", "colour": "blue"})
    assert config.read_text() == before
    settings = append_table(config, "models", {"alias": "copy", "path": tmp_path / "copy.gguf", "keep_alive": KeepAlive.from_toml("1h"),
                                               "gpu_layers": "auto"})
    assert config.read_text().startswith(before) and 'keep_alive = "1h"' in config.read_text()
    added = settings.model("copy")
    assert isinstance(added, LocalModel) and added.path == tmp_path / "copy.gguf" and added.keep_alive_s == 3600.0


def test_value_forms_stand_alone() -> None:
    assert KeepAlive.from_toml("2m").to_toml() == "2m" and KeepAlive.from_toml(-1).seconds is None
    assert MemoryBudget.from_toml("75%").bytes_of(1000) == 750
    with pytest.raises(ValueError):
        KeepAlive.from_toml(True)
