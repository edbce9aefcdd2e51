"""The `appliance` command: serve, config check, models list/pull, doctor."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
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

    from appliance.model_files import ModelFileError, resolve

    settings = _settings(args.config)
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
    from appliance.model_files import ModelFileError, download, resolve, sha256

    if len(args.alias) == 2 and "/" in args.alias[0] and args.alias[1].endswith(".gguf"):
        return _pull_hub_file(args, *args.alias)
    settings = _settings(args.config)
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
    from appliance.model_admin import ModelAdminError, alias_for, check_alias, register
    from appliance.model_files import ModelFileError, download

    config = find_config(args.config)
    try:
        alias = check_alias(args.register_alias or alias_for(Path(filename)))
        settings = load_settings(config)
        path, digest = download(repo, filename, settings.server.data_dir)
        register(config, alias, path, digest)
    except (ModelFileError, ModelAdminError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}\nsha256 {digest}\nregistered as {alias!r} in {config}")
    return 0


def cmd_models_add(args: argparse.Namespace) -> int:
    from appliance.model_admin import ModelAdminError, alias_for, check_alias, file_type, register
    from appliance.model_files import sha256

    config = find_config(args.config)
    path = args.path.expanduser().resolve()
    try:
        alias = check_alias(args.alias or alias_for(path))
        if not path.is_file():
            raise ModelAdminError(f"{path}: no such file")
        kind = file_type(path)
        digest = sha256(path)
        register(config, alias, path, digest)
    except ModelAdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path} ({kind})\nsha256 {digest}\nregistered as {alias!r} in {config}")
    return 0


def cmd_models_quantize(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from appliance.model_admin import ModelAdminError, alias_for, check_alias, quantize, quantized_name, register
    from appliance.model_files import ModelFileError, resolve, sha256

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
            register(config, alias, dst, digest, like=like)
            print(f"registered as {alias!r} in {config}")
    except (ModelAdminError, ModelFileError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _quantize_mlx(args: argparse.Namespace, config: Path, src: Path, like: str | None) -> int:
    """mlx-lm's quantization into an MLX folder, registered with engine = "mlx"."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from appliance.model_admin import ModelAdminError, alias_for, register
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
            register(config, alias, dst, None, like=like, engine="mlx")
            print(f"registered as {alias!r} in {config}")
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


def _config_in_use(config: Path | None) -> Settings | None:
    """The config's settings; None when none was named and there is no config file to find."""
    try:
        return _settings(config)
    except ConfigError as exc:
        if config is not None or exc.key != "(file)":
            raise
        return None


def _data_dir(settings: Settings | None) -> Path:
    from appliance.paths import default_data_dir

    return settings.server.data_dir if settings is not None else default_data_dir()


def _ledger_db(config: Path | None):  # type: ignore[no-untyped-def]
    """The data directory's database, migrated; the config names the directory when there is one."""
    return _ledger_of(_config_in_use(config))


def _ledger_of(settings: Settings | None):  # type: ignore[no-untyped-def]
    from appliance.store.db import connect, database_path, migrate

    db = connect(database_path(_data_dir(settings)))
    migrate(db)
    return db


