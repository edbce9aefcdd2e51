#!/usr/bin/env python3
"""Long-prompt prefill: ours against llama.cpp's own llama-server, side by side in one run.

Both servers run at once on the same model, threads and slot count, and take turns: each round
sends one prompt of each length to each server in turn (ours, then the peer, then the next length),
so a drift of the machine touches both alike. Every prompt is new text (no prefix or prompt cache
can serve it), sent with max_tokens = 1: the time to the end of the answer is the prefill and one
sampled token (not the time to the first chunk: ours sends the role's chunk before prefilling).
Reported per length: prompt tokens per second (the server's own usage count / time to first
token), the median over rounds, the spread (min-max), and ours / peer.

    .venv/bin/python -m bench.prefill                                  # 1k, 4k, 8k tokens, 3 rounds
    .venv/bin/python -m bench.prefill --lengths 1024 --rounds 5
    .venv/bin/python -m bench.prefill --variant invariant:"batch_invariant = true"   # another config of ours, same run

A variant is `NAME:TOML` (keys added to ours' [[models]] table); each variant is one more server of
ours in the same rotation. Cache off everywhere: the semantic cache is not what this measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.kit.load import long_prompt
from bench.kit.machine import code_state, log, machine
from bench.kit.peers import ALIAS, PACKAGE_FILE, VENV_BIN, build_llama_server, cache_root, model_file
from bench.kit.server import Server, free_port
from bench.kit.stats import median, spread

def ours(name: str, tmp: Path, logs: Path, model: Path | None, slots: int, context: int, threads: int, extra: str,
         env: dict[str, str]) -> Server:
    port = free_port()
    home = tmp / f"home-{name}"
    home.mkdir()
    config = tmp / f"{name}.toml"
    source = f'path = "{model}"' if model else f'package_file = "{PACKAGE_FILE}"'
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\n\n[auth]\nmode = "open"\n\n[cache]\nenabled = false\n\n'
        f'[[models]]\nalias = "{ALIAS}"\nengine = "llamacpp"\n{source}\ncontext_length = {context}\nslots = {slots}\n'
        f"threads = {threads}\n{extra}\n")
    return Server(name, [str(VENV_BIN / "appliance"), "serve", "--config", str(config), "--port", str(port)],
                  port, "/health", ALIAS, env={"APPLIANCE_HOME": str(home), **env}, log_path=logs / f"{name}.log")


def peer(binary: Path, logs: Path, model: Path, slots: int, context: int, threads: int) -> Server:
    port = free_port()
    return Server("llama-server", [str(binary), "-m", str(model), "-a", ALIAS, "-np", str(slots), "-c", str(slots * context),
                                   "-t", str(threads), "-ngl", "0", "--host", "127.0.0.1", "--port", str(port)],
                  port, "/health", ALIAS, log_path=logs / "llama-server.log")


def prefill(server: Server, text: str) -> tuple[int, float]:
    """(prompt tokens, seconds to the whole one-token answer) for one request."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0.0}
    started = time.perf_counter()
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=900)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens"], seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--model", type=Path, help="a GGUF instead of the bundled model")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:TOML", help="another config of ours in the same run")
    p.add_argument("--env", action="append", default=[], metavar="NAME:VAR=VALUE", help="an environment variable for one of ours")
    p.add_argument("--no-default", action="store_true", help="leave out ours with default settings (variants only)")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built once into the bench cache)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    context = max(lengths) + 512
    model = args.model or model_file()
    binary = args.llama_server or build_llama_server(cache_root())
    variants = ([] if args.no_default else [("ours", "")]) + [tuple(v.split(":", 1)) for v in args.variant]  # type: ignore[misc]
    results: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="prefill-bench-") as tmp_name:
        tmp = Path(tmp_name)
        logs = tmp / "logs"
        envs: dict[str, dict[str, str]] = {}
        for item in args.env:
            name, _, pair = item.partition(":")
            key, _, value = pair.partition("=")
            envs.setdefault(name, {})[key] = value
        servers = [ours(name, tmp, logs, args.model, args.slots, context, args.threads, extra, envs.get(name, {}))
                   for name, extra in variants]
        servers.append(peer(binary, logs, model, args.slots, context, args.threads))
        try:
            for server in servers:
                server.start()
                prefill(server, long_prompt(256, seed=-1))  # warm-up: first-call allocations are not prefill
            seed = 0
            for r in range(args.rounds):
                for n in lengths:
                    for server in servers:
                        seed += 1
                        tokens, seconds = prefill(server, long_prompt(n, seed))
                        rate = tokens / seconds
                        results.setdefault(server.name, {}).setdefault(n, []).append(rate)
                        log(f"round {r + 1}: {server.name} {tokens} tokens in {seconds:.2f} s = {rate:.0f} tok/s")
                        time.sleep(0.5)  # ggml's threads stop spinning before the other server computes
        finally:
            for server in servers:
                server.stop()
    print(f"\nprefill tok/s (median of {args.rounds} rounds, min-max), {args.threads} threads, {model.name}")
    names = [s.name for s in servers]
    print("| prompt tokens | " + " | ".join(names) + " | " + " | ".join(f"{n} / llama-server" for n in names[:-1]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for n in lengths:
        peer_rate = median(results["llama-server"][n])
        cells = [f"{median(results[name][n]):.0f} ({spread(results[name][n])})" for name in names]
        ratios = [f"{median(results[name][n]) / peer_rate:.2f}" for name in names[:-1]]
        print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    if args.json:
        args.json.write_text(json.dumps({"results": {k: {str(n): v for n, v in d.items()} for k, d in results.items()},
                                         "code": code_state(), "machine": machine(), "args": vars(args)}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
