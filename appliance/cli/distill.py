"""`appliance distill ...`: the appliance teaches its cheapest tier from its own verified answers.
`export` is the collect step (appliance/distill/export.py). `train` trains a LoRA adapter for a
student model in its own process with a progress bar, paused while a server at --url has requests;
Ctrl-C (or SIGTERM) stops it at the end of the step under way and keeps a checkpoint that the same
command resumes. The finished adapter is
registered in models.toml and a running server is asked to serve it (POST /admin/config/reload)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing
from datetime import datetime
from pathlib import Path

from appliance.cli.exits import INTERRUPTED, NOT_PROMOTED, UNREACHABLE
from appliance.cli.fleet import add_server_options, server_url, tell_server
from appliance.cli.support import ledger_of, moment, settings_of
from appliance.config.settings import RouteSettings, find_config, load_settings


def cmd_distill_export(args: argparse.Namespace) -> int:
    from appliance.distill.export import HELD_OUT, TRAIN, Asked, ExportError, export

    settings = settings_of(args.config)
    now = time.time()
    try:
        start = moment(args.since, now, -1, "--since")
        if start >= now:
            raise ValueError(f"--since: {args.since!r} is not in the past; give a window such as 7d or a date before now")
        held_out = float(args.held_out)
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("--") else f"--held-out: {args.held_out!r} is not a number; give a share such as 0.1"
        print(f"error: {message}", file=sys.stderr)
        return 2
    asked = Asked(args.route, now - start, args.out, args.family, held_out, args.seed)
    with closing(ledger_of(settings)) as db:
        try:
            chosen = export(db, settings, asked, now)
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    c = chosen.counts
    print(f"found: {c.found} kept answers of route {args.route!r}" + (f", family {args.family!r}" if args.family else "") + f" since {args.since}")
    print(f"verified: {c.verified}")
    print(f"opted in: {c.opted_in}")
    print(f"dropped for personal data: {c.personal_data}")
    print(f"duplicates: {c.duplicates}")
    print(f"train: {c.train} -> {args.out / TRAIN}")
    print(f"held out: {c.held_out} -> {args.out / HELD_OUT}")
    return 0


def add_export_command(distill: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    export = distill.add_parser("export", help="verified answers of opted-in tenants as chat-format JSONL: train and held-out files")
    export.add_argument("--route", default="auto", help="the route whose answers to export; its last tier is the frontier (default: auto)")
    export.add_argument("--family", help="only answers whose request named this task family (metadata {\"family\": ...})")
    export.add_argument("--since", default="7d", help="answers kept since: a duration back from now (7d, 12h) or an ISO 8601 date")
    export.add_argument("--out", type=Path, required=True, help="the folder to write train.jsonl, held-out.jsonl and export.json into")
    export.add_argument("--held-out", default="0.1", help="the share of prompts held out of training (default 0.1)")
    export.add_argument("--seed", type=int, default=0, help="another seed, another (still deterministic) split")
    export.add_argument("--config", type=Path)
    export.set_defaults(func=cmd_distill_export)


def cmd_distill_train(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from appliance.fleet.admin import alias_for
    from appliance.train import job as training
    from appliance.train.plan import OptionError, Options, wait_until

    config = find_config(args.config)
    options = Options(epochs=args.epochs, steps=args.steps, rank=args.rank, alpha=args.alpha, learning_rate=args.learning_rate,
                      batch_size=args.batch_size, max_tokens=args.max_tokens, save_every=args.save_every,
                      modules=tuple(m.strip() for m in args.modules.split(",")) if args.modules else Options().modules,
                      trainer=args.trainer)
    data = args.data.expanduser().resolve()
    name = args.out or alias_for(data)
    try:
        wait_until(args.start_at, datetime.now())
    except OptionError as exc:
        print(f"error: --start-at: {str(exc).removeprefix('start_at ')}", file=sys.stderr)
        return 1
    try:
        prepared = training.prepare(load_settings(config), args.student, data, name, options, fresh=args.fresh,
                                    threads=args.threads, nice=args.nice)
    except training.TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    spec = prepared.spec
    left_out = f", {len(prepared.left_out)} left out as longer than {options.max_tokens} tokens" if prepared.left_out else ""
    trainer = {"mlx": "mlx-lm", "torch": "PyTorch"}[spec.trainer]
    print(f"training {spec.student}:{spec.adapter} with {trainer} on {spec.example_count} examples{left_out}: {prepared.steps} steps, "
          f"{spec.threads} threads at nice {spec.nice}" + (" (resuming from its last checkpoint)" if prepared.resume else ""))
    busy = None if args.no_yield else server_busy(server_url(args), args.key)
    if busy is not None:
        print(f"paused whenever the server at {server_url(args)} has requests (--no-yield: never)")
    cancel = threading.Event()
    outcome: dict[str, object] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("loading the student", total=prepared.steps, loss="-")

        def show(p: training.Progress) -> None:
            bar.update(task, completed=p.step, total=p.steps, description=p.phase,
                       loss="-" if p.loss is None else f"{p.loss:.3f}")

        def work() -> None:
            try:
                outcome["record"] = training.run(prepared, show, cancel, busy=busy, start_at=args.start_at)
            except BaseException as exc:  # shown below, on the main thread
                outcome["error"] = exc

        def stop(signum: int, frame: object) -> None:  # the worker finishes its step and saves a checkpoint
            cancel.set()
            bar.update(task, description="stopping after this step")

        # Ctrl-C and a plain `kill` both stop it cleanly (a handler of our own: a shell may start us with SIGINT ignored).
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            worker = threading.Thread(target=work, name="train", daemon=True)
            worker.start()
            while worker.is_alive():
                worker.join(0.2)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    error = outcome.get("error")
    if isinstance(error, training.TrainCancelled):
        print(str(error), file=sys.stderr)
        return INTERRUPTED
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    record = outcome["record"]
    assert isinstance(record, dict)
    before = config.read_text()
    try:
        target = training.install(prepared, config)
    except Exception as exc:  # a refused models.toml change: nothing was left behind
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"trained in {record['seconds_this_session']:.0f}s, final loss {record['final_loss']:.3f}\n{prepared.paths.adapter}\n"
          f"registered as {spec.student}:{spec.adapter} ({target.name}) in {config}")
    return tell_server(args, config, before)


def server_busy(url: str, key: str | None) -> Callable[[], bool] | None:
    """A check of whether the running server has requests (its /health), when one answers at `url`."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=2)

    last = [0.0, False]

    def busy() -> bool:  # asked at most every 0.1 s: each ask is a request the server answers
        if time.monotonic() - last[0] >= 0.1:
            models = client.get("/health").json()["models"]
            # models with upstreams run elsewhere and use no CPU here
            last[:] = [time.monotonic(), any((m.get("slots_busy") or m.get("queue_depth")) and "upstreams" not in m for m in models.values())]
        return bool(last[1])

    try:
        busy()
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        client.close()
        return None
    return busy