def parse_expiry(text: str, now: float) -> float:
    """'30d', '12h', '45m', '90s', or an ISO 8601 date or time (UTC unless it says otherwise)."""
    from datetime import datetime, timezone

    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[:-1].isdigit() and text[-1:] in units:
        return now + int(text[:-1]) * units[text[-1]]
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--expires: {text!r} is neither a duration (30d, 12h, 45m, 90s) nor an ISO 8601 date") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def cmd_keys_create(args: argparse.Namespace) -> int:
    from appliance.store.db import database_path
    from policy.keystore import KeyStore

    now = time.time()
    try:
        expires = parse_expiry(args.expires, now) if args.expires else None
        settings = _config_in_use(args.config)
        db = _ledger_of(settings)
        try:
            record, secret = KeyStore(db).create(
                user=args.user, tenant=args.tenant, app=args.app, role=args.role, admin=args.admin, now=now, expires_at=expires)
        finally:
            db.close()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created {'admin ' if record.admin else ''}key {record.id} for user {record.user}, tenant {record.tenant}, "
          f"app {record.app}, role {record.role}" + (f", expires {args.expires}" if expires else ""))
    # A key written to another data directory than the server's is a key that server never sees.
    print(f"stored in {database_path(_data_dir(settings))}" + (f" (the data directory of {settings.file})" if settings else
                                                               " (no config file found: the default data directory)"))
    if settings is not None and settings.auth.mode == "open":
        print(f"warning: {settings.file} has [auth] mode = \"open\": a server started with it checks no keys, so this key "
              "is not asked for until mode = \"keys\"", file=sys.stderr)
    print("the secret is shown once; store it now:")
    print(secret)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from policy.keystore import KeyStore

    db = _ledger_db(args.config)
    try:
        revoked = KeyStore(db).revoke(args.id, time.time())
    finally:
        db.close()
    if not revoked:
        print(f"error: there is no active key {args.id}", file=sys.stderr)
        return 1
    print(f"revoked {args.id} (a running server stops accepting it within its key cache time)")
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from policy.keystore import KeyStore

    db = _ledger_db(args.config)
    try:
        records = KeyStore(db).all()
    finally:
        db.close()
    _print_rows(("id", "user", "tenant", "app", "role", "admin", "expires_at", "revoked_at"), [
        (r.id, r.user, r.tenant, r.app, r.role, "yes" if r.admin else "no", _when(r.expires_at), _when(r.revoked_at)) for r in records
    ])
    return 0


