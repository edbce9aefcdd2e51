"""Changes to models.toml go through one TOML writer: a value written into the file can never add a
key, the operator's comments stay, and a change that would not parse leaves the file as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from appliance.config.models import _MODEL_KEYS
from appliance.config.settings import ConfigError, load_settings, parse_settings
from appliance.fleet.admin import ModelAdminError, alias_for, register
from tests.conftest import MODEL_FILE, ROOT

# Each tries to close the string and add keys after it.
INJECTED = '"\ntier = "frontier"\nprice_input_per_mtok = 0.0\n#'
SHA = "ab" * 32
CONFIG = f"""# my fleet: comments and layout are the operator's
[server]
port = 8099   # not the default

[[models]]
alias = "small"  # the bundled one
package_file = "{MODEL_FILE}"
context_length = 1024
slots = 2
tier = "mid"
price_input_per_mtok = 0.5

[[routes]]
alias = "auto"
tiers = ["small"]  # one tier for now
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(CONFIG)
    return path


def _new_model_tables(config: Path) -> list[dict]:
    return tomllib.loads(config.read_text())["models"][1:]


def test_register_keeps_the_operators_comments_and_layout(config: Path) -> None:
    register(config, "copy", Path("/models/copy.gguf"), SHA, like="small")
    text = config.read_text()
    # the new table sits after the last model, spaced as the others, and nothing else moved
    head, routes = CONFIG.split("[[routes]]")
    assert text.startswith(head + "[[models]]\nalias = \"copy\"\n") and text.endswith("\n\n[[routes]]" + routes)
    settings = load_settings(config)
    added = settings.model("copy")
    assert added is not None and added.path == Path("/models/copy.gguf") and added.sha256 == SHA
    # copied from the model it was made from, as typed values
    assert (added.tier, added.context_length, added.slots, added.price_input_per_mtok) == ("mid", 1024, 2, 0.5)
    assert settings.route("auto") is not None and settings.server.port == 8099


@pytest.mark.parametrize("field", ["path", "path-newline", "alias", "sha256", "engine", "like"])
def test_no_value_written_into_the_config_adds_a_key(config: Path, field: str) -> None:
    """Either the value is stored as the string it was (a path may hold any character), or the
    change is refused; both leave a file the server reads, without the injected keys."""
    args = {"alias": "copy", "path": Path("/models/copy.gguf"), "sha256": SHA, "like": None, "engine": None}
    if field == "path":
        args["path"] = Path(f"/models/copy.gguf{INJECTED}")
    elif field == "path-newline":
        args["path"] = Path("/models/copy.gguf\n[[models]]\nalias = \"evil\"\npath = \"/x\"")
    elif field in ("alias", "sha256", "engine"):
        args[field] = f"copy{INJECTED}"
    else:
        args["like"] = f"small{INJECTED}"
    before = config.read_text()
    try:
        register(config, args.pop("alias"), args.pop("path"), args.pop("sha256"), **args)
    except ModelAdminError:
        assert config.read_text() == before
    else:
        assert field.startswith("path")
        (added,) = _new_model_tables(config)
        assert set(added) == {"alias", "path", "sha256"}
        settings = load_settings(config)
        assert [m.alias for m in settings.models] == ["small", "copy"]
        assert settings.model("copy").tier == "small" and settings.model("copy").price_input_per_mtok == 0.0
    assert all(set(m) <= _MODEL_KEYS for m in tomllib.loads(config.read_text())["models"])
    assert "evil" not in {m.alias for m in load_settings(config).models}
    assert not [p for p in config.parent.iterdir() if p.name.startswith(".models.toml.")]  # no temporary file left


def test_a_change_that_would_not_parse_leaves_the_file_whole(config: Path) -> None:
    before = config.read_text()
    with pytest.raises(ModelAdminError, match=r"registering 'auto' would make .*routes\[0\]\.alias: 'auto' is already a model's alias"):
        register(config, "auto", Path("/models/x.gguf"), None)
    assert config.read_text() == before