def add_train_command(distill: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from appliance.train.plan import Options

    d = Options()
    train = distill.add_parser("train", help="train a LoRA adapter for a student model from chat-format JSONL examples")
    train.add_argument("--student", required=True, help="the alias of the model to teach (its GGUF file is trained)")
    train.add_argument("--data", type=Path, required=True, help="the folder `appliance distill export` wrote, or a JSONL file: one {\"messages\": [...]} a line, the answer last")
    train.add_argument("--out", help="the adapter's name (default: from the data file's name); requests use STUDENT:NAME")
    train.add_argument("--epochs", type=float, default=d.epochs, help=f"passes over the examples (default {d.epochs:g})")
    train.add_argument("--steps", type=int, help="exactly this many optimizer steps instead of --epochs")
    train.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    train.add_argument("--alpha", type=float, help="LoRA alpha; the update is scaled by alpha / rank (default: twice the rank)")
    train.add_argument("--learning-rate", type=float, default=d.learning_rate, help=f"(default {d.learning_rate:g})")
    train.add_argument("--batch-size", type=int, default=d.batch_size, help=f"examples a step (default {d.batch_size})")
    train.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"longer examples are left out (default {d.max_tokens})")
    train.add_argument("--save-every", type=int, default=d.save_every, help=f"steps between checkpoints (default {d.save_every})")
    train.add_argument("--modules", help=f"the projections to adapt, comma-separated (default {','.join(d.modules)})")
    train.add_argument("--trainer", choices=("auto", "torch", "mlx"), default=d.trainer,
                       help="mlx-lm or PyTorch; auto: mlx-lm on Apple silicon, PyTorch elsewhere")
    train.add_argument("--threads", type=int, help="the trainer's CPU threads (default: the CPU count)")
    train.add_argument("--nice", type=int, default=10, help="the trainer's priority below serving's (default 10)")
    train.add_argument("--start-at", metavar="HH:MM", help="hold the job until this local time (quiet hours); Ctrl-C ends the wait")
    train.add_argument("--fresh", action="store_true", help="discard a stopped run of this name instead of resuming it")
    train.add_argument("--no-yield", action="store_true",
                       help="keep training while the server at --url has requests (by default it pauses: serving keeps the CPU)")
    train.add_argument("--config", type=Path)
    add_server_options(train)
    train.set_defaults(func=cmd_distill_train)


