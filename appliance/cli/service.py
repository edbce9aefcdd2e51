"""`appliance service install|status|uninstall`: `appliance serve` run by systemd (Linux) or
launchd (macOS). What is written comes from appliance/cli/service_units.py; here are the edges:
this machine's facts, the files, and systemctl or launchctl."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from appliance.cli.service_units import (
    LAUNCHD_LABEL, UNIT_NAME, Scope, ServicePlan, UnitError, env_file_path, env_file_text, journal_line,
    parse_launchctl_print, parse_properties, plist_path, render_plist, render_systemd, systemctl_line, systemd_hint, unit_path,
)
from appliance.cli.support import settings_of
from appliance.config.settings import find_config


class ServiceError(Exception):
    """A one-line reason the command cannot go on."""


@dataclass(frozen=True)
class Host:
    """What the commands read of this machine, read once."""

    system: Literal["linux", "darwin"]
    home: Path
    config_home: Path  # $XDG_CONFIG_HOME, else ~/.config: where a user unit and the user's env file go
    uid: int
    root: bool

    def service_file(self, scope: Scope) -> Path:
        return unit_path(scope, self.config_home) if self.system == "linux" else plist_path(scope, self.home)


def this_host() -> Host:
    if sys.platform.startswith("linux"):
        system: Literal["linux", "darwin"] = "linux"
    elif sys.platform == "darwin":
        system = "darwin"
    else:
        raise ServiceError(f"services are installed on Linux (systemd) and macOS (launchd), not on {sys.platform}")
    home = Path.home()
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    config_home = Path(xdg) if os.path.isabs(xdg) else home / ".config"  # the XDG spec ignores a relative one
    return Host(system, home, config_home, os.getuid(), os.geteuid() == 0)


def appliance_program() -> tuple[str, ...]:
    """The `appliance` of the environment running now, never another one found on PATH."""
    bin_dir = Path(sys.executable).parent
    script = shutil.which("appliance", path=str(bin_dir))
    if script:
        return (os.path.abspath(script),)
    return (os.path.abspath(sys.executable), "-m", "appliance.cli")


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(command, 1, "", str(exc))


def _systemctl(scope: Scope, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(["systemctl", *(["--user"] if scope == "user" else []), *args])


def systemd_usable(scope: Scope) -> bool:
    """systemctl is here and a manager answers it (not so in most containers and CI runners)."""
    if shutil.which("systemctl") is None or not Path("/run/systemd/system").is_dir():
        return False
    return scope == "system" or _systemctl("user", "show-environment").returncode == 0


def launchd_usable(host: Host) -> bool:
    return host.system == "darwin" and shutil.which("launchctl") is not None


def _domain(host: Host, scope: Scope) -> str:
    return f"gui/{host.uid}" if scope == "user" else "system"


def _scope(args: argparse.Namespace, default: Scope | None = "user") -> Scope | None:
    return "system" if args.system else "user" if args.user else default


def _run_as(args: argparse.Namespace, scope: Scope) -> str | None:
    if scope == "user":
        if args.run_as:
            raise ServiceError("--run-as is for --system: a user service runs as you")
        return None
    import getpass
    import pwd

    name = args.run_as or os.environ.get("SUDO_USER") or getpass.getuser()
    try:
        pwd.getpwnam(name)
    except KeyError:
        raise ServiceError(f"--run-as: there is no user {name!r} on this machine") from None
    return str(name)


def _upstream_keys(settings) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    return tuple(u.api_key_env for m in settings.models if m.engine == "openai" for u in m.upstreams if u.api_key_env)


def plan_for(args: argparse.Namespace, host: Host, scope: Scope) -> tuple[ServicePlan, tuple[str, ...]]:
    """The plan, and the environment variables its config's upstream models read their keys from."""
    # The file `serve --config` would read, found as `serve` finds it, then made absolute for the unit.
    config = Path(os.path.abspath(find_config(args.config)))
    settings = settings_of(config)
    plan = ServicePlan(program=appliance_program(), config=config, data_dir=settings.server.data_dir,
                       env_file=env_file_path(scope, host.config_home), grace_s=settings.server.shutdown_grace_s,
                       scope=scope, user=_run_as(args, scope))
    return plan, _upstream_keys(settings)


