"""The layers together, measured against quality: a workload split (bench/workload/) replayed in
time order through the whole appliance (semantic cache on, `model: "auto"`), through the route
alone (cache off), and through each tier alone (the last is "always frontier"), in one run on one
server. Prints accuracy per family, cost, latency p50/p95, where each request was answered, the
ratios to always-frontier, the cache's figures on the workload's rewordings and traps, and the
router's on its adversarial prompts.

    .venv/bin/python -m bench.economics --split development [--check] [--json OUT]

The fleet is bench/fleets/fleet.toml's three real tiers (fetch the Qwen files first: ../shared/MODELS.md),
served in keys mode with one key per tenant, so each tenant's cache is its own. Callers verify
answers as a team's validators would: the whole-appliance pass marks each model answer good or bad
through POST /v1/cache/feedback after checking it, and the cache serves verified answers only.
With --check the exit status is 1 when a target is missed; the last line states the figures.

A whole split takes hours on a small CPU box. With --workdir DIR the run keeps its server's data
(keys, ledger, the semantic cache) and every request's outcome there as it comes, so the same command
run again goes on where it stopped, each pass from its first unanswered request; the report counts
every outcome kept, and the ledger's charges of each stretch of a pass. Its state.json and
outcomes.jsonl alone carry a run to another machine: there the server starts on fresh data, so the
tenants get new keys, and a cache pass not finished starts over (the cache it had built is gone).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import apsw
import httpx
import tomlkit

from appliance.evaluation.runner import load_checker  # noqa: E402
from appliance.config.settings import split_tier  # noqa: E402
from policy.budgets import Price  # noqa: E402
from bench.economics_report import (
    Outcome, PairFigures, PassFigures, Targets, cache_figures, figures, manipulated, random_line, targets,
)
from bench.kit.fleet import fleet_document, fleet_prices
from bench.kit.paths import CHECKER, FLEETS, SPLITS
from bench.kit.server import cli, start, write_config


def load_check() -> Callable[[dict[str, Any], str], bool]:
    """The workload's checker (bench/workload/check.py), loaded as `appliance eval router` loads it."""
    return load_checker(CHECKER)


def load_split(name: str) -> tuple[list[dict[str, Any]], str]:
    path = SPLITS / f"{name}.jsonl"
    data = path.read_bytes()
    records = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["order"]), hashlib.sha256(data).hexdigest()


def fleet_config(fleet: Path, route: str, calibration: Path | None) -> tuple[str, list[str], dict[str, Price]]:
    """bench/fleets/fleet.toml in keys mode with the cache on (verified answers only) and budgets kept, so
    the ledger says what every pass cost. Returns the text, the route's tiers and the prices."""
    doc = fleet_document(fleet)
    doc.pop("server", None)
    doc["auth"] = {"mode": "keys"}
    doc["cache"] = {"enabled": True, "serve_unverified": False, "sweep_interval_s": 0}
    doc["tracing"] = {"store": False}
    tiers: list[str] = []
    for r in doc.get("routes", []):
        # The bench measures answers, not this box's speed: a slow or busy CPU must not turn into
        # escalations by timeout.
        r["attempt_timeout_s"] = 900
        if r["alias"] == route:
            tiers = [str(t) for t in r["tiers"]]
            if calibration is not None:
                r["calibration"] = str(calibration.resolve())
    if not tiers:
        raise SystemExit(f"error: {fleet}: no [[routes]] alias {route!r}")
    return tomlkit.dumps(doc), tiers, fleet_prices(doc)


def read_outcomes(path: Path) -> dict[str, dict[str, Outcome]]:
    """outcomes.jsonl: each pass's outcomes by request id."""
    found: dict[str, dict[str, Outcome]] = {}
    for line in path.read_text().splitlines():
        if line.strip():  # a line cut by a kill is not an outcome
            try:
                row = json.loads(line)
            except ValueError:
                continue
            name = row.pop("pass")
            found.setdefault(name, {})[row["id"]] = Outcome(**row)
    return found


