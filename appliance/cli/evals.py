"""`appliance eval`: the router measured over HTTP (`router`), a learned router trained from stored
runs (`calibrate`), and a stored run routed again offline (`simulate`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.cli.fleet import add_server_options
from appliance.cli.support import ledger_db, print_rows, route_named, settings_of, when
from appliance.config.settings import ConfigError, find_config

if TYPE_CHECKING:
    from policy.router import Calibration


def cmd_eval_router(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from appliance.cli.remote import call
    from appliance.evaluation import runner as evaluate
    from appliance.store import eval_runs
    from policy.budgets import Price, dollars, nanos_from_usd

    with closing(ledger_db(args.config)) as db:
        if args.history:
            return _history(eval_runs.history(db), args.json)
        settings = settings_of(args.config)
        route = route_named(settings, args.route)
        if route is None:
            return 2
        prices = {m.alias: Price.of(m) for m in settings.models}
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
        call(url, args.key, "GET", "/v1/models")  # no server, or a key it refuses: said before a run is begun
        names = ([] if args.tiers_only else [route.alias]) + list(route.tiers)
        answers: list[evaluate.Answer] = []
        done: dict[int, frozenset[str]] = {}
        dataset = args.file.name if args.file else "gsm8k"
        if args.resume is not None:
            stored = evaluate.resume(db, args.resume, names)
            if stored is None:
                print(f"error: --resume {args.resume}: no such eval run (appliance eval router --history)", file=sys.stderr)
                return 2
            if stored.dataset != dataset or stored.refs != tuple(q.ref for q in questions[: len(stored.refs)]):
                print(f"error: --resume {args.resume}: that run asked {len(stored.refs)} questions of {stored.dataset}; "
                      f"give the same --file and --limit (or a higher --limit to add questions)", file=sys.stderr)
                return 2
            evaluate.extend(db, args.resume, questions)
            run_id, answers, done = args.resume, list(stored.answers), stored.answered
        else:
            run_id = evaluate.begin(db, dataset, questions, list(route.tiers))
        whole = sum(1 for answered in done.values() if answered >= set(names))
        print(f"eval run {run_id}: {len(questions)} questions, {whole} already answered by every target", file=sys.stderr)
        with Progress(console=Console(stderr=True)) as progress:  # stdout is the result's
            task = progress.add_task(f"{len(questions)} questions x {len(names)} targets", total=len(questions), completed=whole)
            summary = evaluate.run(url, args.key or "unused", route.alias, list(route.tiers), prices, questions, args.max_tokens,
                                   lambda finished: progress.update(task, advance=1), answers, include_route=not args.tiers_only,
                                   check=check, done=done, answered=lambda _, found: eval_runs.record(db, run_id, found))
        eval_runs.finish(db, run_id, summary)
    if args.json:
        print(json.dumps({"run": run_id, "summary": summary}, indent=2))
        return 0
    header = ("target", "accuracy", "cost", "p50_latency_s", "answered_by", "errors")
    rows = [(name, f"{s['accuracy']:.1%}", dollars(nanos_from_usd(s["cost_usd"])), f"{s['p50_latency_s']:.2f}", json.dumps(s["answered_by"]),
             str(s["errors"])) for name, s in summary.items() if not name.startswith("_")]
    print_rows(header, rows)
    print(json.dumps({"run": run_id, **summary.get("_comparison", {})}, indent=2))
    return 0


def _history(runs: list[dict], as_json: bool) -> int:  # type: ignore[type-arg]
    """`eval router --history`: the stored runs, newest first, with the route's comparison where it was measured."""
    listed = [{"id": r["id"], "at": when(r["at"]), "dataset": r["dataset"], "questions": r["questions"],
               "tiers": r["summary"].get("_tiers", []), "finished": not r["summary"].get("_partial", False),
               **r["summary"].get("_comparison", {})} for r in runs]
    if as_json:
        print(json.dumps({"runs": listed}, indent=2))
        return 0

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    print_rows(("id", "at", "dataset", "questions", "tiers", "finished", "route", "accuracy_vs_frontier", "cost_vs_frontier"), [
        (str(r["id"]), r["at"], r["dataset"], str(r["questions"]), ",".join(r["tiers"]), "yes" if r["finished"] else "no",
         r.get("route", "-"), share(r.get("accuracy_vs_frontier")), share(r.get("cost_vs_frontier"))) for r in listed])
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _admission(text: str) -> tuple[str, frozenset[str]]:
    tier, _, families = text.partition("=")
    named = frozenset(f.strip() for f in families.split(",") if f.strip())
    if not tier or not named:
        raise argparse.ArgumentTypeError(f"expected TIER=FAMILY[,FAMILY...], got {text!r}")
    return tier, named


