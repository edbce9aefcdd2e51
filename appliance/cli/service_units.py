"""What `appliance service install` writes, as pure functions of one frozen plan: a systemd unit
(Linux), a launchd property list (macOS) and the env file for upstream keys. No IO here: the CLI
(appliance/cli/service.py) resolves the plan, writes the files and calls systemctl or launchctl."""

from __future__ import annotations

import math
import plistlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Scope = Literal["user", "system"]

UNIT_NAME = "appliance.service"
LAUNCHD_LABEL = "local.appliance"  # "local.": launchd's prefix for jobs nobody publishes under a domain
RESTART_S = 5
# The server waits shutdown_grace_s for requests, then cancels them and closes the engines: the
# margin is that last part, so systemd or launchd never kill a server that is still saving state.
STOP_MARGIN_S = 15


class UnitError(ValueError):
    """A path no unit can name (a newline in it, a quote in the program's path); `str()` is the message."""


@dataclass(frozen=True)
class ServicePlan:
    program: tuple[str, ...]  # what runs `appliance`: its script, or the interpreter with -m appliance.cli
    config: Path  # absolute, as `serve --config` gets it
    data_dir: Path
    env_file: Path
    grace_s: float  # [server] shutdown_grace_s
    scope: Scope
    user: str | None = None  # system scope: the account the server runs as
    restart_s: int = RESTART_S

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.program, "serve", "--config", str(self.config))

    @property
    def environment(self) -> dict[str, str]:
        # The data directory as resolved now, so another account or environment cannot move it.
        return {"APPLIANCE_CONFIG": str(self.config), "APPLIANCE_HOME": str(self.data_dir)}

    @property
    def stop_timeout_s(self) -> int:
        return math.ceil(self.grace_s) + STOP_MARGIN_S

    @property
    def log_file(self) -> Path:
        return self.data_dir / "logs" / "appliance.log"


def unit_path(scope: Scope, config_home: Path) -> Path:
    """config_home: $XDG_CONFIG_HOME, else ~/.config."""
    return config_home / "systemd" / "user" / UNIT_NAME if scope == "user" else Path("/etc/systemd/system") / UNIT_NAME


def plist_path(scope: Scope, home: Path) -> Path:
    folder = home / "Library" / "LaunchAgents" if scope == "user" else Path("/Library/LaunchDaemons")
    return folder / f"{LAUNCHD_LABEL}.plist"


def env_file_path(scope: Scope, config_home: Path) -> Path:
    return config_home / "appliance" / "env" if scope == "user" else Path("/etc/appliance/env")


def env_file_text(names: tuple[str, ...] = ()) -> str:
    """A new env file: how to fill it in, and the variables the config's upstream models name."""
    lines = ["# Environment for `appliance serve` as a service: one NAME=value a line, such as the upstream",
             "# API keys that models.toml names in api_key_env. Kept mode 0600: it holds secrets.",
             "# The service reads it when it starts: restart the service after a change."]
    return "\n".join([*lines, *(f"# {name}=" for name in dict.fromkeys(names))]) + "\n"


