"""What the answer cache's decision does to the economics workload, without its hours of model calls:
the recorded whole-appliance pass of an economics run (bench/runs/economics-evaluation, where the cache
served verified answers only) replayed, request by request in its order, through today's lookup. Each
bucket keeps the questions a model answered (verified where the run's check found the answer right,
as its caller's feedback did); each request is looked up against its bucket's 4 nearest, decided by
policy/answer_cache.py's own functions under the bound, and, with --judge, the judge is really asked
where the decision says so (its cut set on its answers about the shipped traps, as the server does).

    .venv/bin/python -m bench.cache_economics [--bound 0.02] [--embedder e5-small --floor 0.86]
        [--judge GGUF --judge-band 0.3 --judgements FILE] [--run bench/runs/economics-evaluation]

Prints the cache's share of answers, wrong answers served (traps, and questions another question's
answer does not fit: its check is another), the cost-weighted verified hit rate (what hits on verified answers saved / the
cost of every request, hits counted as the call they replaced), the judge's calls and their cost at the
fleet's price for its model, and the net saving per 1,000 requests: before (as recorded) and replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomlkit

from appliance.answer_cache import calibration, language
from appliance.answer_cache.calibration import Bounds, pair_key
from appliance.answer_cache.service import JUDGE_PROMPT_VERSION, bundled_lexicon
from appliance.fleet.embedders import BUNDLED
from bench.kit.fleet import fleet_prices
from bench.kit.paths import ROOT
from policy.answer_cache import FREE, AskJudge, CachePolicy, Candidate, Hit, judge_candidates, judge_score, normalise
from policy.answer_guards import spelled
from policy.budgets import Price

SPLITS = ROOT / "bench" / "workload" / "splits"
JUDGE_PRICED_AS = "qwen-1.5b"  # the fleet's model the judge file is; its price is what a judge call costs


@dataclass
class Stored:
    request: str  # the request whose model call answered it
    question: str
    vector: np.ndarray
    verified: bool
    language: str
    cost_nanos: int  # what its model call cost


@dataclass
class Tally:
    hits: int = 0
    wrong: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (request, kind, why)
    saved: int = 0  # nano-USD: the calls the hits replaced
    judge_calls: int = 0
    judge_nanos: int = 0


class Judge:
    """The judge's P(same answer) by pair, from an earlier run's answers where it gave them (the same file
    cache_http keeps) and from the model itself otherwise; counts what it is asked."""

    def __init__(self, path: Path | None, saved: Path | None) -> None:
        self.path, self.saved = path, saved
        self.key = f"{path}#{JUDGE_PROMPT_VERSION}"
        self.answers: dict[str, float] = {}
        self.tokens: dict[str, tuple[int, int]] = {}  # a call's (prompt, completion) tokens, where this file kept them
        if saved is not None and saved.exists():
            for r in json.loads(saved.read_text()):
                if r["judge"] == self.key:
                    self.answers[r["pair"]] = r["probability"]
                    if "tokens" in r:
                        self.tokens[r["pair"]] = tuple(r["tokens"])  # type: ignore[assignment]
        self._loop = asyncio.new_event_loop()
        self._registry: Any = None
        self._model: Any = None

    def ask(self, pairs: list[tuple[str, str]], costed: bool = False) -> dict[str, float]:
        """P(same answer) for each pair; `costed`: also what each call takes (asked again where not kept)."""
        missing = [(a, b) for a, b in pairs if pair_key(a, b) not in self.answers or (costed and pair_key(a, b) not in self.tokens)]
        if missing:
            self._loop.run_until_complete(self._ask(missing))
        return {pair_key(a, b): self.answers[pair_key(a, b)] for a, b in pairs}

    async def _ask(self, pairs: list[tuple[str, str]]) -> None:
        from appliance.answer_cache.service import ask_judge
        from bench.kit.judge import load_judge

        if self._registry is None:  # loaded once, on the first question it has no answer for
            self._registry, self._model = await load_judge(self.path)
        model = self._model
        for i, (a, b) in enumerate(pairs):
            self.answers[pair_key(a, b)], self.tokens[pair_key(a, b)] = await ask_judge(model, a, b)
            if i % 50 == 49:
                print(f"  the judge answered {i + 1}/{len(pairs)}", flush=True)
        self.keep()

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()
        self._loop.close()

    def keep(self) -> None:
        if self.saved is None:
            return
        rows = [r for r in (json.loads(self.saved.read_text()) if self.saved.exists() else []) if r["judge"] != self.key]
        rows += [{"judge": self.key, "pair": p, "probability": q} | ({"tokens": list(self.tokens[p])} if p in self.tokens else {})
                 for p, q in self.answers.items()]
        self.saved.write_text(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, default=CachePolicy().max_false_hit_rate)
    parser.add_argument("--embedder", choices=sorted(BUNDLED), default="minilm")
    parser.add_argument("--floor", type=float, help="[cache] similarity_threshold in place of the shipped policy's")
    parser.add_argument("--judge", type=Path, help="a chat model's GGUF as the cache's judge (priced as the fleet's qwen-1.5b)")
    parser.add_argument("--judge-band", type=float, default=0.3)
    parser.add_argument("--free-judge", action="store_true", help="ask the judge whatever its call costs (as before the lookup weighed it)")
    parser.add_argument("--judgements", type=Path, help="the judge's answers, kept between runs (cache_http's format)")
    parser.add_argument("--run", type=Path, default=ROOT / "bench" / "runs" / "economics-evaluation")
    args = parser.parse_args()
    outcomes = [json.loads(line) for line in (args.run / "outcomes.jsonl").read_text().splitlines() if line.strip()]
    whole = [o for o in outcomes if o["pass"] == "whole"]
    split = whole[0]["id"].split("-")[0]
    requests = {r["id"]: r for r in map(json.loads, (SPLITS / f"{split}.jsonl").read_text().splitlines())}
    by_id = {o["id"]: o for o in whole}

    def call_cost(rid: str) -> int:
        """What the request's model call cost: as recorded, or (a recorded hit) its stored answer's call."""
        o = by_id[rid]
        return int(o["cost_nanos"]) if o["answered_by"] != "cache" else int(by_id[str(requests[rid]["cache_of"])]["cost_nanos"])

    total = sum(call_cost(o["id"]) for o in whole)  # the server's measure: a hit counts as the call it replaced
    n = len(whole)
    before = [o for o in whole if o["answered_by"] == "cache"]
    print(f"{args.run.name}: {n} requests; kinds {dict(sorted(_count(requests[o['id']]['cache'] for o in whole).items()))}")
    print(f"before (recorded, MiniLM, verified answers only): cache share {len(before) / n:.1%}, traps served "
          f"{sum(requests[o['id']]['cache'] == 'trap' for o in before)}, cost-weighted verified hit rate "
          f"{sum(call_cost(o['id']) for o in before) / total:.2%}, saved ${sum(call_cost(o['id']) for o in before) / 1e9 * 1000 / n:.6f} "
          "per 1,000 requests")

    judging = args.judge is not None
    policy = CachePolicy(max_false_hit_rate=args.bound, freshness_s=math.inf, serve_unverified=False,
                         judge_band=args.judge_band if judging else CachePolicy().judge_band)
    if args.floor is not None:
        policy = dataclasses.replace(policy, similarity_threshold=args.floor)
    lexicon, languages = bundled_lexicon(), language.load()
    bounds = Bounds.of(args.bound, calibration.shipped_pools(languages.of, lexicon, policy, args.embedder), {}, judging)
    judge = Judge(args.judge, args.judgements) if judging else None
    if judge is not None:
        traps = {pair_key(t.cached, t.asked): (t.cached, t.asked) for t in calibration.shipped_traps(args.embedder)}
        wanted = [traps[k] for k in bounds.to_judge()]
        print(f"the judge on {len(wanted)} shipped traps in its band ({sum(pair_key(*p) not in judge.answers for p in wanted)} not yet answered)",
              flush=True)
        bounds = bounds.with_judge(judge.ask(wanted))
        print("its cuts: " + ", ".join(f"{lang} {row['judge']['cut']}" for lang, row in bounds.summary().items()  # type: ignore[index]
                                       if isinstance(row.get("judge"), dict) and row["judge"]["cut"] is not None))  # type: ignore[index]

    prices = fleet_prices(tomlkit.parse((ROOT / "bench" / "fleets" / "fleet.toml").read_text()))
    try:
        tally = replay(whole, requests, call_cost, BUNDLED[args.embedder](), lexicon, languages, policy, bounds, judge,
                       prices[JUDGE_PRICED_AS], not args.free_judge)
    finally:
        if judge is not None:
            judge.close()
    label = f"{args.embedder}" + (f" floor {args.floor}" if args.floor else "") + (f" + judge (band {args.judge_band})" if judging else "")
    label += ", asked whatever it costs" if judging and args.free_judge else ""
    net = tally.saved - tally.judge_nanos
    print(f"replayed ({label}, bound {args.bound}): cache share {tally.hits / n:.1%} ({tally.hits}), wrong answers served "
          f"{len(tally.wrong)} (traps {sum(k == 'trap' for _, k, _ in tally.wrong)}), cost-weighted verified hit rate "
          f"{tally.saved / total:.2%}, judge calls {tally.judge_calls} costing ${tally.judge_nanos / 1e9 * 1000 / n:.6f} per 1,000 "
          f"requests, net saving ${net / 1e9 * 1000 / n:.6f} per 1,000 requests")
    for rid, kind, why in tally.wrong:
        print(f"  wrong: {kind} {rid} ({why}): {requests[rid]['messages'][-1]['content'][:70]!r}")
    return 0


def replay(whole: list[dict[str, Any]], requests: dict[str, dict[str, Any]], call_cost: Any, embedder: Any, lexicon: Any,
           languages: Any, policy: CachePolicy, bounds: Bounds, judge: Judge | None, judge_price: Price, judge_gated: bool = True) -> Tally:
    """The workload in its order through the lookup's decision; a miss is the recorded call, kept in its bucket."""
    tally = Tally()
    buckets: dict[str, list[Stored]] = {}
    try:
        for o in whole:
            r = requests[o["id"]]
            messages = r["messages"] if isinstance(r["messages"], list) else [r["messages"]]
            asked = str(messages[-1]["content"])
            # the bucket as the server keys it, as far as the workload varies: tenant, earlier turns, output limit and format
            bucket = json.dumps([r["tenant"], messages[:-1], r["max_tokens"], r["response_format"]], sort_keys=True)
            stored = buckets.setdefault(bucket, [])
            vector = embedder.embed_now([spelled(asked, lexicon)])[0]
            lang = languages.of(asked)
            served = decide(asked, vector, lang, stored, policy, lexicon, bounds, judge, judge_price, tally, judge_gated)
            if served is None:
                stored.append(Stored(o["id"], asked, vector, bool(o["correct"]), lang, call_cost(o["id"])))
                continue
            tally.hits += 1
            tally.saved += call_cost(o["id"])
            if r["cache"] == "trap":
                tally.wrong.append((o["id"], "trap", f"{r.get('trap_kind')} of {served.request}"))
            elif requests[served.request]["check"] != r["check"]:
                # The stored answer passed its own request's check; where this request's check is another, it is counted wrong.
                tally.wrong.append((o["id"], str(r["cache"]), f"given {served.request}'s answer"))
    finally:
        embedder.close()
    return tally


