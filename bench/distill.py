"""Distillation end to end, measured: the appliance teaches its cheapest tier from its own verified
answers on two task families of the economics workload, and the adapter is checked on examples no
training saw.

    .venv/bin/python -m bench.distill --workdir ~/.cache/appliance/distill-bench [--check]

The steps, each through the appliance's own CLI and HTTP API, each kept in the work folder so the
same command run again goes on where it stopped:
1. teach: training traffic (bench/workload/distill_traffic.py: written independently of the
   workload's items) is asked of the teacher through a server whose tenant opted in
   (`[distill] tenants`); the caller checks each answer (bench/workload/check.py) and says so through
   POST /v1/cache/feedback, as a team's validators would.
2. export: `appliance distill export` per family (verified, opted-in, personal-data-free, deduplicated,
   with a held-out part).
3. train: `appliance distill train` on both families' training parts: one adapter for the student.
4. evaluate: `appliance distill evaluate` per family, on the export's held-out part and on the
   economics workload's evaluation split of that family: the student alone, with the adapter, the teacher.

With --check the exit status is 1 unless, on every family, the adapter reaches 90% of the teacher's
accuracy from no more than 1,000 verified examples; the last line states the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import tomlkit

from appliance.evaluation.runner import load_checker  # noqa: E402
from bench.kit.paths import CHECKER, FLEETS, ROOT, SPLITS
from bench.kit.server import start, write_config
from bench.workload.distill_traffic import records as traffic

FAMILIES = ("classification", "extraction", "gsm8k")
DEFAULT_FAMILIES = ("classification", "extraction")
# Families the teacher answers with programs (policy/programs.py) through the route: the kept example
# is the program request and the program, which is what the student is asked when it writes them.
PROGRAM_FAMILIES = ("gsm8k",)
EVALUATION = SPLITS / "evaluation.jsonl"
MAX_EXAMPLES = 1000
TARGET = 0.9


def load_check() -> Any:
    """The workload's checker (bench/workload/check.py), loaded as `appliance eval router` loads it."""
    return load_checker(CHECKER)


def bench_config(fleet: Path, student: str, teacher: str) -> str:
    """The fleet's student and teacher, open mode with admin (training registers the adapter and asks
    the server to reload), the open tenant opted in, no cache or budgets: the bench measures models."""
    doc = tomlkit.parse(fleet.read_text())
    doc.pop("server", None)
    doc["auth"] = {"mode": "open", "open_principal": {"tenant": "distill-bench", "admin": True}}
    doc["cache"] = {"enabled": False}
    doc["budgets"] = {"enabled": False}
    doc["tracing"] = {"store": False}
    doc["distill"] = {"tenants": ["distill-bench"]}
    models = tomlkit.aot()
    for model in doc["models"]:
        if model["alias"] in (student, teacher):
            if "path" in model:
                model["path"] = str(Path(str(model["path"])).expanduser())
            # The fleet pins the invariant layout for the economics runs' reproducibility; this bench
            # needs the default (faster) one.
            model.pop("batch_invariant", None)
            model.pop("kv_cache_type", None)
            models.append(model)
    doc["models"] = models
    doc["routes"] = tomlkit.aot()
    doc["routes"].append({"alias": "auto", "tiers": [student, teacher], "attempt_timeout_s": 900,
                          "program_families": list(PROGRAM_FAMILIES), "family_tiers": dict.fromkeys(PROGRAM_FAMILIES, teacher)})
    return tomlkit.dumps(doc)


