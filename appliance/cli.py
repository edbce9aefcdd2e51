"""The `appliance` command: serve, config check, models list/pull, doctor."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from pathlib import Path

from appliance.settings import ConfigError, Settings, find_config, load_settings


def _settings(config: Path | None) -> Settings:
    return load_settings(find_config(config))


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from appliance.server import serve

    settings = _settings(args.config)
    server = settings.server
    if args.host is not None:
        server = dataclasses.replace(server, host=args.host)
    if args.port is not None:
        server = dataclasses.replace(server, port=args.port)
    return serve(dataclasses.replace(settings, server=server))


def cmd_config_check(args: argparse.Namespace) -> int:
    from appliance.model_files import ModelFileError, resolve

    settings = _settings(args.path)
    problems = 0
    for model in settings.models:
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

    from appliance.model_files import ModelFileError, resolve

    settings = _settings(args.config)
    header = ("alias", "engine", "kind", "tier", "slots", "context", "price_in_per_mtok", "price_out_per_mtok", "file")
    rows = []
    for m in settings.models:
        try:
            where = str(resolve(m, settings.server.data_dir))
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
    from appliance.model_files import ModelFileError, download, resolve, sha256

    settings = _settings(args.config)
    chosen = [m for m in settings.models if not args.alias or m.alias in args.alias]
    unknown = set(args.alias or ()) - {m.alias for m in settings.models}
    if unknown:
        print(f"{settings.file}: models: no model with alias {', '.join(sorted(unknown))}", file=sys.stderr)
        return 1
    for m in chosen:
        try:
            if m.hf_repo and m.hf_file:
                path = download(m.hf_repo, m.hf_file, settings.server.data_dir)
            else:
                path = resolve(m, settings.server.data_dir)
        except ModelFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if m.sha256 and sha256(path) != m.sha256:
            print(f"error: {m.alias}: sha256 of {path} does not match models.toml", file=sys.stderr)
            return 1
        print(f"{m.alias}: {path}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from appliance.doctor import run_doctor

    return run_doctor(args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A self-hosted LLM server with an OpenAI-compatible API.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
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

    models = sub.add_parser("models", help="the model fleet").add_subparsers(dest="models_command", required=True)
    listing = models.add_parser("list", help="list configured models and where their files are")
    listing.add_argument("--config", type=Path)
    listing.set_defaults(func=cmd_models_list)
    pull = models.add_parser("pull", help="download hub models named in the config")
    pull.add_argument("alias", nargs="*")
    pull.add_argument("--config", type=Path)
    pull.set_defaults(func=cmd_models_pull)

    doctor = sub.add_parser("doctor", help="check this machine, the engines and the models")
    doctor.add_argument("--config", type=Path)
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's stack: the first thing to ask of a stuck server.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