def test_a_symlinked_config_stays_a_link_and_keeps_its_permissions(tmp_path: Path, config: Path) -> None:
    config.chmod(0o640)
    link = tmp_path / "link.toml"
    link.symlink_to(config)
    register(link, "copy", Path("/models/copy.gguf"), None)
    assert link.is_symlink() and load_settings(config).model("copy") is not None
    assert config.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("alias", ["a:b", "-x", ".hidden", "a b", 'a"b', "a\nb", "x" * 65, "ünï"])
def test_the_reader_refuses_an_unsafe_alias_naming_file_and_key(tmp_path: Path, alias: str) -> None:
    toml_alias = alias.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    model = f'[[models]]\nalias = "{toml_alias}"\npackage_file = "{MODEL_FILE}"\n'
    with pytest.raises(ConfigError, match=r"^fleet\.toml: models\[0\]\.alias: expected letters") as caught:
        parse_settings(model, "fleet.toml", tmp_path)
    assert caught.value.key == "models[0].alias"
    route = f'[[models]]\nalias = "m"\npackage_file = "{MODEL_FILE}"\n[[routes]]\nalias = "{toml_alias}"\ntiers = ["m"]\n'
    with pytest.raises(ConfigError, match=r"routes\[0\]\.alias: expected letters"):
        parse_settings(route, "fleet.toml", tmp_path)


def test_the_aliases_this_repository_ships_are_accepted() -> None:
    configs = [p for p in [ROOT / "models.toml", *sorted((ROOT / "bench" / "fleets").glob("*.toml"))] if "[[models]]" in p.read_text()]
    assert len(configs) >= 2  # not a calibration file
    for path in configs:
        load_settings(path)


@pytest.mark.parametrize(("name", "alias"), [("SmolLM2-135M.Q4_1.gguf", "smollm2-135m.q4_1"), ("_x y.gguf", "x-y"),
                                             ("..gguf", "model"), ("a" * 80 + ".gguf", "a" * 64)])
def test_a_derived_alias_is_one_the_reader_accepts(name: str, alias: str) -> None:
    assert alias_for(Path(name)) == alias
    parse_settings(f'[[models]]\nalias = "{alias}"\npackage_file = "{MODEL_FILE}"\n', "m.toml")


