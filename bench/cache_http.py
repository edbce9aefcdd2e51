"""The answer cache through HTTP on labelled question pairs, as a team would meet it: the shipped
models.toml (sweeps off), each pair in its own bucket (its own system prompt), the stored question
asked first, then the new one at temperature 0; per set and kind, what was served, and next to it
the cache's own estimate of the share of near misses it serves (GET /admin/cache).

    .venv/bin/python -m bench.cache_http --bounds 0,0.02,0.01 tests/data/cache_pairs_blind_tune_pt.jsonl
    .venv/bin/python -m bench.cache_http --bounds 0,0.02,0.01 --sealed   # the held-out sets: once
    .venv/bin/python -m bench.cache_http --bounds 0.02 --judge ~/.cache/appliance/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --judgements bench/runs/cache-bound/judge-qwen1.5b.json tests/data/cache_pairs_sealed3_pt.jsonl

--judge adds a chat model as [cache] judge_model (judge_band 0.3 unless --judge-band says) and waits until
it has answered the known traps of every language with enough of them; --judgements keeps its answers in
a file between runs (loaded into the new database before the server starts, written back after).

--sealed reads tests/data/sealed/*.jsonl.gz after checking each against the digest it was frozen with
(tests/data/cache_pairs_*.sha256); once used, a set moves out of that folder and is a tuning set.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import apsw
import httpx

from bench.kit.paths import ROOT
from bench.kit.server import start, write_config

SEALED = ROOT / "tests" / "data" / "sealed"
DIGESTS = sorted((ROOT / "tests" / "data").glob("cache_pairs_*.sha256"))
REWORDINGS = ("paraphrase", "typo")


def sealed_sets() -> list[tuple[str, list[dict[str, str]]]]:
    frozen = dict(line.split()[::-1] for digests in DIGESTS for line in digests.read_text().splitlines() if line.strip())
    out = []
    for path in sorted(SEALED.glob("*.jsonl.gz")):
        raw = gzip.decompress(path.read_bytes())
        name = path.name.removesuffix(".gz")
        digest = hashlib.sha256(raw).hexdigest()
        expected = next((v for k, v in frozen.items() if name.endswith(k)), None)
        if digest != expected:
            raise SystemExit(f"{path}: sha256 {digest}, frozen as {expected}")
        out.append((name, [json.loads(line) for line in raw.decode().splitlines() if line.strip()]))
    return out


def config(bound: float, judge: Path | None = None, judge_band: float = 0.3, embedder: str | None = None,
           floor: float | None = None) -> str:
    text = (ROOT / "models.toml").read_text()
    if embedder is not None:
        text = re.sub(r'(?m)^embedder = "[^"]*"', f'embedder = "{embedder}"', text)
    if floor is not None:
        text = re.sub(r"(?m)^similarity_threshold = .*$", f"similarity_threshold = {floor}", text)
    text = re.sub(r"(?m)^max_false_hit_rate = .*$", f"max_false_hit_rate = {bound}", text)
    text = re.sub(r"(?m)^sweep_interval_s = .*$", "sweep_interval_s = 0", text)
    assert f"max_false_hit_rate = {bound}" in text
    if judge is not None:
        text = re.sub(r"(?m)^\[cache\]\n", f'[cache]\njudge_model = "judge"\njudge_band = {judge_band}\n', text, count=1)
        text += f'\n[[models]]\nalias = "judge"\npath = "{judge}"\ncontext_length = 1024\nslots = 1\nthreads = 2\n'
    return text


def load_judgements(db: Path, saved: Path | None) -> None:
    """The judge's answers of an earlier run, into a fresh database (migrated here first)."""
    if saved is None or not saved.exists():
        return
    from appliance.store.db import connect, migrate

    conn = connect(db)
    migrate(conn)
    conn.executemany("INSERT OR REPLACE INTO cache_judgements(judge, pair, probability) VALUES (?, ?, ?)",
                     [(r["judge"], r["pair"], r["probability"]) for r in json.loads(saved.read_text())])
    conn.close()


def save_judgements(db: Path, saved: Path | None) -> None:
    if saved is None:
        return
    with apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY) as conn:
        rows = [{"judge": j, "pair": p, "probability": q} for j, p, q in conn.execute("SELECT judge, pair, probability FROM cache_judgements")]
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(rows, indent=0))


def judge_ready(client: httpx.Client, timeout: float = 3600.0) -> dict[str, object]:
    """Waits until the judge has answered the known traps of each language with 50 or more."""
    deadline = time.monotonic() + timeout
    while True:
        bound = client.get("/admin/cache").json()["false_hit_bound"]
        waiting = {lang: row["judge"] for lang, row in bound.items()
                   if row["traps"] >= 50 and row["judge"]["traps_asked"] < row["judge"]["traps_in_band"]}
        if not waiting or time.monotonic() > deadline:
            return bound
        print(f"the judge is answering the known traps: {waiting}", flush=True)
        time.sleep(20)


def stored(db: Path, question: str, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY) as conn:
            if conn.execute("SELECT 1 FROM cache_entries WHERE question = ?", (question,)).fetchone():
                return True
        time.sleep(0.05)
    return False


