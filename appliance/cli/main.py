"""The `appliance` command: serve, config check, models list/pull, doctor."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from appliance import __version__
from appliance.cli import accounts as cli_accounts
from appliance.cli import data as cli_data
from appliance.cli import distill as cli_distill
from appliance.cli import evals as cli_eval
from appliance.cli import fleet as cli_fleet
from appliance.cli import service as cli_service
from appliance.cli.exits import INTERRUPTED, USAGE, CommandError, epilog
from appliance.cli.fleet import add_server_options, resolve_key, server_url, tell_server, write_and_apply
from appliance.cli.parsing import finish
from appliance.cli.remote import call
from appliance.cli.support import print_rows, settings_of
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
    import json

    from appliance.fleet.files import ModelFileError, resolve
    from policy.budgets import dollars, nanos_from_usd

    settings = settings_of(args.config)
    listed = []
    for m in settings.models:
        try:
            where = " ".join(u.base_url for u in m.upstreams) if m.engine == "openai" else str(resolve(m, settings.server.data_dir))
            missing = None
        except ModelFileError as exc:
            where, missing = "", str(exc)
        listed.append({"alias": m.alias, "engine": m.engine, "kind": m.kind, "tier": m.tier, "slots": m.slots,
                       "context_length": m.context_length, "price_input_per_mtok": m.price_input_per_mtok,
                       "price_output_per_mtok": m.price_output_per_mtok, "file": where, "missing": missing})
    if args.json:
        print(json.dumps({"config": str(settings.file), "models": listed}, indent=2))
        return 0
    print_rows(("alias", "engine", "kind", "tier", "slots", "context", "in_per_mtok", "out_per_mtok", "file"), [
        (m["alias"], m["engine"], m["kind"], m["tier"], str(m["slots"]), str(m["context_length"]),
         dollars(nanos_from_usd(m["price_input_per_mtok"])), dollars(nanos_from_usd(m["price_output_per_mtok"])),
         m["file"] or f"missing: {m['missing']}") for m in listed
    ])
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


def cmd_tui(args: argparse.Namespace) -> int:
    from tui.app import run

    run(server_url(args), args.key)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    """The models of a running server, loaded or not, from GET /admin/models/loaded."""
    import json

    data = call(server_url(args), args.key, "GET", "/admin/models/loaded").json()
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

    return run_doctor(args.config, as_json=args.json)


def cmd_completion(args: argparse.Namespace) -> int:
    """A completion script for the shell, made from this very parser (so it knows every subcommand and option)."""
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import msgspec

    from appliance.config.sections import ServerSettings

    parser = argparse.ArgumentParser(prog="appliance", description="A self-hosted LLM server with an OpenAI-compatible API.",
                                     epilog=epilog())
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the models in the config over HTTP")
    serve.add_argument("--config", type=Path, help="config file (default: $APPLIANCE_CONFIG, else ./models.toml, else the data "
                                                   "directory's; a first start with none writes the bundled one there)")
    listen = {f.name: f.default for f in msgspec.structs.fields(ServerSettings)}
    serve.add_argument("--host", help=f"the address to listen on (default: the config's [server] host, else {listen['host']})")
    serve.add_argument("--port", type=int, help=f"the port to listen on, 0 for any free one (default: the config's [server] port, "
                                                f"else {listen['port']})")
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="config file tools").add_subparsers(dest="config_command", required=True)
    check = config.add_parser("check", help="validate a config file")
    check.add_argument("path", nargs="?", type=Path, help="the config file (default: as `serve` finds it)")
    check.set_defaults(func=cmd_config_check)
    config.add_parser("docs", help="print the reference of every key (docs/config.md)").set_defaults(func=cmd_config_docs)

    models = sub.add_parser("models", help="the model fleet").add_subparsers(dest="models_command", required=True)
    listing = models.add_parser("list", help="list configured models and where their files are")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--config", type=Path)
    listing.set_defaults(func=cmd_models_list)
    pull = models.add_parser("pull", help="download hub models named in the config, or REPO FILE.gguf (then registered)")
    pull.add_argument("alias", nargs="*", help="aliases from the config, or a hub repo and a .gguf file in it")
    pull.add_argument("--alias", dest="register_alias", help="the alias to register REPO FILE under")
    pull.add_argument("--config", type=Path)
    add_server_options(pull)
    pull.set_defaults(func=cmd_models_pull)
    add = models.add_parser("add", help="register a local GGUF file in the config")
    add.add_argument("path", type=Path, help="the GGUF file")
    add.add_argument("--alias", help="the alias to register it under (default: from the file's name)")
    add.add_argument("--config", type=Path)
    add_server_options(add)
    add.set_defaults(func=cmd_models_add)
    quant = models.add_parser("quantize", help="quantize a model (a path or a configured alias) with llama.cpp or mlx-lm and register it")
    quant.add_argument("source", type=Path, help="a model file or folder, or a configured alias (its settings are copied)")
    from appliance.fleet.admin import QUANT_TYPES

    quant.add_argument("--engine", choices=["llamacpp", "mlx"], default="llamacpp",
                       help="llamacpp: a GGUF of --type; mlx: an MLX folder of --bits and --group-size (from a GGUF or an MLX folder)")
    quant.add_argument("--type", choices=sorted(QUANT_TYPES), metavar="TYPE", help=f"llama.cpp, required: one of {', '.join(QUANT_TYPES)}")
    quant.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8], help="mlx: bits per weight (default 4)")
    quant.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="mlx: weights per scale (default 64)")
    quant.add_argument("--out", type=Path, help="the output file (default: beside the source, named by the type)")
    quant.add_argument("--alias", help="the alias to register it under (default: the source's alias and the type, or the file's name)")
    quant.add_argument("--allow-requantize", action="store_true", help="quantize a file that is already quantized")
    quant.add_argument("--no-register", action="store_true", help="write the file only")
    quant.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads (default: the CPU count, %(default)s here)")
    quant.add_argument("--config", type=Path)
    add_server_options(quant)
    quant.set_defaults(func=cmd_models_quantize)
    cli_fleet.add_commands(models, config)
    convert = models.add_parser("convert", help="write an MLX model folder from a llama-architecture GGUF (no second download)")
    convert.add_argument("source", type=Path, help="the GGUF file")
    convert.add_argument("--to", choices=["mlx"], required=True, help="the format to write")
    convert.add_argument("--out", type=Path, help="the folder to write (default: beside the source, <name>-mlx)")
    convert.set_defaults(func=cmd_models_convert)

    cli_accounts.add_commands(sub)
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

    doctor = sub.add_parser("doctor", help="check this machine, the engines and the models (exit 1: a problem found)")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--config", type=Path)
    doctor.set_defaults(func=cmd_doctor)

    cli_service.add_commands(sub)

    completion = sub.add_parser("completion", help="print a shell completion script (bash: eval \"$(appliance completion bash)\" "
                                                   "in ~/.bashrc; zsh: save it as _appliance on $fpath; fish: as "
                                                   "~/.config/fish/completions/appliance.fish)")
    completion.add_argument("shell", choices=("bash", "zsh", "fish", "tcsh"))
    completion.set_defaults(func=cmd_completion)
    return finish(parser)


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
        return USAGE
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