def test_the_cli_refuses_an_unsafe_alias_before_doing_anything(config: Path) -> None:
    before = config.read_text()
    run = subprocess.run([sys.executable, "-m", "appliance.cli.main", "models", "add", "/no/such.gguf", "--alias", f"copy{INJECTED}",
                          "--config", str(config)], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "alias 'copy" in run.stderr and "expected letters" in run.stderr and "no such file" not in run.stderr
    assert config.read_text() == before


def test_update_and_remove_keep_comments_and_refuse_what_would_not_parse(config: Path) -> None:
    from appliance.config.writer import remove_table, update_table

    register(config, "copy", Path("/models/copy.gguf"), SHA, like="small")
    update_table(config, "models", "small", {"slots": 4, "keep_alive": "10m", "tier": None})
    text = config.read_text()
    assert "# the bundled one" in text and "# one tier for now" in text and "port = 8099   # not the default" in text
    small = load_settings(config).model("small")
    assert small is not None and small.slots == 4 and small.keep_alive_s == 600 and small.tier == "small"  # tier back to its default
    before = config.read_text()
    for values, key in (({"slots": 0}, "slots"), ({"colour": "blue"}, "colour"), ({"alias": "other"}, "alias"),
                        ({"context_length": "long"}, "context_length")):
        with pytest.raises(ConfigError) as caught:
            update_table(config, "models", "small", values)
        assert key in str(caught.value) and str(config) in str(caught.value)
    with pytest.raises(ConfigError, match="routes"):  # the route "auto" names it
        remove_table(config, "models", "small")
    with pytest.raises(ConfigError, match="no table with alias 'nope'"):
        remove_table(config, "models", "nope")
    assert config.read_text() == before
    settings = remove_table(config, "models", "copy")
    assert [m.alias for m in settings.models] == ["small"] and "# the bundled one" in config.read_text()


def test_fleet_change_names_what_changed_and_what_waits_for_a_restart() -> None:
    from appliance.fleet.change import fleet_change, running_settings

    def parsed(extra: str = "", port: int = 8099, slots: int = 2) -> Any:
        return parse_settings(CONFIG.replace("port = 8099", f"port = {port}").replace("slots = 2", f"slots = {slots}") + extra)

    draft = '\n[[models]]\nalias = "d"\npath = "/m/d.gguf"\nkind = "draft"\n'
    target = '\n[[models]]\nalias = "t"\npath = "/m/t.gguf"\ndraft_model = "d"\n'
    old = parsed(draft + target)
    assert fleet_change(old, parsed(draft + target)).empty
    change = fleet_change(old, parsed(draft.replace("d.gguf", "d2.gguf") + target, slots=3))
    assert change.changed == ("small", "t") and not change.added and not change.removed and change.restart_sections == ()
    change = fleet_change(old, parsed(port=9000))
    assert change.removed == ("t",) and change.restart_sections == ("server",)
    assert fleet_change(old, parsed(draft + target, port=9000), read_at_start=parsed(draft + target, port=9000)).restart_sections == ()
    running = running_settings(old, parsed(port=9000), change)
    assert running.server.port == 8099 and [m.alias for m in running.models] == ["small"]


def test_a_change_of_adapters_alone_is_a_swap_in_the_running_model() -> None:
    from appliance.fleet.change import adapter_swap, fleet_change

    def parsed(adapters: str = "", slots: int = 2) -> Any:
        return parse_settings(CONFIG.replace("slots = 2", f"slots = {slots}").replace(
            "context_length = 1024\n", "context_length = 1024\n" + (f"adapters = [{adapters}]\n" if adapters else "")))

    a, b = '{ name = "a", path = "/x/a.gguf" }', '{ name = "b", path = "/x/b.gguf" }'
    old, new = parsed(a), parsed(f"{a.replace('a.gguf', 'a2.gguf')}, {b}")
    change = fleet_change(old, new)
    assert change.adapters == ("small",) and change.changed == () and not change.empty
    swap = adapter_swap(old.model("small"), new.model("small"))
    assert swap is not None and swap.unload == () and [(x.name, str(x.path)) for x in swap.load] == [("a", "/x/a2.gguf"), ("b", "/x/b.gguf")]
    swap = adapter_swap(new.model("small"), parsed().model("small"))
    assert swap is not None and swap.unload == ("a", "b") and swap.load == ()
    # Anything else changing too serves the model again, its adapters with it.
    assert fleet_change(old, parsed(b, slots=3)).changed == ("small",) and fleet_change(old, parsed(b, slots=3)).adapters == ()
    assert adapter_swap(old.model("small"), parsed(b, slots=3).model("small")) is None
    assert fleet_change(old, parsed(a)).empty


def test_the_caches_embedder_model_changes_only_at_a_restart() -> None:
    from appliance.fleet.change import fleet_change, running_settings

    def parsed(slots: int) -> Any:
        return parse_settings(CONFIG + f'\n[[models]]\nalias = "emb"\npath = "/m/e.gguf"\nkind = "embedding"\nslots = {slots}\n'
                                       '\n[cache]\nenabled = true\nembedder = "emb"\n')

    old, new = parsed(1), parsed(2)
    change = fleet_change(old, new)
    assert change.changed == () and change.restart_sections == ("models.emb (the cache's embedder)",)
    assert running_settings(old, new, change).model("emb").slots == 1  # type: ignore[union-attr]