class Kept:
    """A run's state in its work folder: the split's identity, the tenants' keys, each pass's
    outcomes (outcomes.jsonl, a line per request as it is answered) and what the ledger charged
    each pass (state.json). A run started again on the folder goes on from there."""

    def __init__(self, folder: Path, identity: dict[str, Any]) -> None:
        self.folder, self.lock = folder, threading.Lock()
        self.state_file, self.outcome_file = folder / "state.json", folder / "outcomes.jsonl"
        self.state: dict[str, Any] = {"identity": identity, "keys": {}, "charged": {}}
        self.found: dict[str, dict[str, Outcome]] = {}
        if self.state_file.exists():
            self.state = json.loads(self.state_file.read_text())
            if self.state["identity"] != identity:
                differs = sorted(k for k in identity if self.state["identity"].get(k) != identity[k])
                raise SystemExit(f"error: {folder}: a run of another split, fleet or route is kept there (differs: {', '.join(differs)}); "
                                 "use another --workdir")
        if self.outcome_file.exists():
            self.found = read_outcomes(self.outcome_file)

    def keys(self) -> dict[str, str]:
        return dict(self.state["keys"])

    def save_keys(self, keys: dict[str, str]) -> None:
        self.state["keys"] = keys
        self._save()

    def outcomes(self, name: str) -> dict[str, Outcome]:
        with self.lock:
            return dict(self.found.get(name, {}))

    def add(self, name: str, outcome: Outcome) -> None:
        with self.lock:
            self.found.setdefault(name, {})[outcome.id] = outcome
            with open(self.outcome_file, "a") as out:
                out.write(json.dumps({"pass": name, **outcome.__dict__}) + "\n")

    def forget_server(self, unfinished: set[str]) -> None:
        """The server's data is gone (another machine): its keys are void, and the passes in
        `unfinished` lose what they kept, since they depended on it."""
        with self.lock:
            self.state["keys"] = {}
            for name in unfinished:
                self.found.pop(name, None)
                self.state["charged"].pop(name, None)
            rows = [{"pass": name, **o.__dict__} for name, found in self.found.items() for o in found.values()]
            temporary = self.outcome_file.with_suffix(".tmp")
            temporary.write_text("".join(json.dumps(row) + "\n" for row in rows))
            temporary.replace(self.outcome_file)
            self._save()

    def take(self, name: str, outcomes: list[Outcome], charged: int) -> None:
        """A pass measured by another run of the same split and model (`--reuse`), kept as if run here."""
        with self.lock:
            self.found[name] = {o.id: o for o in outcomes}
            with open(self.outcome_file, "a") as out:
                out.writelines(json.dumps({"pass": name, **o.__dict__}) + "\n" for o in outcomes)
            self.state["charged"][name] = charged
            self.state.setdefault("reused", {})[name] = True
            self._save()

    def charge(self, name: str, nanos: int) -> None:
        self.state["charged"][name] = self.state["charged"].get(name, 0) + nanos
        self._save()

    def charged(self, name: str) -> int:
        return int(self.state["charged"].get(name, 0))

    def _save(self) -> None:
        temporary = self.state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.state, indent=1))
        temporary.replace(self.state_file)


def model_table(config: str, alias: str) -> dict[str, Any] | None:
    """What decides a model's answers alone: its table without the adapters (a request for the base
    model uses none of them)."""
    for model in tomlkit.parse(config).get("models", []):
        if model["alias"] == alias:
            return {k: v for k, v in model.unwrap().items() if k != "adapters"}
    return None