class _Admissions(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        tier, families = values  # type: ignore[misc]
        found = dict(getattr(namespace, self.dest) or {})
        found[tier] = found.get(tier, frozenset()) | families
        setattr(namespace, self.dest, found)


def _extended(args: argparse.Namespace, measured: list[str], every: list) -> tuple[list[str], list, str, Calibration] | int:
    """--extend: the run's questions labelled with the route's other tiers from an earlier calibration's
    table; the tiers, the labelled rows, what the note says of it and the earlier calibration, or an
    exit status."""
    from appliance.evaluation import calibration_file
    from appliance.evaluation import runner as evaluate

    try:
        earlier = calibration_file.read(args.extend)
    except calibration_file.CalibrationError as exc:
        print(f"error: {args.extend}: {exc}", file=sys.stderr)
        return 2
    if earlier.knn is None:
        print(f"error: {args.extend}: --extend needs a calibration with a labelled table (written with --method knn)", file=sys.stderr)
        return 2
    settings = settings_of(args.config)
    route = route_named(settings, args.route)
    if route is None:
        return 2
    lacking = [t for t in route.tiers if t not in measured and t not in earlier.tiers]
    if lacking:
        print(f"error: route {route.alias!r} has tiers {lacking} that neither eval run {args.run or 'latest'} ({measured}) "
              f"nor {args.extend} ({list(earlier.tiers)}) measured", file=sys.stderr)
        return 2
    # A manipulated copy reads as its plain question: the table's labels are the plain question's.
    plain = [r for r in every if r.adversarial_of is None]
    rows, missing = evaluate.extend_labels(plain, measured, earlier.knn, earlier.tiers, route.tiers)
    if not rows:
        print(f"error: none of the run's {len(plain)} questions is in {args.extend}'s table (matched by the text the router reads)",
              file=sys.stderr)
        return 2
    print(f"extended: {len(rows)} questions labelled with {[t for t in route.tiers if t not in measured]} from {args.extend} "
          f"({missing} not in its table, left out)")
    return list(route.tiers), rows, f" and {args.extend.name}'s table (tiers {', '.join(earlier.tiers)})", earlier


def cmd_eval_calibrate(args: argparse.Namespace) -> int:
    """Stored eval runs' per-question results to a calibration file a route reads (`calibration = PATH`):
    the labelled questions themselves for the learned router (kNN), and a tier per bucket."""
    import dataclasses

    from appliance.evaluation import calibration_file, offline_routing
    from appliance.evaluation import runner as evaluate
    from appliance.store import eval_runs
    from policy.router import calibrate, extend_buckets
    from policy.router_knn import KnnSettings

    with closing(ledger_db(args.config)) as db:
        runs = args.run or [r for r in [eval_runs.latest_run(db)] if r is not None]
        if not runs:
            print("error: no stored eval run with per-question results: run `appliance eval router` first", file=sys.stderr)
            return 2
        tiers = evaluate.tiers_of(db, runs[-1])
        if not tiers:
            print(f"error: eval run {runs[-1]} does not exist or predates per-question results", file=sys.stderr)
            return 2
        found = evaluate.observations(db, runs, tuple(tiers))
        every, partial = evaluate.labelled(db, runs, tuple(tiers))
    extended, earlier = "", None
    if args.extend is not None:
        said = _extended(args, tiers, every)
        if isinstance(said, int):
            return said
        tiers, every, extended, earlier = said
        found = evaluate.observations_of(every)
    if args.admit:
        unknown = [t for t in args.admit if t not in tiers]
        if unknown:
            print(f"error: --admit {unknown[0]}: not a tier of the calibration ({', '.join(tiers)})", file=sys.stderr)
            return 2
        every = evaluate.admitted(every, tiers, args.admit)
        found = evaluate.observations_of(every)
        extended += "".join(f"; {t} admitted for {', '.join(sorted(f))} only" for t, f in args.admit.items())
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
    if earlier is not None:
        calibration = extend_buckets(calibration, earlier)
    if args.method == "knn":
        chosen = {"k": args.k, "floor": args.floor, "min_neighbours": args.min_neighbours, "task": args.task_line}
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
    note = (f"Written by `appliance eval calibrate` from eval runs {', '.join(map(str, runs))}{extended} ({len(found)} answers) on {when(time.time())}.\n"
            f"{learned}Each bucket's tier is the cheapest whose smoothed accuracy there is at least "
            f"{'bucket_keep' if calibration.bucket_keep is not None else 'keep'} x the best tier's.\n"
            f"A route uses it with `calibration = \"{shown}\"`.")
    calibration_file.write(args.out, calibration, note)
    header = ("bucket", "samples", "tier", *(f"accuracy {t}" for t in tiers), "used")
    used = set(calibration.measured())
    table = [(name, str(c.samples), tiers[c.tier], *(f"{a:.2f}" for a in c.accuracy), "yes" if name in used else "too few")
             for name, c in calibration.choices]
    print_rows(header, table)
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

    from appliance.evaluation import calibration_file, offline_routing
    from appliance.evaluation import runner as evaluate
    from policy.router import ALL_FEATURES, HEURISTIC_FEATURES, features

    with closing(ledger_db(args.config)) as db:
        tiers = evaluate.tiers_of(db, args.run)
        if not tiers:
            print(f"error: eval run {args.run} does not exist or predates per-question results", file=sys.stderr)
            return 2
        labelled, partial = evaluate.labelled(db, [args.run], tuple(tiers))
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
        found, _, vectors, _ = evaluate.routing_inputs(labelled, calibration.knn.settings.task)
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
                           offline_routing.calibrated_choices(
                               rows, dataclasses.replace(calibration, keep=keep, bucket_keep=calibration.bucket_choice_keep), vectors)))
    results = [offline_routing.figures(name, rows, chosen) for name, chosen in routes]
    refs, bases = [r.ref for r in labelled], [r.adversarial_of for r in labelled]
    dearer = {name: offline_routing.manipulated(refs, bases, chosen) for name, chosen in routes}
    found_json = {"run": args.run, "routes": [{**dataclasses.asdict(r), "manipulated": len(dearer[r.name])} for r in results],
                  "kept_features": list(keep_features)}
    if args.json:
        print(json.dumps(found_json, indent=2))
        return 0
    print(f"run {args.run}: {len(rows)} questions every tier answered ({partial} left out), {sum(b is not None for b in bases)} manipulated copies")
    print_rows(("route", "accuracy", "vs frontier", "cost vs frontier", "vs random line", "shares by tier", "manipulated"), [
        (r.name, f"{r.accuracy:.1%}", f"{r.accuracy_vs_frontier or 0:.1%}", f"{r.cost_vs_frontier or 0:.1%}",
         f"{100 * (r.above_random_line or 0):+.1f}", " / ".join(f"{s:.0%}" for s in r.shares), str(len(dearer[r.name]))) for r in results])
    for name, found_dearer in dearer.items():
        for ref, tier, base in found_dearer:
            print(f"manipulated ({name}): {ref} went to {tiers[tier]}, its plain question to {tiers[base]}")
    print()
    print_rows(("feature", "moved", "accuracy gain", "cost added", "verdict"), [
        (v.name, str(v.moved), "" if v.accuracy_gain is None else f"{v.accuracy_gain:+.2f}", "" if v.cost_added is None else f"{v.cost_added:.0f}",
         "predicts" if v.predicts else "unmeasured" if v.predicts is None else "drop") for v in values])
    print(json.dumps(found_json))
    return 0


