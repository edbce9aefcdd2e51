#!/usr/bin/env python3
"""The whole range of prompts and clients: ours against llama.cpp's own llama-server, in one run.

For each prompt length both servers run at once, sized alike (slots = the most clients, each able
to hold the prompt and the answer),
and take turns cell by cell (one KV stream per slot in both, or with --pool one shared pool of
that many cells in both): for every client count, ours then the peer (the order alternating
between repeats), each client sending `--rounds` streamed requests whose prompts are new text of
about that length (no prefix cache can serve them). Cache off everywhere.

Reported per cell, as the median over repeats with the spread (min-max), and ours / peer:
aggregate completion tok/s, TTFT p50, and with one client prefill tok/s (prompt tokens / TTFT).
After the run: each server's peak resident memory (VmHWM) per prompt length.

    .venv/bin/python -m bench.sweep                                   # 20,1k,4k,8k x 1,8,32
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
from pathlib import Path
from typing import Any

from bench.kit.load import run_load
from bench.kit.machine import code_state, log, machine
from bench.kit.peers import ALIAS, PACKAGE_FILE, VENV_BIN, build_llama_server, cache_root, model_file
from bench.kit.server import Server, free_port
from bench.kit.stats import median, spread


def ours(tmp: Path, logs: Path, model: Path | None, slots: int, context: int, threads: int, pool: int, extra: str) -> Server:
    port = free_port()
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    config = tmp / f"ours-{context}.toml"
    source = f'path = "{model}"' if model else f'package_file = "{PACKAGE_FILE}"'
    pool_line = f"kv_tokens = {pool}\n" if pool < slots * context else ""
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nmax_queue = 256\n\n[auth]\nmode = "open"\n\n[cache]\nenabled = false\n\n'
        f'[[models]]\nalias = "{ALIAS}"\nengine = "llamacpp"\n{source}\ncontext_length = {context}\nslots = {slots}\n'
        f"threads = {threads}\n{pool_line}{extra}\n")
    return Server("ours", [str(VENV_BIN / "appliance"), "serve", "--config", str(config), "--port", str(port)],
                  port, "/health", ALIAS, env={"APPLIANCE_HOME": str(home)}, log_path=logs / f"ours-{context}.log")


def peer(binary: Path, logs: Path, model: Path, slots: int, context: int, threads: int, pool: int) -> Server:
    port = free_port()
    # llama-server's own choice with a fixed slot count is one stream per slot; a pool needs -kvu
    unified = ["-kvu"] if pool < slots * context else []
    return Server("llama-server", [str(binary), "-m", str(model), "-a", ALIAS, "-np", str(slots), "-c", str(pool), *unified,
                                   "-t", str(threads), "-ngl", "0", "--host", "127.0.0.1", "--port", str(port)],
                  port, "/health", ALIAS, log_path=logs / f"llama-server-{context}.log")


def cell(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    m = median(values)
    if m is None:
        return "-"
    return f"{m * scale:.{digits}f} ({spread([v * scale for v in values if v is not None], digits)})"


def ratio(a: list[float], b: list[float]) -> str:
    ma, mb = median(a), median(b)
    return f"{ma / mb:.2f}" if ma is not None and mb else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="20,1024,4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--clients", default="1,8,32", help="concurrent clients, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--rounds", type=int, default=1, help="requests each client sends one after another")
    p.add_argument("--repeat", type=int, default=2, help="measurements of each cell per server, order alternating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=0, help="tokens per slot (0: room for the prompt and the answer)")
    p.add_argument("--pool", type=int, default=0, help="KV cells both servers hold (0: slots x context); ours as kv_tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=70000, help="skip cells sending more prompt tokens than this")
    p.add_argument("--extra", default="", help="TOML keys added to ours' [[models]] table")
    p.add_argument("--model", type=Path, help="a GGUF instead of the bundled model")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built once into the bench cache)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    client_counts = [int(x) for x in args.clients.split(",")]
    model = args.model or model_file()
    binary = args.llama_server or build_llama_server(cache_root())
    results: dict[str, Any] = {}
    rss: dict[str, dict[int, float | None]] = {"ours": {}, "llama-server": {}}
    prompt_no = 1000
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp_name:
        tmp = Path(tmp_name)
        logs = tmp / "logs"
        for length in lengths:
            cells = [c for c in client_counts if c * args.rounds * length <= args.max_prompt_tokens]
            if not cells:
                log(f"{length} tokens: every cell is over --max-prompt-tokens; skipped")
                continue
            slots = max(cells)
            context = args.context or -(-(int(length * 1.4) + args.max_tokens + 64) // 256) * 256
            pool = args.pool or slots * context
            servers = [ours(tmp, logs, args.model, slots, context, args.threads, pool, args.extra),
                       peer(binary, logs, model, slots, context, args.threads, pool)]
            try:
                for server in servers:
                    server.start()
                    warm = asyncio.run(run_load(server, 1, 1, 8, first_prompt=prompt_no, prompt_tokens=min(length, 256)))
                    prompt_no += 1
                    if warm["failed"]:
                        raise RuntimeError(f"{server.name}: warm-up failed: {warm['errors']}")
                for clients in cells:
                    for rep in range(args.repeat):
                        order = servers if rep % 2 == 0 else servers[::-1]
                        for server in order:
                            run = asyncio.run(run_load(server, clients, args.rounds, args.max_tokens, first_prompt=prompt_no,
                                                       prompt_tokens=length))
                            prompt_no += clients * args.rounds
                            if run["failed"]:
                                log(f"{server.name}: failures: {run['errors']}\n{server.log_tail(15)}")
                            got = results.setdefault(f"{length}/{clients}", {}).setdefault(server.name, [])
                            prompt_tokens = (run["prompt_tokens"] or [length])[0]
                            got.append({"tok_s": run["tokens_per_s"], "ttft_p50": run["ttft_p50_s"], "ttft_p95": run["ttft_p95_s"],
                                        "prefill_tok_s": prompt_tokens / run["ttft_p50_s"] if clients == 1 and run["ttft_p50_s"] else None,
                                        "failed": run["failed"], "prompt_tokens": prompt_tokens, "wall_s": run["wall_s"],
                                        "other_cores": run["other_cores"]})
                            log(f"{length} tok x {clients} clients, {server.name}: {run['tokens_per_s'] or 0:.1f} tok/s, TTFT p50 "
                                f"{(run['ttft_p50_s'] or 0) * 1e3:.0f} ms, {run['failed']} failed, prompt {prompt_tokens} tokens, "
                                f"other processes {run['other_cores']:.2f} cores")
                            time.sleep(0.5)  # ggml's threads stop spinning before the other server computes
                for server in servers:
                    kib = server.peak_rss_kib()
                    rss[server.name][length] = kib / 1024 if kib is not None else None
            finally:
                for server in servers:
                    server.stop()
    print(f"\n{model.name}, {args.threads} threads, {args.max_tokens} tokens out, {args.rounds} round(s), median of "
          f"{args.repeat} (min-max); ratios ours / llama-server")
    print("| prompt tokens | clients | tok/s ours | tok/s llama-server | ratio | TTFT p50 ms ours | TTFT p50 ms llama-server "
          "| ratio | prefill tok/s ours | prefill tok/s llama-server | ratio |")
    print("|---" * 11 + "|")
    for key, by in results.items():
        length, clients = key.split("/")
        o, q = by.get("ours", []), by.get("llama-server", [])

        def col(rows: list[dict], name: str) -> list[float]:
            return [r[name] for r in rows if r[name] is not None]

        print(f"| {length} | {clients} | {cell(col(o, 'tok_s'))} | {cell(col(q, 'tok_s'))} | {ratio(col(o, 'tok_s'), col(q, 'tok_s'))} "
              f"| {cell(col(o, 'ttft_p50'), 1e3)} | {cell(col(q, 'ttft_p50'), 1e3)} | {ratio(col(o, 'ttft_p50'), col(q, 'ttft_p50'))} "
              f"| {cell(col(o, 'prefill_tok_s'))} | {cell(col(q, 'prefill_tok_s'))} | {ratio(col(o, 'prefill_tok_s'), col(q, 'prefill_tok_s'))} |")
    print("\npeak RSS MiB: " + "; ".join(f"{n} tokens: ours {rss['ours'].get(n) or 0:.0f}, llama-server {rss['llama-server'].get(n) or 0:.0f}"
                                          for n in lengths if n in rss["ours"]))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rss_mib": rss, "code": code_state(), "machine": machine(),
                                         "args": vars(args)}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
