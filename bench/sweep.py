#!/usr/bin/env python3
"""The whole range of prompts and clients: ours against llama.cpp's own llama-server, in one run.

Two ways to size the servers:

- `--shipped` (what a user compares): ours runs the bundled model's [[models]] table from the shipped
  models.toml as it is (`--extra` keys override it), and llama-server runs as a user starts it for
  that many slots, `-np SLOTS -c SLOTS*PER_SLOT` with its own default KV layout (a stream per slot),
  PER_SLOT 2,048 tokens or room for the prompt and answer if more.
- otherwise both servers are sized alike (slots = the most clients, each able to hold the prompt and
  the answer), one KV stream per slot in both, or with --pool one shared pool of that many cells.

Several servers of each side may run (`--ours NAME=BIN`, `--llama-server NAME=BIN`: ours on two
llama.cpp builds, llama-server from two releases). All are up at once and take turns cell by cell,
the order rotating between repeats; each client sends `--rounds` streamed requests whose prompts are
new text of about that length (no prefix cache can serve them), the same prompts to every server in a
repeat. Cache off everywhere.

Reported per cell, as the median over repeats with the spread (min-max), and each server / the first
llama-server: aggregate completion tok/s, TTFT p50, and with one client prefill tok/s (prompt tokens
/ TTFT). After the run: each server's peak resident memory (VmHWM) per prompt length.

    .venv/bin/python -m bench.sweep --shipped --lengths 20,1024,3800 --clients 1,8,32 --max-tokens 128 \\
        --llama-server b11311=PATH --llama-server b11434=PATH
    .venv/bin/python -m bench.sweep --lengths 20 --clients 8,32 --max-tokens 128
    .venv/bin/python -m bench.sweep --lengths 1024 --clients 8 --pool 8192   # ours: kv_tokens = 8192

`--max-prompt-tokens` skips cells whose prompts (clients x rounds x length) exceed it: on 2 cores
prefill runs at about 130 tok/s, so 32 clients x 8k tokens is over half an hour per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kit.load import run_load
from bench.kit.machine import code_state, log, machine
from bench.kit.peers import ALIAS, PACKAGE_FILE, VENV_BIN, build_llama_server, cache_root, model_file
from bench.kit.server import Server, free_port
from bench.kit.stats import median, spread

ROOT = Path(__file__).resolve().parents[1]
PER_SLOT = 2048  # llama-server's context per slot in `-np 8 -c 16384`, as the user started it


def shipped_table(extra: str) -> str:
    """The bundled model's [[models]] table from the shipped models.toml, `extra` keys over it."""
    models = tomllib.loads((ROOT / "models.toml").read_text())["models"]
    table = dict(next(m for m in models if m.get("package_file") == PACKAGE_FILE))
    table.update(tomllib.loads(extra) if extra else {})
    table.update(alias=ALIAS)
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())


def named(values: list[str], default: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        out.append((name, Path(path)) if sep else (Path(v).parent.parent.parent.name or "llama-server", Path(v)))
    return out or default


def ours_shipped(name: str, binary: Path, tmp: Path, logs: Path, table: str, tag: str = "") -> Server:
    """Ours with this [[models]] table; `tag` tells its files apart from another run's (a context)."""
    port = free_port()
    home = tmp / f"home-{name}"
    home.mkdir(exist_ok=True)
    config = tmp / f"{name}{tag}.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1"\nport = {port}\nmax_queue = 256\n\n[auth]\nmode = "open"\n\n'
                      f'[cache]\nenabled = false\n\n[[models]]\n{table}')
    return Server(name, [str(binary), "serve", "--config", str(config), "--port", str(port)],
                  port, "/health", ALIAS, env={"APPLIANCE_HOME": str(home)}, log_path=logs / f"{name}{tag}.log")


def peer_as_started(name: str, binary: Path, logs: Path, model: Path, slots: int, per_slot: int, threads: int) -> Server:
    port = free_port()
    return Server(name, [str(binary), "-m", str(model), "-a", ALIAS, "-np", str(slots), "-c", str(slots * per_slot),
                         "-t", str(threads), "-ngl", "0", "--host", "127.0.0.1", "--port", str(port)],
                  port, "/health", ALIAS, log_path=logs / f"{name}.log")


def ours(name: str, binary: Path, tmp: Path, logs: Path, model: Path | None, slots: int, context: int, threads: int, pool: int,
         extra: str) -> Server:
    source = f'path = "{model}"' if model else f'package_file = "{PACKAGE_FILE}"'
    pool_line = f"kv_tokens = {pool}\n" if pool < slots * context else ""
    table = (f'alias = "{ALIAS}"\nengine = "llamacpp"\n{source}\ncontext_length = {context}\nslots = {slots}\n'
             f"threads = {threads}\n{pool_line}{extra}\n")
    return ours_shipped(name, binary, tmp, logs, table, tag=f"-{context}")


