"""What the answer cache's error bound does to the economics workload, without its hours of model
calls: the recorded whole-appliance pass of an economics run (bench/runs/economics-evaluation, where
the cache served verified answers only) replayed through the cache's decision. Every request the
cache served there is decided again as today's cache would decide it (an exact repeat is served as
before; a reworded one only where its language's cut admits the pair), and every trap is checked
the same way; a hit the bound refuses becomes a model call at the stored answer's recorded cost.

    .venv/bin/python -m bench.cache_economics [--bound 0.02] [--run bench/runs/economics-evaluation]

Prints the cache's share of answers, traps served, the cost-weighted verified hit rate (what hits on
verified answers saved / the cost of every request, hits counted as the call they replaced) and
what the cache saves per 1,000 requests, before (as recorded) and after (replayed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from appliance.answer_cache import calibration, language
from appliance.answer_cache.calibration import Bounds
from appliance.answer_cache.service import bundled_lexicon
from appliance.fleet.embedders import bundled_minilm
from bench.kit.paths import ROOT
from policy.answer_bound import Cut
from policy.answer_cache import AskJudge, CachePolicy, Candidate, Hit, judge_candidates, normalise
from policy.answer_guards import spelled

SPLITS = ROOT / "bench" / "workload" / "splits"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, default=CachePolicy().max_false_hit_rate)
    parser.add_argument("--judge-band", type=float, default=0.3, help="for counting the lookups a judge would be asked about")
    parser.add_argument("--run", type=Path, default=ROOT / "bench" / "runs" / "economics-evaluation")
    args = parser.parse_args()
    outcomes = [json.loads(line) for line in (args.run / "outcomes.jsonl").read_text().splitlines() if line.strip()]
    whole = [o for o in outcomes if o["pass"] == "whole"]
    split = whole[0]["id"].split("-")[0]
    requests = {r["id"]: r for r in map(json.loads, (SPLITS / f"{split}.jsonl").read_text().splitlines())}
    cost = {o["id"]: o["cost_nanos"] for o in whole}
    # Each request's stored answer's cost, as the cache keeps it: what its model call cost when first answered.
    policy = CachePolicy(max_false_hit_rate=args.bound, freshness_s=math.inf)
    judging = dataclasses.replace(policy, judge_band=args.judge_band)
    lexicon, languages, embedder = bundled_lexicon(), language.load(), bundled_minilm()
    bounds = Bounds.of(args.bound, calibration.shipped_pools(languages.of, lexicon, policy), {})

    judge_asks: list[str] = []

    def decided(request: dict[str, object]) -> tuple[bool, str]:
        """Whether today's cache serves this request the answer stored for its cache_of, and why (the
        lookup's own decision, policy/answer_cache.py: judge_candidates, with no judge)."""
        stored = requests[str(request["cache_of"])]
        cached, asked = stored["messages"][-1]["content"], request["messages"][-1]["content"]  # type: ignore[index]
        if normalise(cached) == normalise(asked):
            return True, "exact"
        va, vb = embedder.embed_now([spelled(cached, lexicon), spelled(asked, lexicon)])
        language = languages.of(asked)
        candidate = Candidate(0, cached, float(va @ vb), "verified", 0.0, languages.of(cached))
        cut = bounds.cut("replay", language)
        decision = judge_candidates(asked, [candidate], 0.0, policy, lexicon, cut, language)
        # where a judge with an open cut would be asked (and charged), had one been configured
        if isinstance(judge_candidates(asked, [candidate], 0.0, judging, lexicon, cut, language, Cut(-math.inf, 1, 1, 1.0)), AskJudge):
            judge_asks.append(str(request["id"]))
        return isinstance(decision, Hit), decision.reason if not isinstance(decision, Hit) else f"score {decision.score:.3f}, cut {cut.score:.3f}"

    try:
        before_hits = [o for o in whole if o["answered_by"] == "cache"]
        kept, dropped = [], []
        for o in before_hits:
            served, why = decided(requests[o["id"]])
            (kept if served else dropped).append((o, why))
        trap_served = [o for o in whole if requests[o["id"]]["cache"] == "trap" and decided(requests[o["id"]])[0]]
    finally:
        embedder.close()

    def saved(o: dict[str, object]) -> int:
        return int(cost[str(requests[str(o["id"])]["cache_of"])])

    misses_cost = sum(o["cost_nanos"] for o in whole if o["answered_by"] != "cache")
    replaced = sum(saved(o) for o in before_hits)
    kept_saved = sum(saved(o) for o, _ in kept)
    # The server's measure: hits count as the call they replaced, so the whole stays the same before and after.
    total = misses_cost + replaced
    n = len(whole)
    print(f"{args.run.name}: {n} requests, {len(before_hits)} answered by the cache as recorded (all on verified answers)")
    print(f"before (recorded): cache share {len(before_hits) / n:.1%}, traps served {sum(requests[o['id']]['cache'] == 'trap' for o in before_hits)}, "
          f"cost-weighted verified hit rate {replaced / total:.2%}, saved ${replaced / 1e9 * 1000 / n:.6f} per 1,000 requests")
    print(f"after (bound {args.bound}): cache share {len(kept) / n:.1%}, traps served {len(trap_served)}, "
          f"cost-weighted verified hit rate {kept_saved / total:.2%}, saved ${kept_saved / 1e9 * 1000 / n:.6f} per 1,000 requests; "
          "no judge or verification call is made (the bound needs none)")
    print(f"with a judge configured, {len(set(judge_asks))} of these lookups would ask it (a call each, charged to the caller)")
    for o, why in dropped:
        r = requests[o["id"]]
        print(f"  no longer served: {r['cache']} {o['id']} ({why}): {r['messages'][-1]['content'][:70]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
