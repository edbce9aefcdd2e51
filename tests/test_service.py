"""`appliance service`: the systemd unit and launchd property list as pure renderings (systemd's own
verifier reads the unit), and install, status and uninstall through the real CLI into a fake home
where systemctl is out of reach."""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli.main import main
from appliance.cli.service_units import (
    ServicePlan, UnitError, launchd_plist, parse_launchctl_print, parse_properties, render_plist, render_systemd,
    systemd_hint, systemd_word,
)
from tests.conftest import MODEL_FILE, ROOT

APPLIANCE = ROOT / ".venv" / "bin" / "appliance"
MODEL = f'[[models]]\nalias = "m"\npackage_file = "{MODEL_FILE}"\n'
UPSTREAM = '[[models]]\nalias = "far"\nengine = "openai"\nbase_url = "http://gpu1:8000/v1"\napi_key_env = "FAR_API_KEY"\n'
ODD = 'odd dir 50% $HOME "q" back\\slash'  # every character systemd reads specially in an argument


def plan(tmp_path: Path, scope: str = "user", program: tuple[str, ...] = (str(APPLIANCE),), **changes: object) -> ServicePlan:
    values: dict[str, object] = dict(program=program, config=tmp_path / ODD / "models.toml", data_dir=tmp_path / "data dir",
                                     env_file=tmp_path / "conf dir" / "env", grace_s=12.5, scope=scope,
                                     user="root" if scope == "system" else None)
    return ServicePlan(**{**values, **changes})  # type: ignore[arg-type]


def systemd_unquote(line: str) -> list[str]:
    """ExecStart's words as systemd.service(5) says it reads them: quotes, C escapes, %% and $$."""
    words, word, quoted, i = [], None, False, 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            word, i = (word or "") + line[i + 1], i + 2
            continue
        if c == '"':
            quoted, word = not quoted, word or ""
        elif c == " " and not quoted:
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + c
        i += 1
    words.append(word or "")

    def literal(match: re.Match[str]) -> str:
        if match[0] not in ("%%", "$$"):  # systemd would expand it: a specifier, or a variable
            raise AssertionError(f"systemd expands {match[0]!r}")
        return match[0][0]

    return [re.sub(r"%.?|\$\$|\$", literal, w) for w in words]


@pytest.mark.parametrize("text", ["serve", "/a b/models.toml", 'say "hi"', "C:\\back", "100%", "$HOME", "${X}", ODD, "ünï côdé"])
def test_an_argument_reads_back_as_written(text: str) -> None:
    assert systemd_unquote(systemd_word(text)) == [text]


@pytest.mark.parametrize("text", ["a\nb", "tab\there", " leading", "trailing "])
def test_what_a_unit_cannot_hold_is_refused_not_mangled(text: str) -> None:
    with pytest.raises(UnitError):
        systemd_word(text)


def test_the_unit_runs_serve_with_the_config_restarts_on_failure_and_outlasts_the_grace(tmp_path: Path) -> None:
    unit = render_systemd(plan(tmp_path))
    lines = unit.splitlines()
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert systemd_unquote(exec_start.removeprefix("ExecStart=")) == [str(APPLIANCE), "serve", "--config", str(tmp_path / ODD / "models.toml")]
    for expected in ("Restart=on-failure", "RestartSec=5", "TimeoutStopSec=28", "StandardOutput=journal", "StandardError=journal",
                     f"EnvironmentFile=-{tmp_path}/conf dir/env", f"WorkingDirectory={tmp_path}/data dir", "WantedBy=default.target"):
        assert expected in lines
    assert not any(line.startswith(("User=", "After=network")) for line in lines)  # a user unit runs as its user
    system = render_systemd(plan(tmp_path, "system", user="alice")).splitlines()
    assert "User=alice" in system and "WantedBy=multi-user.target" in system
    with pytest.raises(UnitError):
        render_systemd(plan(tmp_path, "system", user=None))


def test_a_program_path_systemd_refuses_is_said_at_render(tmp_path: Path) -> None:
    with pytest.raises(UnitError, match="quote or a backslash"):
        render_systemd(plan(tmp_path, program=(f'{tmp_path}/it"s/appliance',)))