def _checked(text: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise UnitError(f"{what} {text!r} holds a control character; a unit cannot name it")
    if text != text.strip():
        raise UnitError(f"{what} {text!r} starts or ends with a space; systemd would drop it")
    return text


def _bare(text: str) -> bool:
    """A word systemd reads back unchanged without quotes (its specifiers and variables aside)."""
    return re.fullmatch(r"[\w/.,:+=@%$-]+", text) is not None


def systemd_word(text: str) -> str:
    """One argument of ExecStart after the program, as systemd reads it back: quoted when it must be,
    C escapes, `%%` for its specifiers and `$$` for its variable expansion."""
    text = _checked(text, "argument")
    escaped = text.replace("%", "%%").replace("$", "$$")
    if _bare(text):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_program(path: str) -> str:
    """ExecStart's program: systemd expands specifiers in it but no variables, and refuses a path
    holding a quote or a backslash however it is escaped."""
    path = _checked(path, "program")
    if any(c in path for c in "\\\"'"):
        raise UnitError(f"program {path!r} holds a quote or a backslash, which systemd refuses in an executable's path")
    escaped = path.replace("%", "%%")
    return escaped if _bare(path) else f'"{escaped}"'


def systemd_path(path: Path) -> str:
    """A path setting (WorkingDirectory, EnvironmentFile): taken as written, specifiers expanded."""
    return _checked(str(path), "path").replace("%", "%%")


def systemd_assignment(name: str, value: str) -> str:
    """One Environment= assignment, quoted whole: C escapes and specifiers, no variable expansion."""
    text = _checked(f"{name}={value}", "environment value")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def render_systemd(plan: ServicePlan) -> str:
    program, *args = plan.argv
    system = plan.scope == "system"
    unit = ["# Written by `appliance service install`: run it again rather than editing this file.",
            "[Unit]", "Description=appliance: self-hosted LLM server"]
    if system:  # upstream models need the network; a user manager has no such target
        unit += ["Wants=network-online.target", "After=network-online.target"]
    service = [
        "[Service]",
        "Type=exec",
        "ExecStart=" + " ".join([systemd_program(program), *map(systemd_word, args)]),
        *(f"Environment={systemd_assignment(k, v)}" for k, v in plan.environment.items()),
        # "-": a server without upstream models needs no keys, so a deleted env file must not stop it.
        f"EnvironmentFile=-{systemd_path(plan.env_file)}",
        f"WorkingDirectory={systemd_path(plan.data_dir)}",
        "Restart=on-failure",
        f"RestartSec={plan.restart_s}",
        # SIGTERM starts the server's drain of shutdown_grace_s; SIGKILL only after that and the margin.
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={plan.stop_timeout_s}",
        "StandardOutput=journal",
        "StandardError=journal",
        "SyslogIdentifier=appliance",
    ]
    if system:
        if not plan.user:
            raise UnitError("a system unit needs the user it runs as")
        service += [f"User={_checked(plan.user, 'user')}", "NoNewPrivileges=yes"]
    install = ["[Install]", f"WantedBy={'multi-user.target' if system else 'default.target'}"]
    return "\n".join([*unit, "", *service, "", *install]) + "\n"


# launchd has no EnvironmentFile: a POSIX shell reads the env file, then becomes the server. The
# paths travel as arguments, never inside the script, so no quoting of them can go wrong.
_SOURCE_THEN_EXEC = 'set -a; if [ -r "$0" ]; then . "$0"; fi; set +a; exec "$@"'


def launchd_plist(plan: ServicePlan) -> dict[str, Any]:
    plist: dict[str, Any] = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": ["/bin/sh", "-c", _SOURCE_THEN_EXEC, str(plan.env_file), *plan.argv],
        "EnvironmentVariables": plan.environment,
        "WorkingDirectory": str(plan.data_dir),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted after a failure, not after a clean stop
        "ThrottleInterval": plan.restart_s,
        "ExitTimeOut": plan.stop_timeout_s,
        "StandardOutPath": str(plan.log_file),
        "StandardErrorPath": str(plan.log_file),
        "ProcessType": "Interactive",  # an LLM server: launchd must not throttle its CPU as a background job
    }
    if plan.scope == "system":
        if not plan.user:
            raise UnitError("a system daemon needs the user it runs as")
        plist["UserName"] = plan.user
    return plist


def render_plist(plan: ServicePlan) -> bytes:
    return plistlib.dumps(launchd_plist(plan))


def parse_properties(text: str) -> dict[str, str]:
    """`systemctl show`'s KEY=value lines."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_launchctl_print(text: str) -> dict[str, str]:
    """The top-level `name = value` lines of `launchctl print` (state, pid, last exit code, path)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("\t") and not line.startswith("\t\t") and " = " in line:
            key, value = line.strip().split(" = ", 1)
            if value != "{":  # a nested block's opening, not a value
                found.setdefault(key, value)
    return found


def systemctl_line(scope: Scope, *args: str, sudo: bool = False) -> str:
    return " ".join([*(["sudo"] if sudo else []), "systemctl", *(["--user"] if scope == "user" else []), *args])


def journal_line(scope: Scope) -> str:
    return f"journalctl {'--user ' if scope == 'user' else ''}-u appliance"


def systemd_hint(scope: Scope, props: dict[str, str] | None, sudo: bool = False) -> str:
    """What to do next about an installed unit, from `systemctl show` (None: systemd is not running)."""
    start = systemctl_line(scope, "daemon-reload", sudo=sudo) + " && " + systemctl_line(scope, "enable --now appliance", sudo=sudo)
    if props is None:
        return f"systemd is not running here; where it runs: {start}"
    if props.get("LoadState") != "loaded":
        return f"systemd has not read the unit yet: {start}"
    if props.get("ActiveState") == "active":
        enable = "" if props.get("UnitFileState") == "enabled" else \
            f"; it does not start at boot until {systemctl_line(scope, 'enable appliance', sudo=sudo)}"
        return f"logs: {journal_line(scope)} -f{enable}"
    if props.get("ActiveState") == "failed":
        return f"see why: {journal_line(scope)} -e; then {systemctl_line(scope, 'restart appliance', sudo=sudo)}"
    return f"start it: {systemctl_line(scope, 'enable --now appliance', sudo=sudo)}"