def _when(epoch: float | None) -> str:
    from datetime import datetime, timezone

    return "-" if epoch is None else datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    if not sys.stdout.isatty():  # scripts get tab-separated lines, never a wrapped table
        for row in (header, *rows):
            print("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def cmd_budgets_set(args: argparse.Namespace) -> int:
    from policy.budgets import nanos_from_usd
    from policy.ledger import Ledger, LedgerError

    if args.level != "global" and not args.name:
        print(f"error: a {args.level} budget needs the {args.level}'s name", file=sys.stderr)
        return 2
    if args.usd < 0:
        print("error: --usd must be zero or more", file=sys.stderr)
        return 2
    db = _ledger_db(args.config)
    try:
        Ledger(db).set_limit(args.level, args.name or "*", nanos_from_usd(args.usd), args.period, time.time())
    except LedgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.close()
    print(f"{args.level} {args.name or '*'}: ${args.usd:g} per {args.period}")
    return 0


def cmd_budgets_unset(args: argparse.Namespace) -> int:
    from policy.ledger import Ledger

    db = _ledger_db(args.config)
    try:
        removed = Ledger(db).remove_limit(args.level, args.name or "*")
    finally:
        db.close()
    if not removed:
        print(f"error: there is no budget for {args.level} {args.name or '*'}", file=sys.stderr)
        return 1
    print(f"removed the budget of {args.level} {args.name or '*'} (spend is still recorded)")
    return 0


def cmd_budgets_reset(args: argparse.Namespace) -> int:
    from policy.budgets import usd
    from policy.ledger import Ledger

    db = _ledger_db(args.config)
    try:
        written_off = Ledger(db).reset_spend(args.level, args.name or "*", args.period, time.time())
    finally:
        db.close()
    print(f"{args.level} {args.name or '*'}: wrote off ${usd(written_off):.6f} of this {args.period}'s spend")
    return 0


def cmd_budgets_show(args: argparse.Namespace) -> int:
    import json

    from policy.budgets import usd
    from policy.ledger import Ledger

    now = time.time()
    db = _ledger_db(args.config)
    try:
        ledger = Ledger(db)
        budgets, reservations = ledger.budgets(now), ledger.reservations()
        top = {level: ledger.top_spenders(level, "day", now) for level in ("user", "tenant", "app")}
        problems = ledger.imbalances()
    finally:
        db.close()
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
    _print_rows(("level", "name", "period", "limit_usd", "spent_usd", "held_usd", "remaining_usd"), [
        (b.level, b.name, b.period, f"{usd(b.limit_nanos):.6f}", f"{usd(b.spent_nanos):.6f}", f"{usd(b.held_nanos):.6f}",
         f"{usd(max(0, b.limit_nanos - b.spent_nanos - b.held_nanos)):.6f}") for b in budgets
    ])
    print(f"reservations in flight: {len(reservations)}; ledger {'balanced' if not problems else 'NOT balanced: ' + '; '.join(problems)}")
    return 0


def cmd_eval_router(args: argparse.Namespace) -> int:
    import json

    from rich.progress import Progress

    from appliance import evaluate
    from policy.budgets import Price

    db = _ledger_db(args.config)
    try:
        if args.history:
            for run in evaluate.history(db):
                comparison = run["summary"].get("_comparison", {})
                print(json.dumps({"id": run["id"], "at": _when(run["at"]), "questions": run["questions"], **comparison}))
            return 0
        settings = _settings(args.config)
        route = settings.route(args.route)
        if route is None:
            print(f"error: {settings.file}: routes: no route with alias {args.route!r}", file=sys.stderr)
            return 2
        prices = {m.alias: Price.per_million(m.price_input_per_mtok, m.price_output_per_mtok) for m in settings.models}
        questions = (evaluate.load_questions(args.file, args.limit or sys.maxsize) if args.file
                     else evaluate.numeric(evaluate.gsm8k(args.limit or 50)))
        check = None
        if any(q.record is not None for q in questions):
            found = args.checker or evaluate.find_checker(args.file)
            if found is None:
                print(f"error: {args.file} holds workload records: name their checker with --checker PATH (check.py)", file=sys.stderr)
                return 2
            check = evaluate.load_checker(found)
        url = args.url or f"http://{settings.server.host}:{settings.server.port}"
        answers: list[evaluate.Answer] = []
        targets = len(route.tiers) + (0 if args.tiers_only else 1)
        with Progress() as progress:
            task = progress.add_task(f"{len(questions)} questions x {targets} targets", total=len(questions))
            summary = evaluate.run(url, args.key or "unused", route.alias, list(route.tiers), prices, questions, args.max_tokens,
                                   lambda done: progress.update(task, completed=done), answers, include_route=not args.tiers_only,
                                   check=check)
        run_id = evaluate.store(db, args.file.name if args.file else "gsm8k", len(questions), summary, answers, questions)
    finally:
        db.close()
    header = ("target", "accuracy", "cost_usd", "p50_latency_s", "answered_by", "errors")
    rows = [(name, f"{s['accuracy']:.1%}", f"{s['cost_usd']:.6f}", f"{s['p50_latency_s']:.2f}", json.dumps(s["answered_by"]), str(s["errors"]))
            for name, s in summary.items() if not name.startswith("_")]
    _print_rows(header, rows)
    print(json.dumps({"run": run_id, **summary.get("_comparison", {})}, indent=2))
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def cmd_eval_calibrate(args: argparse.Namespace) -> int:
    """Stored eval runs' per-question results to a calibration file a route reads (`calibration = PATH`):
    the labelled questions themselves for the learned router (kNN), and a tier per bucket."""
    import dataclasses

    from appliance import calibration_file, evaluate, offline_routing
    from policy.router import calibrate
    from policy.router_knn import KnnSettings

    db = _ledger_db(args.config)
    try:
        runs = args.run or [r for r in [evaluate.latest_run(db)] if r is not None]
        if not runs:
            print("error: no stored eval run with per-question results: run `appliance eval router` first", file=sys.stderr)
            return 2
        tiers = evaluate.tiers_of(db, runs[-1])
        if not tiers:
            print(f"error: eval run {runs[-1]} does not exist or predates per-question results", file=sys.stderr)
            return 2
        found = evaluate.observations(db, runs, tuple(tiers))
        every, partial = evaluate.labelled(db, runs, tuple(tiers))
    finally:
        db.close()
    # A manipulated copy's labels say what the padding did to the tiers, not what the question needs.
    rows = [r for r in every if r.adversarial_of is None]
    if not found:
        print(f"error: eval runs {runs} hold no answers from the tiers {tiers}", file=sys.stderr)
        return 2
    if args.method == "knn" and not rows:
        print(f"error: eval runs {runs} keep no question texts (they predate them): run `appliance eval router` again, "
              "or pass --method buckets", file=sys.stderr)
        return 2
    calibration = calibrate(found, tuple(tiers), args.keep, args.min_samples)
    if args.method == "knn":
        chosen = {"k": args.k, "floor": args.floor, "min_neighbours": args.min_neighbours}
        settings = KnnSettings(**{name: value for name, value in chosen.items() if value is not None})
        calibration = dataclasses.replace(calibration, knn=evaluate.train_knn(rows, settings))
    try:  # the route names it relative to the config file's folder
        shown = os.path.relpath(args.out.resolve(), find_config(args.config).resolve().parent)
    except (ConfigError, ValueError):
        shown = str(args.out.resolve())
    knn = calibration.knn
    learned = (f"The labelled table ({len(rows)} questions every tier answered) is {calibration_file.table_path(args.out).name}: "
               f"each request goes to the cheapest tier whose accuracy on its nearest labelled questions is at least keep x the best tier's;\n"
               f"the buckets below decide where it has fewer than {knn.settings.min_neighbours} neighbours above similarity {knn.settings.floor}.\n"
               if knn is not None else "")
    note = (f"Written by `appliance eval calibrate` from eval runs {', '.join(map(str, runs))} ({len(found)} answers) on {_when(time.time())}.\n"
            f"{learned}Each bucket's tier is the cheapest whose smoothed accuracy there is at least keep x the best tier's.\n"
            f"A route uses it with `calibration = \"{shown}\"`.")
    calibration_file.write(args.out, calibration, note)
    header = ("bucket", "samples", "tier", *(f"accuracy {t}" for t in tiers), "used")
    used = set(calibration.measured())
    table = [(name, str(c.samples), tiers[c.tier], *(f"{a:.2f}" for a in c.accuracy), "yes" if name in used else "too few")
             for name, c in calibration.choices]
    _print_rows(header, table)
    if knn is not None:
        print(f"\nlearned (kNN, k={knn.settings.k}): {knn.samples} labelled questions ({partial} left out: a tier failed to answer; "
              f"{len(every) - len(rows)} manipulated copies left out); "
              f"accuracy by tier {' / '.join(f'{a:.1%}' for a in knn.accuracy())}")
        # Each labelled question decided by the others alone: what the table knows about questions it has not seen.
        rows_ = offline_routing.knn_rows(knn)
        choices = offline_routing.leave_one_out(knn, args.keep)
        covered = [i for i, c in enumerate(choices) if c is not None]
        if covered:
            figures = offline_routing.figures("leave-one-out", [rows_[i] for i in covered], [choices[i] for i in covered if choices[i] is not None])
            print(f"leave-one-out on the {len(covered)} with neighbours: accuracy {figures.accuracy:.1%} ({figures.accuracy_vs_frontier or 0:.1%} of the frontier's) "
                  f"at {figures.cost_vs_frontier or 0:.1%} of its cost, {100 * (figures.above_random_line or 0):+.1f} points against random routing")
    print(f"wrote {args.out}" + (f" and {calibration_file.table_path(args.out)}" if calibration.knn is not None else ""))
    return 0


def cmd_eval_simulate(args: argparse.Namespace) -> int:
    """A stored run's questions routed again offline, from every tier's stored answers: the heuristics,
    each heuristic feature's value, and a calibration's choices (at several thresholds), against the
    tiers alone and the random-routing line. No model is called."""
    import dataclasses
    import json

    from appliance import calibration_file, evaluate, offline_routing
    from policy.router import ALL_FEATURES, HEURISTIC_FEATURES, features

    db = _ledger_db(args.config)
    try:
        tiers = evaluate.tiers_of(db, args.run)
        if not tiers:
            print(f"error: eval run {args.run} does not exist or predates per-question results", file=sys.stderr)
            return 2
        labelled, partial = evaluate.labelled(db, [args.run], tuple(tiers))
    finally:
        db.close()
    if not labelled:
        print(f"error: eval run {args.run} keeps no question every tier answered (or predates question texts)", file=sys.stderr)
        return 2
    calibration = None
    if args.calibration:
        try:
            calibration = calibration_file.read(args.calibration)
        except calibration_file.CalibrationError as exc:
            print(f"error: {args.calibration}: {exc}", file=sys.stderr)
            return 2
        if list(calibration.tiers) != tiers:
            print(f"error: {args.calibration} was measured with tiers {list(calibration.tiers)}, run {args.run} with {tiers}", file=sys.stderr)
            return 2
    if calibration is not None and calibration.knn is not None:
        found, _, vectors, _ = evaluate.routing_inputs(labelled)
    else:
        found, vectors = [features(list(r.messages), r.structured) for r in labelled], None
    rows = [offline_routing.Row(f, tuple(float(c) for c in r.correct), tuple(float(c) for c in r.cost_nanos)) for f, r in zip(found, labelled)]
    routes: list[tuple[str, list[int]]] = [(f"always {t}", [i] * len(rows)) for i, t in enumerate(tiers)]
    routes.append(("heuristics", offline_routing.heuristic_choices(rows, HEURISTIC_FEATURES)))
    values = offline_routing.feature_values(rows, ALL_FEATURES)
    keep_features = offline_routing.kept(values)
    if keep_features != HEURISTIC_FEATURES:
        routes.append(("heuristics (predictive features)", offline_routing.heuristic_choices(rows, keep_features)))
    if calibration is not None:
        for keep in sorted({calibration.keep, *args.keep}):
            routes.append((f"{calibration.method} keep {keep}",
                           offline_routing.calibrated_choices(rows, dataclasses.replace(calibration, keep=keep), vectors)))
    results = [offline_routing.figures(name, rows, chosen) for name, chosen in routes]
    refs, bases = [r.ref for r in labelled], [r.adversarial_of for r in labelled]
    dearer = {name: offline_routing.manipulated(refs, bases, chosen) for name, chosen in routes}
    print(f"run {args.run}: {len(rows)} questions every tier answered ({partial} left out), {sum(b is not None for b in bases)} manipulated copies")
    _print_rows(("route", "accuracy", "vs frontier", "cost vs frontier", "vs random line", "shares by tier", "manipulated"), [
        (r.name, f"{r.accuracy:.1%}", f"{r.accuracy_vs_frontier or 0:.1%}", f"{r.cost_vs_frontier or 0:.1%}",
         f"{100 * (r.above_random_line or 0):+.1f}", " / ".join(f"{s:.0%}" for s in r.shares), str(len(dearer[r.name]))) for r in results])
    for name, found_dearer in dearer.items():
        for ref, tier, base in found_dearer:
            print(f"manipulated ({name}): {ref} went to {tiers[tier]}, its plain question to {tiers[base]}")
    print()
    _print_rows(("feature", "moved", "accuracy gain", "cost added", "verdict"), [
        (v.name, str(v.moved), "" if v.accuracy_gain is None else f"{v.accuracy_gain:+.2f}", "" if v.cost_added is None else f"{v.cost_added:.0f}",
         "predicts" if v.predicts else "unmeasured" if v.predicts is None else "drop") for v in values])
    print(json.dumps({"run": args.run, "routes": [{**dataclasses.asdict(r), "manipulated": len(dearer[r.name])} for r in results],
                      "kept_features": list(keep_features)}))
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    from tui.app import run

    if args.url:
        url = args.url
    else:
        try:
            server = _settings(args.config).server
            url = f"http://{server.host}:{server.port}"
        except ConfigError:
            url = "http://127.0.0.1:8080"
    run(url, args.key)
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
    pull = models.add_parser("pull", help="download hub models named in the config, or REPO FILE.gguf (then registered)")
    pull.add_argument("alias", nargs="*", help="aliases from the config, or a hub repo and a .gguf file in it")
    pull.add_argument("--alias", dest="register_alias", help="the alias to register REPO FILE under")
    pull.add_argument("--config", type=Path)
    pull.set_defaults(func=cmd_models_pull)
    add = models.add_parser("add", help="register a local GGUF file in the config")
    add.add_argument("path", type=Path)
    add.add_argument("--alias")
    add.add_argument("--config", type=Path)
    add.set_defaults(func=cmd_models_add)
    quant = models.add_parser("quantize", help="quantize a model (a path or a configured alias) with llama.cpp or mlx-lm and register it")
    quant.add_argument("source", type=Path)
    from appliance.model_admin import QUANT_TYPES

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
    quant.set_defaults(func=cmd_models_quantize)
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

    evaluation = sub.add_parser("eval", help="evaluations").add_subparsers(dest="eval_command", required=True)
    router = evaluation.add_parser("router", help="GSM8K through a route and each of its tiers, over HTTP")
    router.add_argument("--route", default="auto")
    router.add_argument("--limit", type=int, help="questions: the first N (default: 50 of GSM8K's test split, all of a --file)")
    router.add_argument("--max-tokens", type=int, default=384)
    router.add_argument("--url", help="the appliance (default: the config's host and port)")
    router.add_argument("--key", help="an API key (not needed in open mode)")
    router.add_argument("--file", type=Path, help="JSONL with question and answer ('#### N'), or workload records (messages), instead of GSM8K")
    router.add_argument("--checker", type=Path, help="for workload records: the Python file whose check(record, text) judges an answer "
                                                     "(default: check.py beside the file or one folder up)")
    router.add_argument("--history", action="store_true", help="list earlier runs")
    router.add_argument("--tiers-only", action="store_true", help="skip the route: measure the tiers alone (for a calibration)")
    router.add_argument("--config", type=Path)
    router.set_defaults(func=cmd_eval_router)
    calibration = evaluation.add_parser("calibrate", help="the learned router (and a tier per kind of request), from stored eval runs")
    calibration.add_argument("--run", type=int, action="append", help="an eval run's id (repeat to pool runs; default: the latest)")
    calibration.add_argument("--keep", type=_fraction, default=0.9,
                             help="the threshold: the cheapest tier whose estimated accuracy is at least this share of the best tier's")
    calibration.add_argument("--method", choices=("knn", "buckets"), default="knn",
                             help="knn: the labelled questions nearest each request, then the buckets; buckets: a tier per bucket only")
    # kNN settings left out keep KnnSettings' defaults (policy/router_knn.py), declared there once.
    calibration.add_argument("--k", type=int, help="neighbours a kNN estimate reads")
    calibration.add_argument("--floor", type=float, help="cosine similarity below which a labelled question is no neighbour")
    calibration.add_argument("--min-neighbours", type=int, help="neighbours above the floor a kNN decision needs")
    calibration.add_argument("--min-samples", type=int, default=4, help="questions a bucket needs before its tier is used")
    calibration.add_argument("--out", type=Path, required=True, help="the calibration file to write")
    calibration.add_argument("--config", type=Path)
    calibration.set_defaults(func=cmd_eval_calibrate)
    simulate = evaluation.add_parser("simulate", help="a stored run routed again offline from every tier's answers (no model call)")
    simulate.add_argument("--run", type=int, required=True, help="a run measured on every tier (--tiers-only), e.g. on a development split")
    simulate.add_argument("--calibration", type=Path, help="a calibration file to route with too")
    simulate.add_argument("--keep", type=_fraction, action="append", default=[], help="other thresholds to try the calibration at (repeat)")
    simulate.add_argument("--config", type=Path)
    simulate.set_defaults(func=cmd_eval_simulate)

    tui = sub.add_parser("tui", help="the operator's terminal UI, over the admin API")
    tui.add_argument("--url", help="the appliance (default: the config's host and port)")
    tui.add_argument("--key", help="an admin key (not needed when the open principal is admin)")
    tui.add_argument("--config", type=Path)
    tui.set_defaults(func=cmd_tui)

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
