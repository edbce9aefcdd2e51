"""The CLI's changes to the fleet while a server runs: the CLI writes models.toml through
appliance.config.writer, then asks the running server to apply it (POST /admin/config/reload). When
the server cannot take the change, the file is put back as it was, so file and server agree."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.cli.remote import auth_headers, refusal, server_error
from appliance.cli.support import settings_of
from appliance.config.settings import ConfigError, find_config


def server_url(args: argparse.Namespace) -> str:
    """--url, else APPLIANCE_URL, else the config's host and port (what `serve` listens on)."""
    if getattr(args, "url", None):
        return str(args.url)
    if os.environ.get("APPLIANCE_URL"):
        return os.environ["APPLIANCE_URL"]
    try:
        server = settings_of(args.config).server
        return f"http://{server.host}:{server.port}"
    except ConfigError:
        return "http://127.0.0.1:8080"


def add_server_options(parser: argparse.ArgumentParser, url: str = "the running appliance to apply the change to",
                       key: str = "an admin key (not needed when the open principal is admin)") -> None:
    """--url and the key options every command that talks to a running server takes. A key on the
    command line shows in `ps` to every local user: APPLIANCE_KEY or a key file keep it out."""
    parser.add_argument("--url", help=f"{url} (default: $APPLIANCE_URL, else the config's host and port)")
    parser.add_argument("--key", help=f"{key}; default: $APPLIANCE_KEY, else the key file")
    parser.add_argument("--key-file", type=Path, help="a file holding the key (default: $APPLIANCE_KEY_FILE)")


def resolve_key(args: argparse.Namespace) -> str | None:
    """--key, else APPLIANCE_KEY, else the first line of --key-file or APPLIANCE_KEY_FILE; a key
    file that cannot be read is a ConfigError naming it."""
    if getattr(args, "key", None):
        return str(args.key)
    if os.environ.get("APPLIANCE_KEY"):
        return os.environ["APPLIANCE_KEY"]
    file = getattr(args, "key_file", None) or (Path(os.environ["APPLIANCE_KEY_FILE"]) if os.environ.get("APPLIANCE_KEY_FILE") else None)
    if file is None:
        return None
    try:
        key = Path(file).read_text().strip().splitlines()
    except OSError as exc:
        raise ConfigError(str(file), "key file", f"cannot be read ({exc.strerror})") from None
    if not key or not key[0].strip():
        raise ConfigError(str(file), "key file", "it is empty")
    return key[0].strip()


def tell_server(args: argparse.Namespace, config: Path, before: str) -> int:
    """Asks the running server to serve the file as it is now; puts the file back when the server
    refuses it. No server answering is fine: the change is served at the next start."""
    import httpx

    from appliance.config.writer import restore

    url = server_url(args).rstrip("/")
    key = getattr(args, "key", None)
    written = config.read_text()
    try:
        response = httpx.post(f"{url}/admin/config/reload", headers=auth_headers(key), timeout=httpx.Timeout(10, read=600))
    except httpx.HTTPError:
        print(f"no server answers at {url}: the change is served when the server starts")
        return 0
    if response.status_code == 200:
        change = response.json()["change"]
        done = [f"{what.replace('_', ' ')} {', '.join(change[what])}" for what in ("added", "removed", "changed", "adapters_changed")
                if change.get(what)]
        print(f"the server at {url} applied it" + (f" ({'; '.join(done)})" if done else ""))
        if change["restart_needed_for"]:
            print(f"a restart applies the changes to [{'], ['.join(change['restart_needed_for'])}]")
        return 0
    said = refusal(url, response, key) or f"the server at {url} did not apply the change ({response.status_code}): {server_error(response)[1]}"
    # 404: an older server, or another file; before == written: `config reload`, nothing of ours to put back
    put_back = response.status_code != 404 and before != written and restore(config, before, written)
    print(f"error: {said}", file=sys.stderr)
    if put_back:
        print(f"{config} is back as it was", file=sys.stderr)
    return 1


def write_and_apply(args: argparse.Namespace, config: Path, write: Callable[[], str],
                    errors: tuple[type[Exception], ...] = ()) -> int:
    """Runs `write` (a change through appliance.config.writer; it returns what to print), then asks
    the running server to apply the file, putting the file back if the server refuses it."""
    try:
        before = config.read_text()
        message = write()
    except (ConfigError, OSError, *errors) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(message)
    return tell_server(args, config, before)


def _value(text: str) -> Any:
    """KEY=VALUE's value as TOML (4, 1.5, true, "10m", ["a"]), else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def cmd_models_remove(args: argparse.Namespace) -> int:
    from appliance.config.writer import remove_table

    config = find_config(args.config)

    def write() -> str:
        remove_table(config, "models", args.alias)
        return f"removed {args.alias!r} from {config} (its file stays on disk)"

    return write_and_apply(args, config, write)


def cmd_models_set(args: argparse.Namespace) -> int:
    from appliance.config.writer import update_table

    config = find_config(args.config)
    values: dict[str, Any] = {}
    for pair in args.values:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            print(f"error: {pair!r}: give KEY=VALUE (KEY= removes the key)", file=sys.stderr)
            return 2
        values[key.strip()] = _value(text) if text else None

    def write() -> str:
        update_table(config, "models", args.alias, values)
        return f"set {', '.join(values)} of {args.alias!r} in {config}"

    return write_and_apply(args, config, write)


def cmd_config_reload(args: argparse.Namespace) -> int:
    config = find_config(args.config)
    return tell_server(args, config, config.read_text())


def add_commands(models: Any, config: Any) -> None:
    remove = models.add_parser("remove", help="remove a model from the config (a running server stops serving it once its requests finish)")
    remove.add_argument("alias")
    remove.add_argument("--config", type=Path)
    add_server_options(remove)
    remove.set_defaults(func=cmd_models_remove)
    edit = models.add_parser("set", help="set keys of a model in the config (KEY=VALUE; KEY= removes one); a running server serves it again")
    edit.add_argument("alias")
    edit.add_argument("values", nargs="+", metavar="KEY=VALUE")
    edit.add_argument("--config", type=Path)
    add_server_options(edit)
    edit.set_defaults(func=cmd_models_set)
    reload = config.add_parser("reload", help="have the running server apply the config file (after editing it by hand)")
    reload.add_argument("--config", type=Path)
    add_server_options(reload)
    reload.set_defaults(func=cmd_config_reload)
