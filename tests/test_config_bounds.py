"""Every number in models.toml has both bounds in its one declaration (what llama.cpp and the machine
can take), and the reader and the writer refuse a value past either, naming the file and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_origin

import msgspec
import pytest

from appliance.config.schema import _metas, keys_of, strip
from appliance.config.values import KeepAlive, MemoryBudget
from appliance.config.writer import update_table
from appliance.config.settings import SECTIONS, ConfigError, parse_settings
from tests.conftest import MODEL_FILE

MODEL = f'[[models]]\nalias = "m"\npackage_file = "{MODEL_FILE}"\n'
UPSTREAM = '[[models]]\nalias = "m"\nengine = "openai"\nbase_url = "http://gpu1:8000/v1"\n'


def _numbers(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, low, high) for every number declared in `cls` and the tables inside it."""
    out = []
    for k in keys_of(cls):
        tp = strip(k.type)
        members = [strip(a) for a in get_args(tp)] if get_origin(tp) is not tuple and get_args(tp) else [tp]
        for member in [tp, *members]:
            if member in (int, float):
                metas = _metas(k.type) if member is tp else next(_metas(a) for a in get_args(tp) if strip(a) is member)
                low = next((m.ge for m in metas if m.ge is not None), None)
                high = next((m.le for m in metas if m.le is not None), None)
                out.append((prefix + k.name, low, high))
                break
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            out += _numbers(tp, "" if k.extra.get("flatten") else f"{prefix}{k.name}.")
        elif get_origin(tp) is tuple and isinstance(item := strip(get_args(tp)[0]), type) and issubclass(item, msgspec.Struct):
            out += _numbers(item, f"{prefix}{k.name}[].")
    return out


DECLARED = [(section.name, cls, *number) for section in SECTIONS for cls in section.types for number in _numbers(cls)]


def test_every_number_declares_both_bounds() -> None:
    unbounded = [f"{section}.{key} ({cls.__name__})" for section, cls, key, low, high in DECLARED if low is None or high is None]
    assert not unbounded, unbounded
    assert len(DECLARED) > 50  # the walk found the tables' numbers, nested ones included


def _text(section: str, cls: type, key: str, value: str) -> tuple[str, str]:
    """Config text setting `key` of one table of `section` to `value`, and the dotted key an error names."""
    if key == "adapters[].scale":
        return MODEL + f'[[models.adapters]]\nname = "a"\npath = "a.gguf"\nscale = {value}\n', "models[0].adapters[0].scale"
    if section == "limits":
        return MODEL + f'[[limits]]\nlevel = "tenant"\n{key} = {value}\n', f"limits[0].{key}"
    if section == "routes":
        return MODEL + f'[[routes]]\nalias = "r"\ntiers = ["m"]\n{key} = {value}\n', f"routes[0].{key}"
    if section != "models":
        return f"[{section}]\n{key} = {value}\n" + MODEL, f"{section}.{key}"
    return (UPSTREAM if cls.__name__ == "UpstreamModel" else MODEL) + f"{key} = {value}\n", f"models[0].{key}"


@pytest.mark.parametrize(("section", "cls", "key", "low", "high"), DECLARED, ids=lambda v: v if isinstance(v, str) else None)
def test_a_value_past_the_upper_bound_is_refused_naming_the_key(section: str, cls: type, key: str, low: Any, high: Any) -> None:
    past = high + 1 if isinstance(high, int) else high * 2 + 1
    text, dotted = _text(section, cls, key, repr(past) if isinstance(past, int) else f"{past:.1f}")
    with pytest.raises(ConfigError) as info:
        parse_settings(text, "fleet.toml")
    assert info.value.key == dotted and f"{high}" in info.value.problem
    assert str(info.value).startswith(f"fleet.toml: {dotted}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", ["price_input_per_mtok", "temperature"])
def test_infinity_and_nan_are_not_numbers_here(key: str, value: str) -> None:
    text = MODEL + f"{key} = {value}\n" if key.startswith("price") else f"[defaults]\n{key} = {value}\n" + MODEL
    with pytest.raises(ConfigError) as info:
        parse_settings(text, "fleet.toml")
    assert info.value.key.endswith(key)


@pytest.mark.parametrize(("key", "value"), [("batch_tokens", 2**31), ("batch_tokens", 65537), ("context_length", 2**21),
                                            ("kv_tokens", 2**32), ("gpu_layers", 2**31), ("threads", 10**6), ("slots", 257)])
def test_what_would_crash_llama_cpp_is_refused_by_the_reader_and_the_writer(tmp_path: Path, key: str, value: int) -> None:
    """batch_tokens = 2**31 ended the process inside libllama, at every start after the API wrote it."""
    with pytest.raises(ConfigError) as info:
        parse_settings(MODEL + f"{key} = {value}\n", "fleet.toml")
    assert info.value.key == f"models[0].{key}"
    config = tmp_path / "models.toml"
    config.write_text(MODEL)
    with pytest.raises(ConfigError) as info:
        update_table(config, "models", "m", {key: value})
    assert info.value.key == f"models[0].{key}" and f"got {value}" in str(info.value)
    assert config.read_text() == MODEL


@pytest.mark.parametrize("value", ["366d", "9000h", "99999999999999999999999999999999h", "1e400s"])
def test_a_keep_alive_past_a_year_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="up to a year"):
        KeepAlive.from_toml(value)
    assert KeepAlive.from_toml("8760h").seconds == 365 * 86400.0


@pytest.mark.parametrize("value", ["2PiB", "9" * 400 + "TB", "1025TiB"])
def test_a_memory_budget_past_a_petabyte_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="up to 1PiB"):
        MemoryBudget.from_toml(value)
    assert MemoryBudget.from_toml("1024TiB").size_bytes == 1 << 50


def test_a_key_sent_to_a_new_server_is_a_new_destination(tmp_path: Path) -> None:
    from appliance.fleet.change import new_key_destinations
    from appliance.config.settings import load_settings

    def settings(base_url: str, env: str | None) -> Any:
        key = f'api_key_env = "{env}"\n' if env else ""
        path = tmp_path / "models.toml"
        path.write_text(f'[[models]]\nalias = "far"\nengine = "openai"\nbase_url = "{base_url}"\nupstream_model = "x"\n{key}')
        return load_settings(path)

    old = settings("https://api.example.com/v1", "K")
    assert new_key_destinations(old, settings("https://API.example.com/v2", "K")) == []
    assert new_key_destinations(old, settings("https://api.example.com/v1", None)) == []
    assert new_key_destinations(old, settings("https://evil.example/v1", "K")) == ["K to https://evil.example"]
    assert new_key_destinations(old, settings("https://api.example.com/v1", "L")) == ["L to https://api.example.com"]
    assert new_key_destinations(old, settings("http://api.example.com/v1", "K")) == ["K to http://api.example.com"]
