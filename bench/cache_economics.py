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
import json
import math
import sys
from pathlib import Path

from appliance.answer_cache import calibration, language
from appliance.answer_cache.calibration import Bounds
from appliance.answer_cache.service import bundled_lexicon
from appliance.fleet.embedders import bundled_minilm
from bench.kit.paths import ROOT
from policy.answer_cache import CachePolicy, normalise, pair_score
from policy.answer_guards import compare, spelled

SPLITS = ROOT / "bench" / "workload" / "splits"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, default=CachePolicy().max_false_hit_rate)
    parser.add_argument("--run", type=Path, default=ROOT / "bench" / "runs" / "economics-evaluation")
    args = parser.parse_args()
    outcomes = [json.loads(line) for line in (args.run / "outcomes.jsonl").read_text().splitlines() if line.strip()]
    whole = [o for o in outcomes if o["pass"] == "whole"]
    split = whole[0]["id"].split("-")[0]
    requests = {r["id"]: r for r in map(json.loads, (SPLITS / f"{split}.jsonl").read_text().splitlines())}
    cost = {o["id"]: o["cost_nanos"] for o in whole}
    # Each request's stored answer's cost, as the cache keeps it: what its model call cost when first answered.
    policy = CachePolicy(max_false_hit_rate=args.bound)
    lexicon, languages, embedder = bundled_lexicon(), language.load(), bundled_minilm()
    bounds = Bounds.of(args.bound, calibration.shipped_pools(languages.of, lexicon, policy), {})

    def decided(request: dict[str, object]) -> tuple[bool, str]:
        """Whether today's cache serves this request the answer stored for its cache_of, and why."""
        stored = requests[str(request["cache_of"])]
        cached, asked = stored["messages"][-1]["content"], request["messages"][-1]["content"]  # type: ignore[index]
        if normalise(cached) == normalise(asked):
            return True, "exact"
        va, vb = embedder.embed_now([spelled(cached, lexicon), spelled(asked, lexicon)])
        score = pair_score(compare(cached, asked, lexicon), float(va @ vb), policy)
        cut = bounds.cut("replay", languages.of(asked))
        if score == -math.inf:
            return False, "a guard or the similarity floor, not the bound"
        return cut.admits(score), f"score {score:.3f}, cut {cut.score:.3f}"

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
    for o, why in dropped:
        r = requests[o["id"]]
        print(f"  no longer served: {r['cache']} {o['id']} ({why}): {r['messages'][-1]['content'][:70]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