def decide(asked: str, vector: np.ndarray, lang: str, stored: list[Stored], policy: CachePolicy, lexicon: Any, bounds: Bounds,
           judge: Judge | None, judge_price: Price, tally: Tally, judge_gated: bool = True) -> Stored | None:
    """The entry the cache serves for this question, or None: the lookup's own steps (exact repeat,
    the 4 nearest, judge_candidates under the bound, the judge's cut)."""
    exact = [s for s in stored if s.verified and normalise(s.question) == normalise(asked)]
    if exact:
        return exact[-1]
    nearest = sorted(range(len(stored)), key=lambda i: -float(stored[i].vector @ vector))[:4]
    candidates = [Candidate(i, stored[i].question, float(stored[i].vector @ vector), "verified" if stored[i].verified else "unverified", 0.0,
                            stored[i].language, stored[i].cost_nanos) for i in nearest]
    cut, judge_cut = bounds.both("", lang) if policy.max_false_hit_rate > 0 else (None, None)
    # the judge's price, as the server reads it from the judge model's settings (--free-judge: as if it cost nothing)
    decision = judge_candidates(asked, candidates, 0.0, policy, lexicon, cut, lang, judge_cut, judge_price if judge_gated else FREE)
    if isinstance(decision, AskJudge) and judge is not None:
        pair = (decision.candidate.question, asked)
        probability = judge.ask([pair], costed=True)[pair_key(*pair)]
        prompt, completion = judge.tokens[pair_key(*pair)]
        tally.judge_calls += 1
        tally.judge_nanos += judge_price.cost(prompt, completion)
        read = judge_score(probability, decision.flagged)
        if judge_cut is not None and judge_cut.admits(read):
            return stored[decision.candidate.entry_id]
        return None
    return stored[decision.entry_id] if isinstance(decision, Hit) else None


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


if __name__ == "__main__":
    sys.exit(main())
