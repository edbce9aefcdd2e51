"""The `appliance` command: serve, config check, models list/pull, doctor."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
from contextlib import closing
from pathlib import Path

from appliance import __version__
from appliance.cli import data as cli_data
from appliance.cli import distill as cli_distill
from appliance.cli import evals as cli_eval
from appliance.cli import fleet as cli_fleet
from appliance.cli import service as cli_service
from appliance.cli.fleet import add_server_options, resolve_key, server_url, tell_server, write_and_apply
from appliance.cli.support import config_in_use, data_dir, ledger_db, ledger_of, moment, print_rows, settings_of, when
from appliance.config.settings import ConfigError, config_to_serve, find_config, load_settings
from appliance.server.log_format import TEXT_FORMAT


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    import msgspec

    from appliance.server.run import serve

    settings = load_settings(config_to_serve(args.config))
    server = settings.server
    if args.host is not None:
        server = msgspec.structs.replace(server, host=args.host)
    if args.port is not None:
        server = msgspec.structs.replace(server, port=args.port)
    return serve(dataclasses.replace(settings, server=server), read_at_start=settings)


def cmd_config_docs(args: argparse.Namespace) -> int:
    from appliance.config.doc import render

    print(render(), end="")
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    from appliance.fleet.files import ModelFileError, resolve
    from appliance.prompt.template import ChatTemplate, TemplateError

    settings = settings_of(args.path)
    problems = 0
    for model in settings.models:
        if getattr(model, "chat_template", None):
            try:  # compiled and tried within its bounds as `serve` will (the model's special tokens aside)
                ChatTemplate(model.chat_template, {})
            except TemplateError as exc:
                print(f"{settings.file}: model {model.alias!r}: chat_template: {exc}", file=sys.stderr)
                problems += 1
        if model.engine == "openai":
            missing = [u.api_key_env for u in model.upstreams if u.api_key_env and not os.environ.get(u.api_key_env)]
            if missing:  # `serve` would refuse to start; the check says so now
                print(f"{settings.file}: model {model.alias!r}: api_key_env: the environment variable {missing[0]} is not set", file=sys.stderr)
                problems += 1
            continue
        try:
            resolve(model, settings.server.data_dir)
        except ModelFileError as exc:
            # Not fatal for a config check: `serve` downloads hub models at start.
            print(f"{settings.file}: models: {exc}", file=sys.stderr)
            problems += model.hf_repo is None
    if problems:
        return 1
    print(f"{settings.file}: ok ({len(settings.models)} model{'s' if len(settings.models) != 1 else ''})")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from appliance.fleet.files import ModelFileError, resolve

    settings = settings_of(args.config)
    header = ("alias", "engine", "kind", "tier", "slots", "context", "price_in_per_mtok", "price_out_per_mtok", "file")
    rows = []
    for m in settings.models:
        try:
            where = " ".join(u.base_url for u in m.upstreams) if m.engine == "openai" else str(resolve(m, settings.server.data_dir))
        except ModelFileError as exc:
            where = f"missing: {exc}"
        rows.append((m.alias, m.engine, m.kind, m.tier, str(m.slots), str(m.context_length),
                     f"{m.price_input_per_mtok:g}", f"{m.price_output_per_mtok:g}", where))
    if not sys.stdout.isatty():  # scripts get tab-separated lines, never a wrapped table
        for row in (header, *rows):
            print("\t".join(row))
        return 0
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from appliance.fleet.files import ModelFileError, download, resolve, sha256

    if len(args.alias) == 2 and "/" in args.alias[0] and args.alias[1].endswith(".gguf"):
        return _pull_hub_file(args, *args.alias)
    settings = settings_of(args.config)
    chosen = [m for m in settings.models if not args.alias or m.alias in args.alias]
    unknown = set(args.alias or ()) - {m.alias for m in settings.models}
    if unknown:
        print(f"{settings.file}: models: no model with alias {', '.join(sorted(unknown))}", file=sys.stderr)
        return 1
    for m in chosen:
        if m.engine == "openai":
            print(f"{m.alias}: runs upstream, nothing to download")
            continue
        try:
            if m.hf_repo and m.hf_file:
                path, digest = download(m.hf_repo, m.hf_file, settings.server.data_dir)
            else:
                path = resolve(m, settings.server.data_dir)
                digest = sha256(path) if m.sha256 else ""
        except ModelFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if m.sha256 and digest != m.sha256:
            print(f"error: {m.alias}: sha256 of {path} does not match models.toml", file=sys.stderr)
            return 1
        print(f"{m.alias}: {path}")
    return 0


def _pull_hub_file(args: argparse.Namespace, repo: str, filename: str) -> int:
    """`models pull REPO FILE`: download through huggingface-hub, then register the file."""
    from appliance.fleet.admin import ModelAdminError, alias_for, check_alias, register
    from appliance.fleet.files import ModelFileError, download

    config = find_config(args.config)

    def write() -> str:
        alias = check_alias(args.register_alias or alias_for(Path(filename)))
        path, digest = download(repo, filename, load_settings(config).server.data_dir)
        register(config, alias, path, digest)
        return f"{path}\nsha256 {digest}\nregistered as {alias!r} in {config}"

    return write_and_apply(args, config, write, (ModelFileError, ModelAdminError))


def cmd_models_add(args: argparse.Namespace) -> int:
    from appliance.fleet.admin import ModelAdminError, alias_for, check_alias, file_type, register
    from appliance.fleet.files import sha256

    config = find_config(args.config)
    path = args.path.expanduser().resolve()

    def write() -> str:
        alias = check_alias(args.alias or alias_for(path))
        if not path.is_file():
            raise ModelAdminError(f"{path}: no such file")
        kind, digest = file_type(path), sha256(path)
        register(config, alias, path, digest)
        return f"{path} ({kind})\nsha256 {digest}\nregistered as {alias!r} in {config}"

    return write_and_apply(args, config, write, (ModelAdminError,))


def cmd_models_quantize(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from appliance.fleet.admin import ModelAdminError, alias_for, check_alias, quantize, quantized_name, register
    from appliance.fleet.files import ModelFileError, resolve, sha256

    config = find_config(args.config)
    like = None
    try:
        if args.alias is not None:  # refused now, not after the quantizing
            check_alias(args.alias)
        settings = load_settings(config) if config.is_file() else None
        source = settings.model(str(args.source)) if settings else None
        if source is not None and source.engine == "openai":
            print(f"error: {config}: model {source.alias!r} runs upstream; there is no file here to quantize", file=sys.stderr)
            return 1
        if source is not None:  # a configured alias: quantize its file, and copy its settings
            src, like = resolve(source, settings.server.data_dir), source.alias  # type: ignore[union-attr]
        else:
            src = args.source.expanduser().resolve()
        if args.engine == "mlx":
            return _quantize_mlx(args, config, src, like)
        if args.type is None:
            print("error: --type is required (one of the llama.cpp types; see --help)", file=sys.stderr)
            return 2
        dst = (args.out or quantized_name(src, args.type)).expanduser().resolve()
        # The output is close to source size x new bits / old bits; the bar only needs a scale.
        with Progress(TextColumn(f"quantizing to {args.type}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task("quantize", total=None)
            quantize(src, dst, args.type, threads=args.threads, allow_requantize=args.allow_requantize,
                     progress=lambda size: bar.update(task, completed=size))
        digest = sha256(dst)
        print(f"{dst}\nsha256 {digest}\nsize {dst.stat().st_size / 1e6:.1f} MB (source {src.stat().st_size / 1e6:.1f} MB)")
        if not args.no_register:
            alias = args.alias or (f"{like}-{args.type.lower()}" if like else alias_for(dst))
            before = config.read_text()
            register(config, alias, dst, digest, like=like)
            print(f"registered as {alias!r} in {config}")
            return tell_server(args, config, before)
    except (ModelAdminError, ModelFileError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _quantize_mlx(args: argparse.Namespace, config: Path, src: Path, like: str | None) -> int:
    """mlx-lm's quantization into an MLX folder, registered with engine = "mlx"."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from appliance.fleet.admin import ModelAdminError, alias_for, register
    from engines.mlx.convert import ConversionError

    try:
        from engines.mlx.quantize import quantize_mlx
    except ImportError as exc:
        print(f"error: the MLX engine is not installed here ({exc.name}); installer/install.sh installs mlx and mlx-lm", file=sys.stderr)
        return 1
    stem = src.stem if src.is_file() else src.name
    dst = (args.out or src.with_name(f"{stem}-mlx-{args.bits}bit-g{args.group_size}")).expanduser().resolve()
    try:
        with Progress(SpinnerColumn(), TextColumn(f"quantizing for MLX to {args.bits} bits, group {args.group_size}"),
                      TimeElapsedColumn(), transient=True) as bar:
            bar.add_task("quantize", total=None)
            done = quantize_mlx(src, dst, args.bits, args.group_size)
        print(f"{done.folder}\nweights {done.bytes / 1e6:.1f} MB, {done.bits}-bit, group {done.group_size}")
        if not args.no_register:
            alias = args.alias or (f"{like}-mlx-{args.bits}bit" if like else alias_for(dst))
            before = config.read_text()
            register(config, alias, dst, None, like=like, engine="mlx")
            print(f"registered as {alias!r} in {config}")
            return tell_server(args, config, before)
    except (ConversionError, ModelAdminError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_models_convert(args: argparse.Namespace) -> int:
    from engines.mlx.convert import ConversionError, gguf_to_mlx

    src = args.source.expanduser().resolve()
    out = (args.out or src.with_name(src.stem + "-mlx")).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty; give another --out", file=sys.stderr)
        return 1
    try:
        report = gguf_to_mlx(src, out)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"error: the MLX engine is not installed here ({exc.name}); installer/install.sh installs mlx and mlx-lm", file=sys.stderr)
        return 1
    packed = ", ".join(f"{n} tensors {kind}" for kind, n in sorted(report.packed.items())) or "none"
    print(f"{out}\npacked: {packed}\nfloat16 (MLX cannot keep their type packed): {len(report.float16)}\nunquantized: {report.unquantized}")
    return 0