def appliance(workdir: Path, url: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APPLIANCE_HOME": str(workdir / "home")}
    more = ["--url", url] if url else []
    command = [sys.executable, "-m", "appliance.cli.main", *args, "--config", str(workdir / "models.toml"), *more]
    print("$ appliance " + " ".join(args), flush=True)
    return subprocess.run(command, env=env, cwd=ROOT, text=True, capture_output=True)


class Log:
    """One JSON line per finished step or request, so a run goes on where it stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        self.lock = threading.Lock()  # the teach step's threads add rows together

    def done(self, kind: str) -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in self.rows if r["kind"] == kind}

    def add(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows.append(row)
            with self.path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")


def digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([record["messages"], record["response_format"]], sort_keys=True).encode()).hexdigest()[:16]


def teach(base: str, log: Log, requests: list[dict[str, Any]], teacher: str, check: Any, concurrency: int) -> None:
    done = log.done("teach")
    # A request whose text changed since it was asked (the traffic generator changed) is asked again;
    # rows from before digests were logged count as asked.
    left = [r for r in requests if r["id"] not in done or done[r["id"]].get("digest", digest(r)) != digest(r)]
    print(f"teach: {len(done)} of {len(requests)} asked before; {len(left)} to go", flush=True)
    answered = 0
    lock = threading.Lock()
    with httpx.Client(base_url=base, timeout=900) as client:
        started = time.monotonic()

        def ask(record: dict[str, Any]) -> None:
            nonlocal answered
            # A program family through the route, whose family tier (the teacher) writes the program.
            model = "auto" if record["family"] in PROGRAM_FAMILIES else teacher
            body = {"model": model, "messages": record["messages"], "max_tokens": record["max_tokens"] or 256, "temperature": 0,
                    "metadata": {"family": record["family"]}}
            if record["response_format"]:
                body["response_format"] = record["response_format"]
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            data = response.json()
            text = data["choices"][0]["message"]["content"] or ""
            good = bool(check(record, text))
            client.post("/v1/cache/feedback", json={"response_id": data["id"], "rating": "good" if good else "bad"}).raise_for_status()
            log.add({"kind": "teach", "id": record["id"], "family": record["family"], "good": good, "digest": digest(record)})
            with lock:
                answered += 1
                if answered % 10 == 0 or answered == len(left):
                    rate = answered / (time.monotonic() - started)
                    print(f"teach: {len(done) + answered}/{len(requests)} ({rate * 60:.1f}/min)", flush=True)

        # The teacher's slots decode requests together, as a team's traffic would arrive.
        with ThreadPoolExecutor(concurrency) as pool:
            for future in [pool.submit(ask, record) for record in left]:
                future.result()


def per_family(values: list[str]) -> dict[str, int]:
    """`--examples 300 --examples extraction=800`: a bare number for every family, `family=N` for one."""
    counts = dict.fromkeys(FAMILIES, 300)
    for value in values:
        family, _, n = value.rpartition("=")
        if family and family not in FAMILIES:
            raise SystemExit(f"error: --examples {value}: the family must be one of {', '.join(FAMILIES)}")
        if not n.isdigit() or int(n) < 1:
            raise SystemExit(f"error: --examples {value}: expected a positive number of requests")
        counts.update({family: int(n)} if family else dict.fromkeys(FAMILIES, int(n)))
    return counts


def must(done: subprocess.CompletedProcess[str]) -> str:
    if done.returncode not in (0, 3):  # 3: evaluate refused to promote, a result too
        raise SystemExit(f"error: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="keeps every step; the same command again goes on where it stopped")
    parser.add_argument("--fleet", type=Path, default=FLEETS / "fleet.toml")
    parser.add_argument("--student", default="smollm2-135m")
    parser.add_argument("--teacher", default="qwen-1.5b")
    parser.add_argument("--examples", action="append", default=[], metavar="[FAMILY=]N",
                        help="training requests per family (default 300); FAMILY=N for one family, repeatable")
    parser.add_argument("--concurrency", type=int, default=2, help="teacher requests at once (default 2, the fleet's slots)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", default="2")
    parser.add_argument("--family", action="append", choices=FAMILIES,
                        help="teach, train and evaluate this family only (repeatable; default classification and extraction): "
                             "one adapter per family. gsm8k is taught as programs and measured by bench/word_problem_programs.py")
    parser.add_argument("--until", choices=("teach", "export", "train", "evaluate"), default="evaluate", help="stop after this step")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    workdir = args.workdir.expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "models.toml").exists():  # once: training adds the adapter to it
        write_config(workdir, bench_config(args.fleet, args.student, args.teacher))
    log = Log(workdir / "steps.jsonl")
    examples = per_family(args.examples)
    trained = [f for f in FAMILIES if f in (args.family or DEFAULT_FAMILIES)]
    requests = [r for family in trained for r in traffic(family, examples[family], args.seed)]
    requests.sort(key=lambda r: (int(r["id"].rsplit("-", 1)[1]), r["family"]))  # the families interleaved, as traffic comes
    server = start(workdir)
    base = server.base
    try:
        teach(base, log, requests, args.teacher, load_check(), args.concurrency)
        if args.until == "teach":
            return 0
        good = {f: sum(1 for r in log.done("teach").values() if r["family"] == f and r["good"]) for f in trained}
        print(f"verified teacher answers: {good}")
        data = {f: workdir / f"data-{f}" for f in trained}
        if "export" not in log.done("step"):
            for f in trained:
                print(must(appliance(workdir, None, "distill", "export", "--route", "auto", "--family", f, "--since", "365d", "--out", str(data[f]))))
            log.add({"kind": "step", "id": "export"})
        if args.until == "export":
            return 0
        adapter = "distilled"
        if "train" not in log.done("step"):
            both = workdir / "train.jsonl"  # one adapter for the families trained: one distilled tier
            both.write_text("".join((data[f] / "train.jsonl").read_text() for f in trained))
            started = time.monotonic()
            print(must(appliance(workdir, base, "distill", "train", "--student", args.student, "--data", str(both), "--out", adapter,
                                 "--epochs", args.epochs)))
            log.add({"kind": "step", "id": "train", "seconds": time.monotonic() - started,
                     "examples": sum(1 for _ in both.open())})
        if args.until == "train":
            return 0
        results: dict[str, dict[str, Any]] = {}
        folder = workdir / "home" / "adapters" / args.student / adapter
        for f in trained:
            if f in PROGRAM_FAMILIES:  # `distill evaluate` asks the workload's requests as written, not for programs
                print(f"{f}: measure the adapter's programs with python -m bench.word_problem_programs --tier {args.student}:{adapter}")
                continue
            if f not in log.done("evaluate"):
                print(must(appliance(workdir, base, "distill", "evaluate", "--student", args.student, "--adapter", adapter, "--data", str(data[f]),
                                     "--workload", str(EVALUATION), "--family", f, "--teacher", args.teacher)))
                stored = json.loads((folder / "adapter.gguf.evaluation.json").read_text())
                log.add({"kind": "evaluate", "id": f, "result": stored})
            results[f] = log.done("evaluate")[f]["result"]
    finally:
        server.stop()
    return report(results, log, args.check) if results else 0


def report(results: dict[str, dict[str, Any]], log: Log, check: bool) -> int:
    trained = log.done("step")["train"]
    print(f"\ntrained on {trained['examples']} verified examples in {trained['seconds'] / 60:.1f} min")
    header = f"{'family':16} {'part':9} {'student':>9} {'adapter':>9} {'teacher':>9} {'adapter/teacher':>16}"
    print(header)
    ratios = {}
    for family, result in results.items():
        for part in ("held_out", "workload", "total"):
            s = {role: result["scores"][role][part] for role in ("student", "adapter", "teacher")}
            acc = {role: v["right"] / v["asked"] if v["asked"] else 0.0 for role, v in s.items()}
            ratio = acc["adapter"] / acc["teacher"] if acc["teacher"] else 0.0
            if part == "total":
                ratios[family] = ratio
            print(f"{family:16} {part:9} {acc['student']:9.1%} {acc['adapter']:9.1%} {acc['teacher']:9.1%} {ratio:16.1%}")
    met = trained["examples"] <= MAX_EXAMPLES and all(r >= TARGET for r in ratios.values())
    print(f"distill: adapter/teacher {', '.join(f'{f} {r:.1%}' for f, r in ratios.items())}; {trained['examples']} examples; "
          f"target {TARGET:.0%} from <= {MAX_EXAMPLES}: {'met' if met else 'missed'}")
    return 1 if check and not met else 0


if __name__ == "__main__":
    raise SystemExit(main())