def _verify(unit: Path, scope: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True, mode=0o700)
    flags = ["--user"] if scope == "user" else []
    # --user needs a runtime directory even offline; a container has none.
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *flags, str(unit)], capture_output=True, text=True,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed, so no systemd to ask")
@pytest.mark.parametrize("scope", ["user", "system"])
def test_systemd_analyze_verifies_the_unit_with_spaces_and_specials_in_its_paths(tmp_path: Path, scope: str) -> None:
    # The program through a folder with a space, % and $: systemd checks that this very path is executable.
    folder = tmp_path / "my venv 100% $X" / "bin"
    folder.mkdir(parents=True)
    (folder / "appliance").symlink_to(APPLIANCE)
    the_plan = plan(tmp_path, scope, program=(str(folder / "appliance"),))
    the_plan.data_dir.mkdir()
    unit = tmp_path / "units" / "appliance.service"
    unit.parent.mkdir()
    unit.write_text(render_systemd(the_plan))
    done = _verify(unit, scope, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # The same unit with the program left unquoted names a file that is not there: verify does look.
    program = f"{folder}/appliance".replace("%", "%%")
    unit.write_text(render_systemd(the_plan).replace(f'"{program}"', program))
    assert _verify(unit, scope, tmp_path).returncode != 0


def test_the_plist_round_trips_and_keeps_a_failed_server_alive(tmp_path: Path) -> None:
    the_plan = plan(tmp_path)
    plist = plistlib.loads(render_plist(the_plan))
    assert plist == launchd_plist(the_plan)
    assert plist["Label"] == "local.appliance"
    assert plist["ProgramArguments"][-4:] == [str(APPLIANCE), "serve", "--config", str(tmp_path / ODD / "models.toml")]
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    assert plist["EnvironmentVariables"]["APPLIANCE_CONFIG"] == str(tmp_path / ODD / "models.toml")
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(tmp_path / "data dir" / "logs" / "appliance.log")
    assert plist["ExitTimeOut"] == 28 and "UserName" not in plist
    assert launchd_plist(plan(tmp_path, "system", user="alice"))["UserName"] == "alice"


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="no POSIX shell")
def test_the_plist_program_reads_the_env_file_then_becomes_the_server(tmp_path: Path) -> None:
    show = "import os, sys; print(os.environ.get('FAR_API_KEY'), *sys.argv[1:], sep='\\n')"
    the_plan = plan(tmp_path, program=(sys.executable, "-c", show), env_file=tmp_path / ODD / "env")
    argv = launchd_plist(the_plan)["ProgramArguments"]
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert ran.stdout.splitlines() == ["None", "serve", "--config", str(the_plan.config)]  # no env file yet: still starts
    the_plan.env_file.parent.mkdir(parents=True)
    the_plan.env_file.write_text("# keys\nFAR_API_KEY='k 1'\n")
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert ran.stdout.splitlines() == ["k 1", "serve", "--config", str(the_plan.config)]


@pytest.mark.parametrize(("scope", "props", "sudo", "says"), [
    ("user", None, False, "systemd is not running here; where it runs: systemctl --user daemon-reload"),
    ("user", {"LoadState": "not-found"}, False, "has not read the unit yet"),
    ("user", {"LoadState": "loaded", "ActiveState": "active", "UnitFileState": "enabled"}, False, "logs: journalctl --user -u appliance -f"),
    ("user", {"LoadState": "loaded", "ActiveState": "active", "UnitFileState": "disabled"}, False, "systemctl --user enable appliance"),
    ("system", {"LoadState": "loaded", "ActiveState": "failed"}, True, "journalctl -u appliance -e; then sudo systemctl restart"),
    ("system", {"LoadState": "loaded", "ActiveState": "inactive"}, False, "start it: systemctl enable --now appliance"),
])
def test_the_status_hint_follows_the_state(scope: str, props: dict[str, str] | None, sudo: bool, says: str) -> None:
    assert says in systemd_hint(scope, props, sudo=sudo)  # type: ignore[arg-type]


def test_systemctl_show_and_launchctl_print_are_read() -> None:
    assert parse_properties("LoadState=loaded\nActiveState=active\nExecMainStatus=0\nX=a=b\n")["X"] == "a=b"
    printed = ("gui/501/local.appliance = {\n\tactive count = 1\n\tstate = running\n\tpid = 4242\n"
               "\tenvironment = {\n\t\tstate = nested\n\t}\n\tlast exit code = 1\n}\n")
    assert parse_launchctl_print(printed) == {"active count": "1", "state": "running", "pid": "4242", "last exit code": "1"}


# Through the CLI, in a fake home. PATH without systemctl keeps a developer's own systemd out of it;
# capfd, not capsys: `main` registers a signal handler on the real stderr.