def reuse(kept: Kept, earlier: Path, identity: dict[str, Any], tiers: list[str], records: list[dict[str, Any]]) -> None:
    """Each tier alone from an earlier run's kept folder (bench/runs/...), where that run asked the same
    split of the same model, whole: asking it again would give the same answers (greedy, the same
    weights and settings) and take hours here."""
    state = json.loads((earlier / "state.json").read_text())
    if (state["identity"]["split"], state["identity"]["sha256"]) != (identity["split"], identity["sha256"]):
        raise SystemExit(f"error: --reuse {earlier}: a run of another split")
    theirs = read_outcomes(earlier / "outcomes.jsonl")
    for tier in tiers:
        found = theirs.get(tier, {})
        if kept.outcomes(tier):
            continue
        if model_table(state["identity"]["config"], tier) != model_table(identity["config"], tier) or model_table(identity["config"], tier) is None:
            print(f"--reuse: {tier} alone is asked here (the earlier run's model settings differ or it had no such model)", file=sys.stderr)
            continue
        if any(r["id"] not in found for r in records):
            print(f"--reuse: {tier} alone is asked here (the earlier run did not answer every request)", file=sys.stderr)
            continue
        kept.take(tier, [found[r["id"]] for r in records], int(state["charged"][tier]))
        print(f"--reuse: {tier} alone taken from {earlier} ({len(records)} requests, the same split and model settings)", file=sys.stderr)


