"""Writes appliance/data/cache_traps.jsonl: the near misses (pairs labelled miss) of the pair sets
written blind (by writers who saw no guard or other set), with each pair's cosine by the bundled
embedder (each of fleet.embedders.BUNDLED), from which the answer cache computes its error bound per language at start. Never from
tests/data/sealed/ (held out, measured once), and never from the sets the guards were written
against (cache_pairs.jsonl, _tune2, _tune3, _heldout, _heldout2): the guards catch those traps far
more often than anyone else's, so a bound counted on them promised 2% and served 4% of unseen
English traps (docs/performance/cache.md).

    .venv/bin/python -m bench.cache_traps [--check]

--check: recompute and say whether the shipped file is what the tuning sets and the embedder give now.
"""

from __future__ import annotations

import argparse
import json
import sys

from appliance.answer_cache.calibration import TRAPS_FILE
from bench.kit.paths import ROOT

SOURCES = sorted((ROOT / "tests" / "data").glob("cache_pairs_blind_*.jsonl")) + sorted((ROOT / "tests" / "data").glob("cache_seeds_*.jsonl"))
OUT = ROOT / "appliance" / TRAPS_FILE


def rows(embedders: tuple[str, ...] | None = None) -> list[dict[str, object]]:
    """Every near miss of the sources, once, with its cosine by each of `embedders` (all bundled ones)."""
    traps: list[dict[str, object]] = []
    seen: set[tuple[str, str]] = set()
    for path in SOURCES:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r["label"] != "miss" or (r["a"], r["b"]) in seen:
                continue
            seen.add((r["a"], r["b"]))
            traps.append({"a": r["a"], "b": r["b"], "kind": r["kind"], "lang": r.get("lang", "en"), "source": path.name})
    from appliance.fleet.embedders import BUNDLED

    for name in embedders or tuple(BUNDLED):
        for t, cosine in zip(traps, cosines(name, [(str(t["a"]), str(t["b"])) for t in traps]), strict=True):
            t[name] = cosine
    return traps


def cosines(embedder: str, pairs: list[tuple[str, str]]) -> list[float]:
    """Each pair's cosine by a bundled embedder, both questions spelled as the cache spells a question
    before embedding it (here and in stored vectors)."""
    from appliance.answer_cache.calibration import pair_cosines, pair_texts
    from appliance.answer_cache.service import bundled_lexicon
    from appliance.fleet.embedders import BUNDLED

    lexicon = bundled_lexicon()
    texts = pair_texts(pairs, lexicon)
    model = BUNDLED[embedder]()
    try:
        vectors = dict(zip(texts, model.embed_now(texts)))
    finally:
        model.close()
    return [round(cosine, 6) for cosine in pair_cosines(pairs, lexicon, vectors)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in rows())
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.relative_to(ROOT)}: {'as the tuning sets give it' if same else 'out of date: run python -m bench.cache_traps'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {text.count(chr(10))} traps from {len(SOURCES)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