@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def appliance(home: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": "", "PATH": str(home / "no-bin")}
    environ.pop("APPLIANCE_CONFIG", None)
    environ.update(env or {})
    return subprocess.run([str(APPLIANCE), "service", *args], capture_output=True, text=True, cwd=cwd or home, env=environ, timeout=120)


def write_config(folder: Path, text: str = "[server]\nshutdown_grace_s = 12.5\n" + MODEL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models.toml").write_text(text)
    return folder / "models.toml"


def test_dry_run_prints_the_unit_naming_the_config_serve_would_find_and_writes_nothing(home: Path, tmp_path: Path, data_dir: Path) -> None:
    config = write_config(tmp_path / "the project")
    done = appliance(home, "install", "--user", "--dry-run", cwd=config.parent)  # ./models.toml, as `serve` finds it
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"# {home}/.config/systemd/user/appliance.service"
    assert f'ExecStart={APPLIANCE} serve --config "{config}"' in lines
    assert f'Environment="APPLIANCE_HOME={data_dir}"' in lines and "TimeoutStopSec=28" in lines
    assert not (home / ".config").exists()
    by_env = appliance(home, "install", "--print", env={"APPLIANCE_CONFIG": str(config)})
    assert f'ExecStart={APPLIANCE} serve --config "{config}"' in by_env.stdout.splitlines()


def test_install_status_uninstall_without_systemd(home: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "conf", "[server]\nshutdown_grace_s = 3\n" + MODEL + UPSTREAM)
    unit = home / ".config" / "systemd" / "user" / "appliance.service"
    env_file = home / ".config" / "appliance" / "env"

    done = appliance(home, "install", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert ("to start it (systemd is not running here): "
            "systemctl --user daemon-reload && systemctl --user enable --now appliance") in done.stdout
    assert "put FAR_API_KEY in" in done.stdout
    printed = appliance(home, "install", "--dry-run", "--config", str(config)).stdout
    assert unit.read_text() == printed.split("\n", 1)[1].rsplit("# and", 1)[0]  # what --dry-run shows is what is written
    assert "TimeoutStopSec=18" in unit.read_text().splitlines()
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert "# FAR_API_KEY=" in env_file.read_text().splitlines()

    status = appliance(home, "status")
    assert status.returncode == 0, status.stderr
    assert f"user service: {unit}" in status.stdout and "installed: yes" in status.stdout
    assert f'--config {config}' in status.stdout and "enabled: unknown (systemd is not running here)" in status.stdout

    # An enabled unit's link, as `systemctl enable` leaves it; without systemd, uninstall removes it too.
    wants = unit.parent / "default.target.wants" / "appliance.service"
    wants.parent.mkdir()
    wants.symlink_to(unit)
    gone = appliance(home, "uninstall", "--user")
    assert gone.returncode == 0, gone.stderr
    assert not unit.exists() and not wants.is_symlink()
    assert env_file.exists() and "kept" in gone.stdout  # it holds the keys
    after = appliance(home, "status")
    assert after.returncode == 1 and "not installed" in after.stdout
    assert appliance(home, "uninstall").returncode == 0  # nothing left: still fine


def test_install_keeps_an_env_file_that_is_there_and_no_start_starts_nothing(home: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "conf", MODEL + UPSTREAM)
    env_file = home / ".config" / "appliance" / "env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text("FAR_API_KEY=secret\n")
    env_file.chmod(0o644)
    done = appliance(home, "install", "--no-start", "--config", str(config), env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    assert "to start it (--no-start)" in done.stdout and "put FAR_API_KEY" not in done.stdout
    assert env_file.read_text() == "FAR_API_KEY=secret\n"
    assert "others may read it (mode 0644)" in done.stderr


def test_system_without_root_says_sudo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "conf")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("SUDO_USER", "root")  # any account this machine has
    assert main(["service", "install", "--system", "--config", str(config)]) == 1
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and "run it with sudo: sudo " in err and f"--config {config}" in err
    assert main(["service", "install", "--system", "--run-as", "no-such-user-here", "--dry-run", "--config", str(config)]) == 1
    assert "no user 'no-such-user-here'" in capfd.readouterr().err


def test_other_systems_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    assert main(["service", "status"]) == 1
    assert capfd.readouterr().err == "error: services are installed on Linux (systemd) and macOS (launchd), not on win32\n"


def test_macos_dry_run_prints_a_launch_agent(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "conf")
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("HOME", str(home))
    assert main(["service", "install", "--dry-run", "--config", str(config)]) == 0
    first, rest = capfd.readouterr().out.split("\n", 1)
    assert first == f"# {home}/Library/LaunchAgents/local.appliance.plist"
    plist = plistlib.loads(rest.rsplit("# and", 1)[0].encode())
    assert plist["EnvironmentVariables"]["APPLIANCE_CONFIG"] == str(config)
    assert plist["ProgramArguments"][-3:] == ["serve", "--config", str(config)]