def run_set(client: httpx.Client, db: Path, model: str, name: str, pairs: list[dict[str, str]]) -> list[dict[str, object]]:
    results = []
    for i, pair in enumerate(pairs):
        system = f"You answer questions for team {name} #{i}."  # its own bucket: nothing else is ever compared with it
        for question in (pair["a"], pair["b"]):
            body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                    "max_tokens": 4, "temperature": 0}
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            if question == pair["a"] and not stored(db, question):
                raise RuntimeError(f"never stored: {question!r}")
        results.append({"kind": pair["kind"], "label": pair["label"], "lang": pair.get("lang", "en"),
                        "served": response.headers.get("x-cache") == "hit", "reason": response.headers.get("x-cache-reason", "")})
    return results


def summarise(name: str, results: list[dict[str, object]]) -> dict[str, object]:
    kinds = Counter(str(r["kind"]) for r in results)
    served = Counter(str(r["kind"]) for r in results if r["served"])
    traps = [r for r in results if r["label"] == "miss"]
    rewordings = [r for r in results if r["kind"] in REWORDINGS]
    return {"set": name, "pairs": len(results),
            "traps_served": sum(bool(r["served"]) for r in traps), "traps": len(traps),
            "rewordings_served": sum(bool(r["served"]) for r in rewordings), "rewordings": len(rewordings),
            "by_kind": {k: f"{served[k]}/{kinds[k]}" for k in sorted(kinds)},
            # code-switched pairs apart from the rest of their file
            "by_lang": {lang: {"traps": f"{sum(bool(r['served']) for r in traps if r['lang'] == lang)}/{sum(r['lang'] == lang for r in traps)}",
                               "rewordings": f"{sum(bool(r['served']) for r in rewordings if r['lang'] == lang)}/"
                                             f"{sum(r['lang'] == lang for r in rewordings)}"}
                        for lang in sorted({str(r['lang']) for r in results})},
            "miss_reasons": dict(Counter(str(r["reason"]) for r in rewordings if not r["served"]).most_common(5))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="*", type=Path)
    parser.add_argument("--sealed", action="store_true")
    parser.add_argument("--bounds", default="0.02", help="max_false_hit_rate values, one server each")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--judge", type=Path, help="a chat model's GGUF as the cache's judge")
    parser.add_argument("--judge-band", type=float, default=0.3)
    parser.add_argument("--judgements", type=Path, help="the judge's answers on known traps, kept between runs")
    parser.add_argument("--embedder", help="[cache] embedder in place of the shipped one (minilm, e5-small)")
    parser.add_argument("--floor", type=float, help="[cache] similarity_threshold in place of the shipped one")
    args = parser.parse_args()
    sets = sealed_sets() if args.sealed else []
    sets += [(p.name, [json.loads(line) for line in p.read_text().splitlines() if line.strip()]) for p in args.pairs]
    if not sets:
        parser.error("give pair files or --sealed")
    report: list[dict[str, object]] = []
    for bound in (float(b) for b in args.bounds.split(",")):
        with tempfile.TemporaryDirectory(prefix="cache-http-") as tmp:
            workdir = Path(tmp)
            write_config(workdir, config(bound, args.judge, args.judge_band, args.embedder, args.floor))
            db = workdir / "home" / "appliance.db"
            db.parent.mkdir(parents=True, exist_ok=True)
            if args.judge is not None:
                load_judgements(db, args.judgements)
            server = start(workdir)
            try:
                with httpx.Client(base_url=server.base, timeout=300) as client:
                    model = client.get("/v1/models").json()["data"][0]["id"]
                    if args.judge is not None and bound > 0:
                        started = time.monotonic()
                        ready = judge_ready(client)
                        save_judgements(db, args.judgements)
                        print(f"the judge's cuts ({time.monotonic() - started:.0f} s): "
                              + ", ".join(f"{k} {v['judge']}" for k, v in ready.items() if v["traps"] >= 50), flush=True)  # type: ignore[index]
                    started = time.monotonic()
                    for name, pairs in sets:
                        row = summarise(name, run_set(client, workdir / "home" / "appliance.db", model, name, pairs))
                        row["bound"] = bound
                        row["estimate"] = client.get("/admin/cache").json().get("false_hit_bound", {})
                        report.append(row)
                        t, r = row["traps"], row["rewordings"]
                        print(f"bound {bound}: {name}: traps served {row['traps_served']}/{t} ({row['traps_served'] / t:.1%}), "  # type: ignore[operator]
                              f"rewordings served {row['rewordings_served']}/{r} ({row['rewordings_served'] / r:.1%}); "  # type: ignore[operator]
                              f"by kind {row['by_kind']}; by language {row['by_lang']}; rewordings missed for {row['miss_reasons']}",
                              flush=True)
                    estimate = report[-1]["estimate"]
                    print(f"bound {bound}: the cache's own estimate by language: "
                          + ", ".join(f"{k} {v['estimate']:.2%} (upper {v['upper']:.2%}, {v['traps']} traps)"  # type: ignore[index]
                                      for k, v in estimate.items() if v["traps"] >= 50)  # type: ignore[union-attr,index]
                          + f"; {time.monotonic() - started:.0f} s", flush=True)
            finally:
                server.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