def _need_root(host: Host, scope: Scope, path: Path, again: list[str]) -> None:
    if scope == "system" and not host.root:
        raise ServiceError(f"--system writes {path}, which needs root: run it with sudo: sudo {shlex.join(again)}")


def _render(host: Host, plan: ServicePlan) -> bytes:
    return render_systemd(plan).encode() if host.system == "linux" else render_plist(plan)


def _write(path: Path, content: bytes) -> None:
    """Written whole or not at all: systemd or launchd may read it at any moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(content)
    partial.chmod(0o644)
    os.replace(partial, path)


def _make_dirs(folder: Path, owner: str | None) -> None:
    """Creates what is missing of `folder`; what it creates for another account is given to it."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    if owner and missing and os.geteuid() == 0:
        import pwd

        account = pwd.getpwnam(owner)
        for path in missing:
            os.chown(path, account.pw_uid, account.pw_gid)


def _ensure_env_file(path: Path, names: tuple[str, ...], owner: str | None) -> bool:
    """Creates the env file, mode 0600, if it is absent; True when it did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            print(f"warning: {path} holds keys and others may read it (mode {mode:04o}): chmod 600 {shlex.quote(str(path))}",
                  file=sys.stderr)
        return False
    with os.fdopen(fd, "w") as file:
        os.fchmod(file.fileno(), 0o600)  # exactly 0600, whatever the umask
        file.write(env_file_text(names))
    if owner:  # launchd's shell reads it as the daemon's user; systemd reads it as root
        import pwd

        account = pwd.getpwnam(owner)
        os.chown(path, account.pw_uid, account.pw_gid)
    return True


def _unset(path: Path, names: tuple[str, ...]) -> list[str]:
    try:
        text = path.read_text()
    except OSError:
        return list(names)
    return [n for n in dict.fromkeys(names) if not re.search(rf"^\s*(export\s+)?{re.escape(n)}=\S", text, re.MULTILINE)]


def _warn_out_of_reach(plan: ServicePlan) -> None:
    """Under sudo, the config found may be root's own, which the service's user cannot read."""
    import pwd

    if plan.user in (None, "root"):
        return
    root_home = Path(pwd.getpwnam("root").pw_dir)
    for what, path in (("config", plan.config), ("data directory", plan.data_dir)):
        if path.is_relative_to(root_home):
            print(f"warning: the {what} {path} is in root's home, out of {plan.user}'s reach: pass --config", file=sys.stderr)


def cmd_install(args: argparse.Namespace) -> int:
    try:
        host = this_host()
        scope = _scope(args) or "user"
        plan, keys = plan_for(args, host, scope)
        path = host.service_file(scope)
        content = _render(host, plan)
    except (ServiceError, UnitError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(f"# {path}")
        sys.stdout.write(content.decode())
        print(f"# and, if absent, {plan.env_file} (mode 0600) for the upstream keys")
        return 0
    again = [*plan.program, "service", "install", "--system", "--config", str(plan.config),
             *(["--run-as", args.run_as] if args.run_as else [])]
    try:
        _need_root(host, scope, path, again)
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if scope == "system":
        _warn_out_of_reach(plan)
    replaced = path.exists()
    try:
        _make_dirs(plan.log_file.parent if host.system == "darwin" else plan.data_dir, plan.user)
        created = _ensure_env_file(plan.env_file, keys, plan.user if host.system == "darwin" else None)
        _write(path, content)
    except OSError as exc:
        print(f"error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"{'replaced' if replaced else 'wrote'} {path}")
    print(f"env file: {plan.env_file}" + (" (new, mode 0600)" if created else ""))
    missing = _unset(plan.env_file, keys)
    if missing:
        print(f"put {', '.join(missing)} in {plan.env_file}: models.toml's upstream models read their keys from there")
    started = _start_systemd(scope, replaced, args.no_start) if host.system == "linux" else \
        _start_launchd(host, scope, path, replaced, args.no_start)
    if started is not False and host.system == "linux" and scope == "user":  # a user manager stops at logout otherwise
        print("to keep it running when you log out: loginctl enable-linger $USER")
    return 0 if started is not False else 1


def _start_systemd(scope: Scope, replaced: bool, no_start: bool) -> bool | None:
    """True: started; None: left to the operator; False: systemctl failed."""
    line = systemctl_line(scope, "daemon-reload") + " && " + systemctl_line(scope, "enable --now appliance")
    if no_start or not systemd_usable(scope):
        print(f"to start it ({'--no-start' if no_start else 'systemd is not running here'}): {line}")
        return None
    # A server already running keeps its old unit until restarted; enable --now alone would not.
    steps = [("daemon-reload",), ("enable", UNIT_NAME), ("restart", UNIT_NAME)] if replaced else \
        [("daemon-reload",), ("enable", "--now", UNIT_NAME)]
    for step in steps:
        done = _systemctl(scope, *step)
        if done.returncode != 0:
            print(f"error: {systemctl_line(scope, *step)}: {(done.stderr or done.stdout).strip()}", file=sys.stderr)
            return False
    print(f"started; logs: {journal_line(scope)} -f")
    return True


def _start_launchd(host: Host, scope: Scope, path: Path, replaced: bool, no_start: bool) -> bool | None:
    domain = _domain(host, scope)
    if no_start or not launchd_usable(host):
        why = "--no-start" if no_start else "launchctl is not here"
        print(f"to start it ({why}): launchctl bootstrap {domain} {shlex.quote(str(path))}")
        return None
    if replaced:  # bootstrap refuses a label that is loaded already
        _run(["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"])
    done = _run(["launchctl", "bootstrap", domain, str(path)])
    if done.returncode != 0:
        print(f"error: launchctl bootstrap {domain} {path}: {(done.stderr or done.stdout).strip()}", file=sys.stderr)
        return False
    print(f"started; logs: {_plist_log(path)}")
    return True


def _plist_log(path: Path) -> str:
    import plistlib

    try:
        return str(plistlib.loads(path.read_bytes()).get("StandardErrorPath", "?"))
    except (OSError, plistlib.InvalidFileException):
        return "?"


def _exec_start(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            return line.removeprefix("ExecStart=")
    return "?"


def _status_systemd(host: Host, scope: Scope, path: Path) -> None:
    props = None
    if systemd_usable(scope):
        shown = _systemctl(scope, "show", UNIT_NAME, "-p", "LoadState,UnitFileState,ActiveState,SubState,MainPID")
        props = parse_properties(shown.stdout) if shown.returncode == 0 else None
    print(f"  runs: {_exec_start(path)}")
    if props is None:
        print("  enabled: unknown (systemd is not running here)\n  active: unknown")
    else:
        pid = props.get("MainPID", "0")
        print(f"  enabled: {props.get('UnitFileState') or 'no'}")
        print(f"  active: {props.get('ActiveState', '?')} ({props.get('SubState', '?')})" + (f", pid {pid}" if pid != "0" else ""))
    print(f"  hint: {systemd_hint(scope, props, sudo=scope == 'system' and not host.root)}")


def _status_launchd(host: Host, scope: Scope, path: Path) -> None:
    import plistlib

    try:
        plist = plistlib.loads(path.read_bytes())
        print(f"  runs: {shlex.join(plist['ProgramArguments'][4:])}")
    except (plistlib.InvalidFileException, KeyError, ValueError):
        print("  runs: ? (the property list does not parse)")
    target = f"{_domain(host, scope)}/{LAUNCHD_LABEL}"
    shown = _run(["launchctl", "print", target]) if launchd_usable(host) else None
    if shown is None or shown.returncode != 0:
        print("  loaded: no\n  active: no")
        print(f"  hint: launchctl bootstrap {_domain(host, scope)} {shlex.quote(str(path))}")
        return
    found = parse_launchctl_print(shown.stdout)
    print("  loaded: yes")
    print(f"  active: {found.get('state', '?')}" + (f", pid {found['pid']}" if "pid" in found else "")
          + (f", last exit code {found['last exit code']}" if "last exit code" in found else ""))
    print(f"  hint: logs: tail -f {shlex.quote(_plist_log(path))}")


def cmd_status(args: argparse.Namespace) -> int:
    try:
        host = this_host()
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    scope = _scope(args, default=None)
    scopes: tuple[Scope, ...] = (scope,) if scope else ("user", "system")
    installed = [s for s in scopes if host.service_file(s).exists()]
    for s in installed:
        path = host.service_file(s)
        print(f"{s} service: {path}\n  installed: yes")
        (_status_systemd if host.system == "linux" else _status_launchd)(host, s, path)
    if not installed:
        where = " or ".join(str(host.service_file(s)) for s in scopes)
        print(f"not installed (nothing at {where})\n  hint: appliance service install --{scopes[0]}")
        return 1
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    try:
        host = this_host()
        scope = _scope(args) or "user"
        path = host.service_file(scope)
        if not path.exists():
            print(f"no service at {path}: nothing to remove")
            return 0
        _need_root(host, scope, path, [*appliance_program(), "service", "uninstall", "--system"])
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if host.system == "linux":
        if systemd_usable(scope):
            stopped = _systemctl(scope, "disable", "--now", UNIT_NAME)
            if stopped.returncode != 0:
                print(f"warning: {systemctl_line(scope, 'disable --now appliance')}: {(stopped.stderr or stopped.stdout).strip()}",
                      file=sys.stderr)
            path.unlink()
            _systemctl(scope, "daemon-reload")
            _systemctl(scope, "reset-failed", UNIT_NAME)  # else a failed unit lingers in `systemctl --failed`
        else:
            # What `disable` would have removed: an enabled unit's link, left dangling otherwise.
            target = "default.target" if scope == "user" else "multi-user.target"
            (path.parent / f"{target}.wants" / UNIT_NAME).unlink(missing_ok=True)
            path.unlink()
            print("systemd is not running here: nothing to stop")
    else:
        if launchd_usable(host):
            _run(["launchctl", "bootout", f"{_domain(host, scope)}/{LAUNCHD_LABEL}"])
        path.unlink()
    env = env_file_path(scope, host.config_home)
    print(f"removed {path}" + (f"; kept {env}, which holds the upstream keys" if env.exists() else ""))
    return 0


def _scope_options(parser: argparse.ArgumentParser, default: str) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--user", action="store_true", help=f"a service of your own login (systemd --user, a LaunchAgent){default}")
    group.add_argument("--system", action="store_true", help="a service of the machine, run at boot (needs sudo)")


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    service = sub.add_parser("service", help="run the server at login or boot, under systemd (Linux) or launchd (macOS)")
    commands = service.add_subparsers(dest="service_command", required=True)
    install = commands.add_parser("install", help="write the unit (or property list) for `appliance serve`, then enable and start it")
    _scope_options(install, "; the default")
    install.add_argument("--config", type=Path, help="the config to serve (default: as `serve` finds it, made absolute)")
    install.add_argument("--run-as", metavar="NAME", help="--system: the user the server runs as (default: the one who ran sudo)")
    install.add_argument("--dry-run", "--print", dest="dry_run", action="store_true",
                         help="print the unit and where it goes; write nothing")
    install.add_argument("--no-start", action="store_true", help="write the files only; print the command that starts it")
    install.set_defaults(func=cmd_install)
    status = commands.add_parser("status", help="where the service is, whether it is enabled and running (exit 1: not installed)")
    _scope_options(status, "; default: both")
    status.set_defaults(func=cmd_status)
    uninstall = commands.add_parser("uninstall", help="stop, disable and remove the service (the env file is kept)")
    _scope_options(uninstall, "; the default")
    uninstall.set_defaults(func=cmd_uninstall)