def parse_expiry(text: str, now: float) -> float:
    """'30d', '12h', '45m', '90s' from now, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    return moment(text, now, 1, "--expires")


def cmd_keys_create(args: argparse.Namespace) -> int:
    from appliance.store.db import database_path
    from appliance.store.keys import KeyStore

    now = time.time()
    try:
        expires = parse_expiry(args.expires, now) if args.expires else None
        settings = config_in_use(args.config)
        with closing(ledger_of(settings)) as db:
            record, secret = KeyStore(db).create(
                user=args.user, tenant=args.tenant, app=args.app, role=args.role, admin=args.admin, now=now, expires_at=expires)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created {'admin ' if record.admin else ''}key {record.id} for user {record.user}, tenant {record.tenant}, "
          f"app {record.app}, role {record.role}" + (f", expires {args.expires}" if expires else ""))
    # A key written to another data directory than the server's is a key that server never sees.
    print(f"stored in {database_path(data_dir(settings))}" + (f" (the data directory of {settings.file})" if settings else
                                                               " (no config file found: the default data directory)"))
    if settings is not None and settings.auth.mode == "open":
        print(f"warning: {settings.file} has [auth] mode = \"open\": a server started with it checks no keys, so this key "
              "is not asked for until mode = \"keys\"", file=sys.stderr)
    print("the secret is shown once; store it now:")
    print(secret)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from appliance.store.keys import KeyStore, LastAdminKey

    last = False
    with closing(ledger_db(args.config)) as db:
        store, now = KeyStore(db), time.time()
        try:
            revoked = store.revoke(args.id, now)
        except LastAdminKey:  # the admin API refuses this one; on the machine it is the operator's call
            last, revoked = True, store.revoke(args.id, now, keep_an_admin=False)
    if not revoked:
        print(f"error: there is no active key {args.id}", file=sys.stderr)
        return 1
    print(f"revoked {args.id} (a running server stops accepting it within its key cache time)")
    if last:
        print(f"warning: {args.id} was the last active admin key: /admin/* and the TUI refuse every key until "
              "`appliance keys create --admin` makes another", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from appliance.store.keys import KeyStore

    with closing(ledger_db(args.config)) as db:
        records = KeyStore(db).all()
    print_rows(("id", "user", "tenant", "app", "role", "admin", "expires_at", "revoked_at"), [
        (r.id, r.user, r.tenant, r.app, r.role, "yes" if r.admin else "no", when(r.expires_at), when(r.revoked_at)) for r in records
    ])
    return 0


def cmd_budgets_set(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger, LedgerError
    from policy.budgets import nanos_from_usd

    if args.level != "global" and not args.name:
        print(f"error: a {args.level} budget needs the {args.level}'s name", file=sys.stderr)
        return 2
    if args.usd < 0:
        print("error: --usd must be zero or more", file=sys.stderr)
        return 2
    with closing(ledger_db(args.config)) as db:
        try:
            Ledger(db).set_limit(args.level, args.name or "*", nanos_from_usd(args.usd), args.period, time.time())
        except LedgerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"{args.level} {args.name or '*'}: ${args.usd:g} per {args.period}")
    return 0


def cmd_budgets_unset(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger

    with closing(ledger_db(args.config)) as db:
        removed = Ledger(db).remove_limit(args.level, args.name or "*")
    if not removed:
        print(f"error: there is no budget for {args.level} {args.name or '*'}", file=sys.stderr)
        return 1
    print(f"removed the budget of {args.level} {args.name or '*'} (spend is still recorded)")
    return 0


def cmd_budgets_reset(args: argparse.Namespace) -> int:
    from appliance.store.ledger import Ledger
    from policy.budgets import usd

    with closing(ledger_db(args.config)) as db:
        written_off = Ledger(db).reset_spend(args.level, args.name or "*", args.period, time.time())
    print(f"{args.level} {args.name or '*'}: wrote off ${usd(written_off):.6f} of this {args.period}'s spend")
    return 0


def cmd_budgets_show(args: argparse.Namespace) -> int:
    import json

    from appliance.store.ledger import Ledger
    from policy.budgets import usd

    now = time.time()
    with closing(ledger_db(args.config)) as db:
        ledger = Ledger(db)
        budgets, reservations = ledger.budgets(now), ledger.reservations()
        top = {level: ledger.top_spenders(level, "day", now) for level in ("user", "tenant", "app")}
        problems = ledger.imbalances()
    if args.json:
        print(json.dumps({
            "budgets": [{"level": b.level, "name": b.name, "period": b.period, "window": b.window, "limit_usd": usd(b.limit_nanos),
                         "spent_usd": usd(b.spent_nanos), "held_usd": usd(b.held_nanos),
                         "remaining_usd": usd(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos))} for b in budgets],
            "reservations": reservations,
            "top_spenders_today": {level: [{"name": n, "spent_usd": usd(s)} for n, s in rows] for level, rows in top.items()},
            "balanced": not problems,
        }, indent=2))
        return 0
    print_rows(("level", "name", "period", "limit_usd", "spent_usd", "held_usd", "remaining_usd"), [
        (b.level, b.name, b.period, f"{usd(b.limit_nanos):.6f}", f"{usd(b.spent_nanos):.6f}", f"{usd(b.held_nanos):.6f}",
         f"{usd(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos)):.6f}") for b in budgets
    ])
    print(f"reservations in flight: {len(reservations)}; ledger {'balanced' if not problems else 'NOT balanced: ' + '; '.join(problems)}")
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    from tui.app import run

    run(server_url(args), args.key)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    """The models of a running server, loaded or not, from GET /admin/models/loaded."""
    import json

    import httpx

    url = server_url(args).rstrip("/")
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    try:
        response = httpx.get(f"{url}/admin/models/loaded", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the server at {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:200]
        print(f"error: {url} answered {response.status_code}: {message}", file=sys.stderr)
        return 1
    data = response.json()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0

    def mib(n: int | None) -> str:
        return "-" if not n else f"{n / 2**20:.0f} MiB"

    def seconds(s: float | None) -> str:
        return "-" if s is None else f"{s:.0f}s"

    def until(m: dict) -> str:  # type: ignore[type-arg]
        if not m["loaded"]:
            return "loading" if m["loading"] else "-"
        if m["preload"] or m["keep_alive_s"] is None:
            return "never"
        return seconds(m["unloads_in_s"]) if m["unloads_in_s"] is not None else "when idle"

    print_rows(("model", "loaded", "memory", "slots_busy", "queued", "idle", "unloads_in"), [
        (m["alias"], "yes" if m["loaded"] else "no", mib(m["memory_bytes"]), f"{m['slots_busy']}/{m['slots_total']}",
         str(m["queue_depth"] + m["waiting_for_load"]), seconds(m["idle_s"]), until(m)) for m in data["models"]
    ])
    budget = data["memory_budget_bytes"]
    print(f"memory in use: {mib(data['loaded_bytes'])}" + (f" of a {mib(budget)} budget" if budget else " (no budget)"))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from appliance.cli.doctor import run_doctor

    return run_doctor(args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A self-hosted LLM server with an OpenAI-compatible API.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the models in the config over HTTP")
    serve.add_argument("--config", type=Path, help="config file (default: ./models.toml, then the data directory's)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="config file tools").add_subparsers(dest="config_command", required=True)
    check = config.add_parser("check", help="validate a config file")
    check.add_argument("path", nargs="?", type=Path)
    check.set_defaults(func=cmd_config_check)
    config.add_parser("docs", help="print the reference of every key (docs/config.md)").set_defaults(func=cmd_config_docs)

    models = sub.add_parser("models", help="the model fleet").add_subparsers(dest="models_command", required=True)
    listing = models.add_parser("list", help="list configured models and where their files are")
    listing.add_argument("--config", type=Path)
    listing.set_defaults(func=cmd_models_list)
    pull = models.add_parser("pull", help="download hub models named in the config, or REPO FILE.gguf (then registered)")
    pull.add_argument("alias", nargs="*", help="aliases from the config, or a hub repo and a .gguf file in it")
    pull.add_argument("--alias", dest="register_alias", help="the alias to register REPO FILE under")
    pull.add_argument("--config", type=Path)
    add_server_options(pull)
    pull.set_defaults(func=cmd_models_pull)
    add = models.add_parser("add", help="register a local GGUF file in the config")
    add.add_argument("path", type=Path)
    add.add_argument("--alias")
    add.add_argument("--config", type=Path)
    add_server_options(add)
    add.set_defaults(func=cmd_models_add)
    quant = models.add_parser("quantize", help="quantize a model (a path or a configured alias) with llama.cpp or mlx-lm and register it")
    quant.add_argument("source", type=Path)
    from appliance.fleet.admin import QUANT_TYPES

    quant.add_argument("--engine", choices=["llamacpp", "mlx"], default="llamacpp",
                       help="llamacpp: a GGUF of --type; mlx: an MLX folder of --bits and --group-size (from a GGUF or an MLX folder)")
    quant.add_argument("--type", choices=sorted(QUANT_TYPES), metavar="TYPE", help=f"llama.cpp: one of {', '.join(QUANT_TYPES)}")
    quant.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8], help="mlx: bits per weight (default 4)")
    quant.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="mlx: weights per scale (default 64)")
    quant.add_argument("--out", type=Path, help="the output file (default: beside the source, named by the type)")
    quant.add_argument("--alias", help="the alias to register it under")
    quant.add_argument("--allow-requantize", action="store_true", help="quantize a file that is already quantized")
    quant.add_argument("--no-register", action="store_true", help="write the file only")
    quant.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    quant.add_argument("--config", type=Path)
    add_server_options(quant)
    quant.set_defaults(func=cmd_models_quantize)
    cli_fleet.add_commands(models, config)
    convert = models.add_parser("convert", help="write an MLX model folder from a llama-architecture GGUF (no second download)")
    convert.add_argument("source", type=Path)
    convert.add_argument("--to", choices=["mlx"], required=True)
    convert.add_argument("--out", type=Path, help="the folder to write (default: beside the source, <name>-mlx)")
    convert.set_defaults(func=cmd_models_convert)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key; the secret is printed once, alone on the last line")
    for flag in ("--tenant", "--app", "--user", "--role"):
        create.add_argument(flag, required=True)
    create.add_argument("--admin", action="store_true", help="may call the admin API")
    create.add_argument("--expires", help="a duration (30d, 12h, 45m, 90s) or an ISO 8601 date")
    create.add_argument("--config", type=Path)
    create.set_defaults(func=cmd_keys_create)
    revoke = keys.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("id")
    revoke.add_argument("--config", type=Path)
    revoke.set_defaults(func=cmd_keys_revoke)
    klist = keys.add_parser("list", help="list keys (never their secrets)")
    klist.add_argument("--config", type=Path)
    klist.set_defaults(func=cmd_keys_list)

    from policy.budgets import LEVELS, PERIODS

    budgets = sub.add_parser("budgets", help="dollar budgets per user, tenant, app or globally").add_subparsers(dest="budgets_command", required=True)
    bset = budgets.add_parser("set", help="set a level's budget")
    bset.add_argument("level", choices=LEVELS)
    bset.add_argument("name", nargs="?", help="the user, tenant or app (not for global)")
    bset.add_argument("--usd", type=float, required=True)
    bset.add_argument("--period", choices=PERIODS, required=True)
    bset.add_argument("--config", type=Path)
    bset.set_defaults(func=cmd_budgets_set)
    bunset = budgets.add_parser("unset", help="remove a level's budget (its spend stays recorded)")
    bunset.add_argument("level", choices=LEVELS)
    bunset.add_argument("name", nargs="?")
    bunset.add_argument("--config", type=Path)
    bunset.set_defaults(func=cmd_budgets_unset)
    breset = budgets.add_parser("reset", help="write off a level's spend in the current window")
    breset.add_argument("level", choices=LEVELS)
    breset.add_argument("name", nargs="?")
    breset.add_argument("--period", choices=PERIODS, required=True)
    breset.add_argument("--config", type=Path)
    breset.set_defaults(func=cmd_budgets_reset)
    bshow = budgets.add_parser("show", help="budgets, spend, reservations in flight, top spenders")
    bshow.add_argument("--json", action="store_true")
    bshow.add_argument("--config", type=Path)
    bshow.set_defaults(func=cmd_budgets_show)

    cli_eval.add_commands(sub)
    cli_data.add_commands(sub)

    distill = sub.add_parser("distill", help="teach a cheap model from verified answers").add_subparsers(dest="distill_command", required=True)
    cli_distill.add_export_command(distill)
    cli_distill.add_train_command(distill)
    cli_distill.add_evaluate_command(distill)

    tui = sub.add_parser("tui", help="the operator's terminal UI, over the admin API")
    add_server_options(tui, url="the appliance")
    tui.add_argument("--config", type=Path)
    tui.set_defaults(func=cmd_tui)

    ps = sub.add_parser("ps", help="a running server's models: loaded or not, memory, slots in use, time to unload")
    add_server_options(ps, url="the appliance")
    ps.add_argument("--json", action="store_true")
    ps.add_argument("--config", type=Path)
    ps.set_defaults(func=cmd_ps)

    doctor = sub.add_parser("doctor", help="check this machine, the engines and the models")
    doctor.add_argument("--config", type=Path)
    doctor.set_defaults(func=cmd_doctor)

    cli_service.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's stack: the first thing to ask of a stuck server.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=TEXT_FORMAT)
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to the server is noise on a command line
    try:
        if hasattr(args, "key"):
            args.key = resolve_key(args)
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