def cmd_distill_evaluate(args: argparse.Namespace) -> int:
    import httpx
    from rich.progress import Progress

    from appliance.cli.fleet import write_and_apply
    from appliance.cli.remote import call
    from appliance.cli.support import print_rows, route_named
    from appliance.config.writer import update_table
    from appliance.distill import evaluation as distill_eval
    from policy.budgets import Price
    from policy.distill import promoted_tiers

    config = find_config(args.config)
    settings = load_settings(config)
    route = route_named(settings, args.route)
    if route is None:
        return 2
    teacher = args.teacher or route.tiers[-1]
    asked = distill_eval.Asked(args.student, args.adapter, teacher, args.data.expanduser(), args.workload, args.family, args.max_tokens)
    prices = {m.alias: Price.of(m) for m in settings.models}
    call(server_url(args), args.key, "GET", "/v1/models")  # no server, or a key it refuses: said now, not per question
    try:
        adapter = distill_eval.adapter_path(settings, args.student, args.adapter)
        if settings.model(teacher) is None:
            raise distill_eval.EvaluateError(f"{config}: no model {teacher!r} (the teacher)")
        with Progress() as progress:
            task = progress.add_task("questions x 3 models", total=None)
            result = distill_eval.run(server_url(args), args.key or "unused", asked, prices, settings.distill.margin,
                                      lambda done, total: progress.update(task, completed=done, total=total))
    except distill_eval.EvaluateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: no server answers at {server_url(args)} ({exc}): start it with `appliance serve`", file=sys.stderr)
        return UNREACHABLE
    print_rows(distill_eval.headers_of(result), distill_eval.summary_rows(result))
    stored = distill_eval.store(adapter, result.record(asked, settings.distill.margin, time.time()))
    print(f"{'promote' if result.verdict.promote else 'not promoted'}: {result.verdict.reason}")
    print(f"stored: {stored}")
    if not args.promote:
        return 0
    if not result.verdict.promote:
        return NOT_PROMOTED  # asked to promote, refused: a script can tell
    family = args.family or distill_eval.export_family(args.data.expanduser())
    if family is not None:
        return _promote_for_family(args, config, route, family)
    tiers = promoted_tiers(route.tiers, args.student, args.adapter)
    if tiers == route.tiers:
        print(f"route {route.alias!r} already has the tier {args.student}:{args.adapter}")
        return 0
    values: dict[str, object] = {"tiers": list(tiers)}
    if route.calibration is not None:
        values["calibration"] = None  # measured without this tier: the route cannot read it any more

    def write() -> str:
        update_table(config, "routes", route.alias, values)
        said = f"route {route.alias!r}: tiers {list(tiers)}"
        if route.calibration is not None:
            said += ("\nits calibration was measured without the new tier and is removed: the route uses its heuristics until "
                     "`appliance eval router --tiers-only --file CALIBRATION --resume RUN` (asks only the new tier) and "
                     "`appliance eval calibrate --run RUN` measure it again")
        return said

    return write_and_apply(args, config, write)


def _promote_for_family(args: argparse.Namespace, config: Path, route: RouteSettings, family: str) -> int:
    """The adapter was checked on one family: the route tries it first for requests of that family
    (their metadata says so) and keeps its tiers and calibration for everything else."""
    from appliance.cli.fleet import write_and_apply
    from appliance.config.writer import update_table

    tier = f"{args.student}:{args.adapter}"
    pairs = dict(route.family_tiers)
    if pairs.get(family) == tier:
        print(f"route {route.alias!r} already tries {tier} first for family {family!r}")
        return 0

    def write() -> str:
        update_table(config, "routes", route.alias, {"family_tiers": pairs | {family: tier}})
        return (f"route {route.alias!r}: requests whose metadata names family {family!r} try {tier} first"
                + (f" (instead of {pairs[family]})" if family in pairs else ""))

    return write_and_apply(args, config, write)


def add_evaluate_command(distill: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    evaluate = distill.add_parser("evaluate", help="ask the held-out examples of the student, the student with the adapter and the "
                                                   "teacher through a running server; promote the adapter into a route if it is good enough")
    evaluate.add_argument("--student", required=True, help="the alias of the model the adapter was trained for")
    evaluate.add_argument("--adapter", required=True, help="the adapter's name (under the student in models.toml)")
    evaluate.add_argument("--data", type=Path, required=True, help="the folder `appliance distill export` wrote (its held-out.jsonl), or a held-out JSONL file")
    evaluate.add_argument("--workload", type=Path, help="workload records (a split of bench/workload) whose matching family is asked too")
    evaluate.add_argument("--family", help="the workload's family to ask (default: the export's)")
    evaluate.add_argument("--route", default="auto", help="the route to promote into; its last tier is the default teacher (default: auto)")
    evaluate.add_argument("--teacher", help="the model the adapter is measured against (default: the route's last tier)")
    evaluate.add_argument("--max-tokens", type=int, default=512, help="for questions that name none (default 512)")
    evaluate.add_argument("--promote", action="store_true",
                          help="if it beats the student alone and comes within [distill] margin of the teacher: the route tries STUDENT:ADAPTER "
                               "first for requests of the family checked (family_tiers), or, with no family, adds it to the route's tiers")
    evaluate.add_argument("--config", type=Path)
    add_server_options(evaluate)
    evaluate.set_defaults(func=cmd_distill_evaluate)