class Replayer:
    """Sends a split's requests one after another, each with its tenant's key, and checks them."""

    def __init__(self, base: str, database: Path, keys: dict[str, str], tiers: list[str], prices: dict[str, Price],
                 check: Callable[[dict[str, Any], str], bool]) -> None:
        self.http = httpx.Client(base_url=base, timeout=900)
        self.database, self.keys, self.tiers, self.prices, self.check = database, keys, tiers, prices, check

    def spent(self) -> int:
        """Nano-dollars the ledger has charged in all, once every reservation has settled."""
        db = apsw.Connection(str(self.database), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            deadline = time.monotonic() + 60
            while db.execute("SELECT count(*) FROM reservations").fetchone()[0] and time.monotonic() < deadline:
                time.sleep(0.1)
            return int(db.execute("SELECT coalesce(sum(charged_nanos), 0) FROM settlements").fetchone()[0])
        finally:
            db.close()

    def run(self, name: str, model: str, records: list[dict[str, Any]], cached: bool, progress: bool, kept: "Kept",
            concurrency: int = 1) -> tuple[PassFigures, list[Outcome]]:
        """A pass over the split, each request's outcome kept as it comes; requests the pass already
        answered in an earlier stretch (`kept`) are not sent again. With the cache on, one request at a
        time in the split's order (a later request may be served what an earlier one stored); without
        it, order cannot matter, and `concurrency` requests share the model's slots."""
        done = kept.outcomes(name)
        todo = [r for r in records if r["id"] not in done]
        before = self.spent()

        def one(record: dict[str, Any]) -> Outcome:
            outcome = self.one(record, model, cached)
            kept.add(name, outcome)
            return outcome

        earlier = len(records) - len(todo)
        try:
            if cached or concurrency <= 1:
                for i, r in enumerate(todo):
                    self._progress(name, earlier + i, len(records), progress)
                    one(r)
            else:
                with ThreadPoolExecutor(concurrency) as pool:
                    for i, done_one in enumerate(as_completed([pool.submit(one, r) for r in todo])):
                        done_one.result()
                        self._progress(name, earlier + i + 1, len(records), progress)
        finally:  # a stretch that ends in an error still keeps what the ledger charged for it
            if todo:
                kept.charge(name, self.spent() - before)
        done = kept.outcomes(name)
        outcomes = [done[r["id"]] for r in records]
        return figures(name, outcomes, kept.charged(name)), outcomes

    @staticmethod
    def _progress(name: str, answered: int, total: int, show: bool) -> None:
        """Every tenth request answered (counted as they finish: a pool takes its whole list at once)."""
        if show and answered % 10 == 0:
            print(f"  {name}: {answered}/{total}", file=sys.stderr, flush=True)

    def one(self, record: dict[str, Any], model: str, cached: bool) -> Outcome:
        key = self.keys[record["tenant"]]
        headers = {"Authorization": f"Bearer {key}"}
        if not cached:
            headers["Cache-Control"] = "no-cache, no-store"
        # The family in metadata: where the tenant opted in to distillation, its answers are kept under it (`distill export --family`).
        body: dict[str, Any] = {"model": model, "messages": record["messages"], "max_tokens": record["max_tokens"], "temperature": 0,
                                "metadata": {"family": record["family"]}}
        if record.get("response_format"):
            body["response_format"] = record["response_format"]
        started = time.perf_counter()
        response = self.http.post("/v1/chat/completions", json=body, headers=headers)
        latency = time.perf_counter() - started
        adversarial = (record.get("adversarial") or {}).get("base")
        if response.status_code != 200:
            return Outcome(record["id"], record["family"], record["cache"], False, 0, latency, "error", None, adversarial)
        data = response.json()
        text = data["choices"][0]["message"]["content"] or ""
        correct = bool(self.check(record, text))
        h = response.headers
        if h.get("x-cache") == "hit":
            where, cost = "cache", 0
        elif h.get("x-route-default"):
            where, cost = "default", int(h.get("x-route-cost-nanousd", 0))
        else:
            where = h.get("x-route-model") or data["model"]
            usage = data["usage"]
            routed = h.get("x-route-cost-nanousd")
            price = self.prices[split_tier(where)[0]]  # an adapter costs its base's
            cost = int(routed) if routed is not None else price.cost(usage["prompt_tokens"], usage["completion_tokens"])
            if cached:  # the caller's validator: the cache serves only answers marked good
                self.http.post("/v1/cache/feedback", json={"response_id": data["id"], "rating": "good" if correct else "bad"}, headers=headers)
        chosen = None
        if h.get("x-route-attempts"):
            # The route's own choice is its first attempt on one of its tiers; a family tier that answered
            # before any (`family_tiers`) counts as below them all: -1.
            attempts = json.loads(h["x-route-attempts"])
            models = [a["model"] for a in attempts]
            chosen = next((self.tiers.index(m) for m in models if m in self.tiers), -1 if models else None)
            if attempts[-1]["outcome"] == "program: ok":  # `program_families`: the tier's program answered
                where += " program"
        return Outcome(record["id"], record["family"], record["cache"], correct, cost, latency, where, chosen, adversarial)


def held_out_pairs() -> PairFigures:
    """The cache's defaults on the held-out question pairs, where the issue judges the cache (seconds: embeddings only)."""
    from bench import cache_quality

    pairs, served = cache_quality.served_by_defaults(cache_quality.HELDOUT)
    return PairFigures(cache_quality.HELDOUT.name, sum(not p.hit for p in pairs), sum(s for p, s in zip(pairs, served) if not p.hit),
                       sum(p.hit for p in pairs), sum(s for p, s in zip(pairs, served) if p.hit))


def print_report(passes: list[PassFigures], frontier: PassFigures, cheapest: PassFigures, result: Targets,
                 whole_outcomes: list[Outcome], routed_outcomes: list[Outcome], group_of: dict[str, str]) -> None:
    print(f"\n{'pass':<22}{'accuracy':>9}{'cost $':>12}{'vs frontier':>13}{'vs random':>11}{'p50 s':>8}{'p95 s':>8}  answered by")
    for p in passes:
        ratio = p.cost_nanos / frontier.cost_nanos if frontier.cost_nanos else 0.0
        line = (p.accuracy - random_line(cheapest, frontier, p.cost_nanos)) * 100
        shares = ", ".join(f"{k} {v}" for k, v in p.answered_by)
        print(f"{p.name:<22}{p.accuracy:>9.1%}{p.cost_nanos / 1e9:>12.6f}{ratio:>12.1%} {line:>+10.1f}{p.p50_s:>8.2f}{p.p95_s:>8.2f}  {shares}")
    families = sorted({f for p in passes for f, _, _ in p.by_family})
    print(f"\n{'accuracy by family':<22}" + "".join(f"{f[:11]:>12}" for f in families))
    for p in passes:
        row = dict((f, a) for f, a, _ in p.by_family)
        print(f"{p.name:<22}" + "".join(f"{row.get(f, 0.0):>12.1%}" for f in families))
    counts = dict((f, n) for f, _, n in passes[0].by_family)
    print(f"{'requests':<22}" + "".join(f"{counts.get(f, 0):>12}" for f in families))
    cache = cache_figures(whole_outcomes, group_of)
    print(f"\ncache, this split: {cache.rewordings_served}/{cache.rewordings} repeats and rewordings served ({cache.servable_served}/"
          f"{cache.servable} of those with a verified answer to serve), {cache.traps_served}/{cache.traps} traps served")
    pairs = result.cache
    print(f"cache, held-out pairs ({pairs.name}): {pairs.rewordings_served}/{pairs.rewordings} rewordings served, "
          f"{pairs.traps_served}/{pairs.traps} traps served")
    for request_id, tier, base in manipulated(routed_outcomes):
        print(f"manipulated: {request_id} chose tier {tier}, its plain question tier {base}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", required=True, help="calibration, development or evaluation")
    parser.add_argument("--fleet", type=Path, default=FLEETS / "fleet.toml")
    parser.add_argument("--route", default="auto")
    parser.add_argument("--calibration", type=Path, help="a route calibration file to load (appliance eval calibrate)")
    parser.add_argument("--limit", type=int, help="the first N requests of the split only (a smoke run; no target is judged)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--json", type=Path, help="write every pass's per-request outcomes here")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests at once in the cache-off passes (their latency then includes waiting for a slot)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the server's data and every outcome here; the same command again goes on where it stopped")
    parser.add_argument("--reuse", type=Path, metavar="DIR",
                        help="take each tier-alone pass from an earlier run's kept folder (bench/runs/...) where it asked the same split "
                             "of a model with the same settings")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    records, digest = load_split(args.split)
    if args.limit:
        records = records[: args.limit]
    print(f"split {args.split}: {len(records)} requests, sha256 {digest}")
    config, tiers, prices = fleet_config(args.fleet, args.route, args.calibration)
    check = load_check()
    with tempfile.TemporaryDirectory(prefix="economics-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        identity = {"split": args.split, "sha256": digest, "route": args.route, "config": config}
        kept = Kept(workdir, identity)
        if args.reuse is not None:
            reuse(kept, args.reuse, identity, tiers, records)
        if not (workdir / "home" / "appliance.db").exists() and kept.keys():
            whole = kept.outcomes("whole")
            unfinished = {"whole"} if whole and len(whole) < len(records) else set()
            print(f"{workdir}: no server data beside the kept outcomes; new keys"
                  + (", and the cache pass starts over" if unfinished else ""), file=sys.stderr)
            kept.forget_server(unfinished)
        write_config(workdir, config)
        server = start(workdir)
        try:
            keys = kept.keys()
            for t in sorted({r["tenant"] for r in records} - set(keys)):
                keys[t] = cli(workdir, "keys", "create", "--tenant", t, "--app", "bench", "--user", f"{t}-user", "--role", "member").strip().splitlines()[-1]
            kept.save_keys(keys)
            replay = Replayer(server.base, workdir / "home" / "appliance.db", keys, tiers, prices, check)
            show = not args.quiet
            whole, whole_out = replay.run("whole", args.route, records, True, show, kept)
            routed, routed_out = replay.run("routed", args.route, records, False, show, kept, args.concurrency)
            alone = [replay.run(t, t, records, False, show, kept, args.concurrency) for t in tiers]
        finally:
            server.stop()
    whole, routed = dataclasses.replace(whole, name="appliance (cache+route)"), dataclasses.replace(routed, name="route alone")
    alone = [(dataclasses.replace(a[0], name=f"{t} alone"), a[1]) for t, a in zip(tiers, alone)]
    cheapest, frontier = alone[0][0], alone[-1][0]
    result = targets(whole, routed, cheapest, frontier, held_out_pairs(), routed_out)
    group_of = {r["id"]: r["group"] for r in records if r.get("group")}
    print_report([whole, routed, *(a[0] for a in alone)], frontier, cheapest, result, whole_out, routed_out, group_of)
    if args.json:
        outcomes = {"whole": whole_out, "routed": routed_out, **{t: a[1] for t, a in zip(tiers, alone)}}
        args.json.write_text(json.dumps({"split": args.split, "sha256": digest,
                                         "passes": {k: [o.__dict__ for o in v] for k, v in outcomes.items()}}, indent=1))
    misses = result.misses()
    for miss in misses:
        print(f"missed: {miss}")
    print(result.line())
    return 1 if args.check and misses and not args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
