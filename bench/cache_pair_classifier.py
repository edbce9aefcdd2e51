"""Would a small classifier trained on labelled question pairs tell rewordings from near misses
better than the judge, on a pair set it was not trained on? Issue 41's "an equivalence classifier"
candidate, measured on tuning sets only (never a sealed one).

Each pair is read as the cache reads it: multilingual-e5-small vectors of both questions (the
`e5-small` embedder), the guards' verdict, each question's language. Features: the vectors'
product and absolute difference, the cosine, which guard flagged the pair, whether its content words
differ, whether it switches language, and the length difference. A logistic regression or a
one-hidden-layer network (PyTorch, the `train` extra) learns P(same answer) on every set but two;
the cut is set on the traps of the third set (`--calibrate`) the way the cache sets it (one-sided
Clopper-Pearson under `--bound`, policy/answer_bound.py), with the hard guards (negation, number,
date) refusing first; figures are read on the fourth (`--test`), per language.

    .venv/bin/python -m bench.cache_pair_classifier --calibrate sealed4 --test sealed5
    .venv/bin/python -m bench.cache_pair_classifier --calibrate sealed5 --test sealed4
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.answer_cache import language
from appliance.answer_cache.service import bundled_lexicon
from appliance.fleet.embedders import bundled_e5
from bench.kit.paths import ROOT
from policy.answer_bound import cut_for
from policy.answer_cache import SOFT_GUARDS
from policy.answer_guards import compare, spelled
from policy.answer_negation import negations_differ

GUARDS = ("entity", "swap", "scope", "number", "date", "negation", "opposite", "question")
LANGUAGES = ("en", "pt", "mixed")


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    hit: bool
    kind: str
    set: str  # the file it came from
    language: str  # en, pt or mixed (a set's language)
    guard: str | None
    differs: bool
    crossed: bool  # the two questions are detected in different languages
    hard: bool  # a guard no judge may overrule refuses it


def set_language(name: str, row: dict) -> str:
    tag = row.get("lang") or ""
    if "mixed" in name or tag == "pt-en":
        return "mixed"
    return "pt" if tag.startswith("pt") or "_pt" in name else "en"


def load() -> list[Pair]:
    """Every tuning pair set under tests/data (the sealed ones are compressed elsewhere and never read)."""
    lexicon, languages = bundled_lexicon(), language.load()
    out = []
    for path in sorted((ROOT / "tests" / "data").glob("cache_pairs*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            la, lb = languages.of(r["a"]), languages.of(r["b"])
            c = compare(r["a"], r["b"], lexicon, count_negators=False)
            hard = (c.guard is not None and c.guard not in SOFT_GUARDS) or negations_differ(r["a"], la, r["b"], lb)
            out.append(Pair(r["a"], r["b"], r["label"] == "hit", r.get("kind", ""), path.stem, set_language(path.name, r),
                            c.guard, bool(c.differs), la != lb, hard))
    return out


def features(pairs: list[Pair], vectors: dict[str, np.ndarray]) -> np.ndarray:
    a = np.stack([vectors[p.a] for p in pairs])
    b = np.stack([vectors[p.b] for p in pairs])
    flags = np.array([[float(p.guard == g) for g in GUARDS] + [float(p.differs), float(p.crossed),
                      abs(len(p.a) - len(p.b)) / max(len(p.a), len(p.b), 1)] for p in pairs], dtype=np.float32)
    return np.hstack([a * b, np.abs(a - b), flags, (a * b).sum(1, keepdims=True)]).astype(np.float32)


def fit(x: np.ndarray, y: np.ndarray, hidden: int, seed: int = 0, epochs: int = 300):
    import torch

    torch.manual_seed(seed)
    xt, yt = torch.tensor(x), torch.tensor(y, dtype=torch.float32)
    layers = [torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)] if hidden else [torch.nn.Linear(x.shape[1], 1)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(xt).squeeze(1), yt).backward()
        opt.step()
    return lambda z: torch.sigmoid(model(torch.tensor(z)).squeeze(1)).detach().numpy()


def embed(texts: list[str], cache: Path | None) -> dict[str, np.ndarray]:
    """Each text's vector as the cache makes it (spelled, then e5-small), from `cache` where it holds them all."""
    if cache is not None and cache.exists():
        stored = np.load(cache)
        if list(stored["texts"]) == texts:
            return dict(zip(texts, stored["rows"]))
    embedder, lexicon = bundled_e5(), bundled_lexicon()
    try:
        rows = np.concatenate([embedder.embed_now([spelled(t, lexicon) for t in texts[i:i + 64]]) for i in range(0, len(texts), 64)])
    finally:
        embedder.close()
    if cache is not None:
        np.savez(cache, texts=np.array(texts), rows=rows)
    return dict(zip(texts, rows))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores, kind="stable")] = np.arange(len(scores))
    pos = labels.astype(bool)
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 - 1) / 2) / (n1 * n0)) if n1 and n0 else math.nan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", default="sealed4", help="the set (a part of its file name) whose traps set the cut")
    p.add_argument("--test", default="sealed5", help="the set the figures are read on")
    p.add_argument("--bound", type=float, default=0.02)
    p.add_argument("--hidden", default="0,64,256", help="hidden units to try (0: logistic regression)")
    p.add_argument("--vectors", type=Path, help="an .npz of the pairs' vectors: read if it exists, else written (embedding takes minutes)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    pairs = load()
    texts = sorted({t for x in pairs for t in (x.a, x.b)})
    vectors = embed(texts, args.vectors)
    train = [x for x in pairs if args.calibrate not in x.set and args.test not in x.set]
    results: dict[str, dict] = {}
    print(f"{len(train)} training pairs; cut on {args.calibrate}'s traps at {args.bound}; read on {args.test}")
    for hidden in (int(h) for h in args.hidden.split(",")):
        predict = fit(features(train, vectors), np.array([x.hit for x in train], dtype=np.float32), hidden)
        row = {}
        for lang in LANGUAGES:
            cal = [x for x in pairs if args.calibrate in x.set and x.language == lang]
            test = [x for x in pairs if args.test in x.set and x.language == lang]
            if not cal or not test:
                continue
            # a pair a hard guard refuses is never served, whatever the classifier says
            cal_scores = np.where([x.hard for x in cal], -math.inf, predict(features(cal, vectors)))
            test_scores = np.where([x.hard for x in test], -math.inf, predict(features(test, vectors)))
            cut = cut_for([s for s, x in zip(cal_scores, cal) if not x.hit], args.bound)
            labels = np.array([x.hit for x in test])
            served = test_scores > cut.score
            row[lang] = {"auc": round(auc(np.nan_to_num(test_scores, neginf=-1.0), labels), 3),
                         "traps_served": f"{int(served[~labels].sum())}/{int((~labels).sum())}",
                         "rewordings_served": f"{int(served[labels].sum())}/{int(labels.sum())}",
                         "cut": None if math.isinf(cut.score) else round(float(cut.score), 3)}
        results[str(hidden)] = row
        print(f"hidden {hidden}: " + " | ".join(
            f"{lang}: AUC {r['auc']}, traps {r['traps_served']}, rewordings {r['rewordings_served']}" for lang, r in row.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "results": results}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