def cmd_eval_export(args: argparse.Namespace) -> int:
    """A stored run to a JSON Lines file that another data directory can import."""
    from appliance.evaluation import eval_file

    with closing(ledger_db(args.config)) as db:
        try:
            written = eval_file.export(db, args.run, args.out)
        except eval_file.EvalFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"wrote eval run {args.run} ({written} questions) to {args.out}")
    return 0


def cmd_eval_import(args: argparse.Namespace) -> int:
    """An exported run as a new run of this data directory."""
    from appliance.evaluation import eval_file

    with closing(ledger_db(args.config)) as db:
        try:
            run_id = eval_file.load(db, args.file)
        except eval_file.EvalFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"imported {args.file} as eval run {run_id}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    evaluation = sub.add_parser("eval", help="evaluations").add_subparsers(dest="eval_command", required=True)
    router = evaluation.add_parser("router", help="GSM8K through a route and each of its tiers, over HTTP")
    router.add_argument("--route", default="auto", help="the route to measure, beside each of its tiers")
    router.add_argument("--limit", type=int, help="questions: the first N (default: 50 of GSM8K's test split, all of a --file)")
    router.add_argument("--max-tokens", type=int, default=384, help="for questions that name none")
    add_server_options(router, url="the appliance", key="an API key (not needed in open mode)")
    router.add_argument("--file", type=Path, help="JSONL with question and answer ('#### N'), or workload records (messages), instead of GSM8K")
    router.add_argument("--checker", type=Path, help="for workload records: the Python file whose check(record, text) judges an answer "
                                                     "(default: check.py beside the file or one folder up)")
    router.add_argument("--history", action="store_true", help="list earlier runs")
    router.add_argument("--json", action="store_true", help="print one JSON document on stdout (the runs, with --history; else the run's summary)")
    router.add_argument("--tiers-only", action="store_true", help="skip the route: measure the tiers alone (for a calibration)")
    router.add_argument("--resume", type=int, metavar="RUN",
                        help="go on with a run cut short, or add questions to one with a higher --limit (same --file and targets): "
                             "its answered questions are not asked again")
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
    calibration.add_argument("--task-line", action="store_true",
                             help="embed each text after the system turn's task line (measured worse on the evaluation split: "
                                  "docs/performance.md, 'The task line')")
    calibration.add_argument("--admit", type=_admission, action=_Admissions, default={}, metavar="TIER=FAMILY[,FAMILY]",
                             help="count TIER wrong outside these task families (repeatable): a tier checked on some kinds of "
                                  "work only, such as a distilled adapter on those `appliance distill evaluate` measured")
    calibration.add_argument("--min-samples", type=int, default=4, help="questions a bucket needs before its tier is used")
    calibration.add_argument("--out", type=Path, required=True, help="the calibration file to write")
    calibration.add_argument("--extend", type=Path, metavar="CALIBRATION",
                             help="label the run's questions with the other tiers of --route from this earlier calibration's table "
                                  "(matched by text): a tier added to a route is measured without asking the others again")
    calibration.add_argument("--route", default="auto", help="with --extend: the route whose tiers, in its order, the calibration has")
    calibration.add_argument("--config", type=Path)
    calibration.set_defaults(func=cmd_eval_calibrate)
    simulate = evaluation.add_parser("simulate", help="a stored run routed again offline from every tier's answers (no model call)")
    simulate.add_argument("--run", type=int, required=True, help="a run measured on every tier (--tiers-only), e.g. on a development split")
    simulate.add_argument("--calibration", type=Path, help="a calibration file to route with too")
    simulate.add_argument("--keep", type=_fraction, action="append", default=[], help="other thresholds to try the calibration at (repeat)")
    simulate.add_argument("--json", action="store_true")
    simulate.add_argument("--config", type=Path)
    simulate.set_defaults(func=cmd_eval_simulate)
    exported = evaluation.add_parser("export", help="a stored run to a JSON Lines file (bench/runs/...), to import elsewhere")
    exported.add_argument("--run", type=int, required=True)
    exported.add_argument("--out", type=Path, required=True)
    exported.add_argument("--config", type=Path)
    exported.set_defaults(func=cmd_eval_export)
    imported = evaluation.add_parser("import", help="an exported run as a new run of this data directory")
    imported.add_argument("file", type=Path)
    imported.add_argument("--config", type=Path)
    imported.set_defaults(func=cmd_eval_import)