def peer(name: str, binary: Path, logs: Path, model: Path, slots: int, context: int, threads: int, pool: int) -> Server:
    port = free_port()
    # llama-server's own choice with a fixed slot count is one stream per slot; a pool needs -kvu
    unified = ["-kvu"] if pool < slots * context else []
    return Server(name, [str(binary), "-m", str(model), "-a", ALIAS, "-np", str(slots), "-c", str(pool), *unified,
                         "-t", str(threads), "-ngl", "0", "--host", "127.0.0.1", "--port", str(port)],
                  port, "/health", ALIAS, log_path=logs / f"{name}-{context}.log")


def cell(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    m = median(values)
    if m is None:
        return "-"
    return f"{m * scale:.{digits}f} ({spread([v * scale for v in values if v is not None], digits)})"


def ratio(a: list[float], b: list[float], pairs: Sequence[tuple[float, float]] = ()) -> str:
    """The medians' ratio, and with two or more repeats the spread of each repeat's own ratio (the
    two servers measured back to back): on a VM whose speed drifts, that spread is the honest one."""
    ma, mb = median(a), median(b)
    if ma is None or not mb:
        return "-"
    each = sorted(x / y for x, y in pairs if y)
    return f"{ma / mb:.2f}" + (f" ({each[0]:.2f}–{each[-1]:.2f})" if len(each) > 1 else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="20,1024,4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--clients", default="1,8,32", help="concurrent clients, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--rounds", type=int, default=1, help="requests each client sends one after another")
    p.add_argument("--repeat", type=int, default=2, help="measurements of each cell per server, order rotating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shipped", action="store_true", help="ours as models.toml ships the bundled model; llama-server as a user starts it")
    p.add_argument("--context", type=int, default=0, help="tokens per slot (0: room for the prompt and the answer)")
    p.add_argument("--pool", type=int, default=0, help="KV cells both servers hold (0: slots x context); ours as kv_tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=70000, help="skip cells sending more prompt tokens than this")
    p.add_argument("--extra", default="", help="TOML keys added to ours' [[models]] table")
    p.add_argument("--model", type=Path, help="a GGUF instead of the bundled model")
    p.add_argument("--ours", action="append", default=[], metavar="NAME=BIN",
                   help="an `appliance` executable to run as ours (repeatable; default: this venv's)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=TOML",
                   help="also ours with these [[models]] keys over --extra's, on the first --ours executable (repeatable)")
    p.add_argument("--llama-server", action="append", default=[], metavar="NAME=BIN",
                   help="a llama-server binary, or NAME=NNNNN for that llama.cpp release built once into the bench cache "
                        "(repeatable; default: the release llama-cpp-python vendors)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sampling = {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p < 1.0 else {})}
    lengths = [int(x) for x in args.lengths.split(",")]
    client_counts = [int(x) for x in args.clients.split(",")]
    model = args.model or model_file()
    our_bins = named(args.ours, [("ours", VENV_BIN / "appliance")])
    # NAME=NNNNN: that llama.cpp release's llama-server, built once into the bench cache
    peer_bins = [(n, build_llama_server(cache_root(), version=f"{b}.0.0") if str(b).isdigit() else b)
                 for n, b in named(args.llama_server, [])] or [("llama-server", build_llama_server(cache_root()))]
    extras = [args.extra] * len(our_bins)  # ours' [[models]] keys, server by server
    for v in args.variant:
        name, _, keys = v.partition("=")
        our_bins.append((name, our_bins[0][1]))
        extras.append("\n".join(x for x in (args.extra, keys.replace(";", "\n")) if x))
    table = shipped_table(args.extra) if args.shipped else ""
    shipped_slots = int(tomllib.loads(table)["slots"]) if args.shipped else 0
    names = [n for n, _ in our_bins] + [n for n, _ in peer_bins]
    results: dict[str, Any] = {}
    rss: dict[str, dict[int, float | None]] = {n: {} for n in names}
    prompt_no = 1000
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp_name:
        tmp = Path(tmp_name)
        logs = tmp / "logs"
        for length in lengths:
            cells = [c for c in client_counts if c * args.rounds * length <= args.max_prompt_tokens]
            if not cells:
                log(f"{length} tokens: every cell is over --max-prompt-tokens; skipped")
                continue
            room = -(-(int(length * 1.4) + args.max_tokens + 64) // 256) * 256
            if args.shipped:
                servers = [ours_shipped(n, b, tmp, logs, shipped_table(extra)) for (n, b), extra in zip(our_bins, extras)]
                servers += [peer_as_started(n, b, logs, model, shipped_slots, max(PER_SLOT, room), args.threads) for n, b in peer_bins]
            else:
                slots = max(cells)
                context = args.context or room
                pool = args.pool or slots * context
                servers = [ours(n, b, tmp, logs, args.model, slots, context, args.threads, pool, extra)
                           for (n, b), extra in zip(our_bins, extras)]
                servers += [peer(n, b, logs, model, slots, context, args.threads, pool) for n, b in peer_bins]
            try:
                for server in servers:
                    server.start()
                    warm = asyncio.run(run_load(server, 1, 1, 8, first_prompt=prompt_no, prompt_tokens=min(length, 256)))
                    prompt_no += 1
                    if warm["failed"]:
                        raise RuntimeError(f"{server.name}: warm-up failed: {warm['errors']}")
                for clients in cells:
                    for rep in range(args.repeat):
                        turn = rep % len(servers)
                        # Every server gets the same new prompts in a repeat: answers of another length would
                        # change the tokens a second (a greedy answer that stops at 60 tokens frees its slot).
                        first = prompt_no
                        prompt_no += clients * args.rounds
                        for server in servers[turn:] + servers[:turn]:
                            run = asyncio.run(run_load(server, clients, args.rounds, args.max_tokens, first_prompt=first,
                                                       prompt_tokens=length, sampling=sampling))
                            if run["failed"]:
                                log(f"{server.name}: failures: {run['errors']}\n{server.log_tail(15)}")
                            got = results.setdefault(f"{length}/{clients}", {}).setdefault(server.name, [])
                            prompt_tokens = (run["prompt_tokens"] or [length])[0]
                            got.append({"tok_s": run["tokens_per_s"], "ttft_p50": run["ttft_p50_s"], "ttft_p95": run["ttft_p95_s"],
                                        "prefill_tok_s": prompt_tokens / run["ttft_p50_s"] if clients == 1 and run["ttft_p50_s"] else None,
                                        "failed": run["failed"], "prompt_tokens": prompt_tokens, "wall_s": run["wall_s"],
                                        "completion_tokens": run["completion_tokens"],
                                        "other_cores": run["other_cores"], "server_cores": run["server_cores"],
                                        "client_cores": run["bench_client_cores"]})
                            log(f"{length} tok x {clients} clients, {server.name}: {run['tokens_per_s'] or 0:.1f} tok/s, TTFT p50 "
                                f"{(run['ttft_p50_s'] or 0) * 1e3:.0f} ms, {run['failed']} failed, prompt {prompt_tokens} tokens, "
                                f"{run['completion_tokens']} tokens out, "
                                f"cores: server {run['server_cores']:.2f}, client {run['bench_client_cores']:.2f}, "
                                f"other processes {run['other_cores']:.2f}")
                            time.sleep(0.5)  # ggml's threads stop spinning before the next server computes
                for server in servers:
                    kib = server.peak_rss_kib()
                    rss[server.name][length] = kib / 1024 if kib is not None else None
            finally:
                for server in servers:
                    server.stop()
    report(results, rss, names, peer_bins[0][0], lengths, args, model)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rss_mib": rss, "code": code_state(), "machine": machine(),
                                         "args": vars(args)}, default=str, indent=2))
    return 0


def report(results: dict[str, Any], rss: dict[str, dict[int, float | None]], names: list[str], base: str, lengths: list[int],
           args: argparse.Namespace, model: Path) -> None:
    """One table per measure: each server's median (min-max), then each against `base` (the first llama-server)."""
    print(f"\n{model.name}, {args.threads} threads, {args.max_tokens} tokens out, {args.rounds} round(s), median of "
          f"{args.repeat} (min-max); ratios to {base}{' (shipped config)' if args.shipped else ''}")

    def col(rows: list[dict], name: str) -> list[float]:
        return [r[name] for r in rows if r.get(name) is not None]

    others = [n for n in names if n != base]
    # Greedy answers under load differ between servers (batches change the arithmetic), and a cell whose
    # prompts dominate its time reads its tok/s off the answers' lengths: its wall time is the measure there.
    for measure, title, scale in (("tok_s", "aggregate tok/s", 1.0), ("ttft_p50", "TTFT p50 ms", 1e3), ("prefill_tok_s", "prefill tok/s (1 client)", 1.0),
                                  ("completion_tokens", "tokens out, all clients", 1.0), ("wall_s", "the cell's wall time, s (lower is faster)", 1.0)):
        rows = [(key, by) for key, by in results.items() if any(col(r, measure) for r in by.values())]
        if not rows:
            continue
        print(f"\n{title}\n| prompt tokens | clients | " + " | ".join(names) + " | " + " | ".join(f"{n} / {base}" for n in others) + " |")
        print("|---" * (2 + len(names) + len(others)) + "|")
        for key, by in rows:
            length, clients = key.split("/")
            cells = [cell(col(by.get(n, []), measure), scale) for n in names]
            ratios = [ratio(col(by.get(n, []), measure), col(by.get(base, []), measure),
                            [(x[measure], y[measure]) for x, y in zip(by.get(n, []), by.get(base, []))
                             if x.get(measure) is not None and y.get(measure) is not None]) for n in others]
            print(f"| {length} | {clients} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("\npeak RSS MiB: " + "; ".join(f"{n} tokens: " + ", ".join(f"{name} {rss[name].get(n) or 0:.0f}" for name in names)
                                          for n in lengths if any(n in rss[name] for name in names)))


if __name__ == "__main__":
    sys.exit(main())
