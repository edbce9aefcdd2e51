"""The economics bench's arithmetic (bench/economics_report.py), pure."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.economics_report import Outcome, PairFigures, cache_figures, figures, manipulated, random_line, targets
from bench.kit.stats import percentile


def outcome(i: int, correct: bool, cost: int, *, family: str = "factual", role: str = "oneoff", where: str = "m",
            chosen: int | None = None, base: str | None = None, latency: float = 1.0) -> Outcome:
    return Outcome(f"r{i}", family, role, correct, cost, latency, where, chosen, base)


def test_figures_use_the_ledger_when_given_and_split_by_family() -> None:
    rows = [outcome(0, True, 10, family="code"), outcome(1, False, 10, family="code"), outcome(2, True, 5, where="cache")]
    f = figures("x", rows)
    assert f.accuracy == pytest.approx(2 / 3) and f.cost_nanos == 25
    assert dict((name, acc) for name, acc, _ in f.by_family) == {"code": 0.5, "factual": 1.0}
    assert dict(f.answered_by) == {"m": 2, "cache": 1}
    assert figures("x", rows, ledger_nanos=99).cost_nanos == 99


def test_the_random_line_joins_the_cheapest_tier_and_the_frontier() -> None:
    cheap = figures("s", [outcome(0, False, 10), outcome(1, True, 10)])  # 50% at 20
    top = figures("f", [outcome(0, True, 100), outcome(1, True, 100)])  # 100% at 200
    assert random_line(cheap, top, 20) == pytest.approx(0.5)
    assert random_line(cheap, top, 110) == pytest.approx(0.75)
    assert random_line(cheap, top, 1000) == pytest.approx(1.0)  # no mix costs more than the frontier alone


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=50))
def test_percentiles_lie_within_the_values(values: list[float]) -> None:
    for method in ("nearest", "linear"):  # the economics report's latencies, the other benches' figures
        assert min(values) <= percentile(values, 0.95, method=method) <= max(values)
        assert percentile(values, 1.0, method=method) == max(values) and percentile(values, 0.0, method=method) == min(values)


def test_cache_figures_count_traps_and_rewordings_served_from_the_cache() -> None:
    rows = [outcome(0, True, 1, role="first"), outcome(1, True, 0, role="reword", where="cache"), outcome(2, True, 1, role="repeat"),
            outcome(3, False, 0, role="trap", where="cache"), outcome(4, True, 1, role="trap")]
    c = cache_figures(rows)
    assert (c.rewordings, c.rewordings_served, c.traps, c.traps_served) == (2, 1, 2, 1)
    assert c.trap_rate == 0.5 and c.reword_rate == 0.5


def test_a_rewording_has_something_to_serve_only_after_its_group_was_answered_right() -> None:
    """The cache serves verified answers only: a rewording of a question a model got wrong is rightly asked again."""
    rows = [outcome(0, False, 1, role="first"), outcome(1, True, 1, role="reword"),  # nothing verified yet: asked, now right
            outcome(2, True, 0, role="repeat", where="cache"),  # r1's right answer was verified: servable, served
            outcome(3, True, 1, role="first"), outcome(4, True, 0, role="reword", where="cache"),
            outcome(5, True, 1, role="reword"),  # servable, not served
            outcome(6, True, 0, role="first", where="cache"), outcome(7, True, 1, role="reword")]  # a cache answer verifies nothing
    groups = {"r0": "a", "r1": "a", "r2": "a", "r3": "b", "r4": "b", "r5": "b", "r6": "c", "r7": "c"}
    c = cache_figures(rows, groups)
    assert (c.rewordings, c.rewordings_served, c.servable, c.servable_served) == (5, 2, 3, 2)


def test_an_adversarial_prompt_is_manipulation_only_when_its_route_chose_a_dearer_tier() -> None:
    rows = [outcome(0, True, 1, chosen=0), outcome(1, True, 1, chosen=1, base="r0"), outcome(2, True, 1, chosen=0, base="r0"),
            outcome(3, True, 1, chosen=None, base="r0")]
    assert manipulated(rows) == [("r1", 1, 0)]
    # a family tier that answered counts below every route tier: escalating past it to the route is dearer
    family = [outcome(0, True, 1, chosen=-1), outcome(1, True, 1, chosen=2, base="r0"), outcome(2, True, 1, chosen=-1, base="r0")]
    assert manipulated(family) == [("r1", 2, -1)]


def test_targets_name_what_is_missed() -> None:
    cheap = figures("s", [outcome(0, False, 10), outcome(1, True, 10)])
    top = figures("f", [outcome(0, True, 100), outcome(1, True, 100)])
    good = figures("r", [outcome(0, True, 30), outcome(1, True, 30)])
    held_out = PairFigures("pairs.jsonl", 200, 3, 100, 70)  # 1.5% of traps, 70% of rewordings: met
    ok = targets(good, good, cheap, top, held_out, [])
    assert ok.misses() == [] and "routing alone 100.0%" in ok.line() and "traps served 1.5%" in ok.line()
    dear = figures("r", [outcome(0, True, 90), outcome(1, True, 90)])
    missed = targets(dear, dear, cheap, top, PairFigures("pairs.jsonl", 200, 5, 100, 70),
                     [outcome(0, True, 1, chosen=0), outcome(1, True, 1, chosen=2, base="r0")])
    assert len(missed.misses()) == 4 and "held-out pairs (pairs.jsonl)" in missed.misses()[2]
    assert len(targets(good, good, cheap, top, PairFigures("p", 200, 0, 100, 59), []).misses()) == 1  # too few rewordings served


def test_a_kept_run_moved_without_its_server_data_keeps_the_cache_off_passes_only(tmp_path: Path) -> None:
    """bench/economics.py's work folder carried to another machine as state.json and outcomes.jsonl:
    the keys are void there, and an unfinished cache pass starts over (its cache is gone)."""
    from bench.economics import Kept

    identity = {"split": "s", "sha256": "x", "route": "auto", "config": ""}
    kept = Kept(tmp_path, identity)
    kept.save_keys({"t1": "sk-old"})
    for name in ("whole", "routed"):
        kept.add(name, outcome(0, True, 5))
        kept.charge(name, 5)
    (tmp_path / "outcomes.jsonl").open("a").write('{"pass": "whole", "id": "r1", "fam')  # a line cut by a kill
    moved = Kept(tmp_path, identity)
    moved.forget_server({"whole"})
    again = Kept(tmp_path, identity)
    assert again.keys() == {} and again.outcomes("whole") == {} and again.charged("whole") == 0
    assert list(again.outcomes("routed")) == ["r0"] and again.charged("routed") == 5
    with pytest.raises(SystemExit, match="another split"):
        Kept(tmp_path, {**identity, "split": "t"})


def test_a_tier_alone_is_reused_only_from_the_same_split_and_model_settings(tmp_path: Path) -> None:
    import json

    from bench.economics import Kept, reuse

    config = ('[[models]]\nalias = "small"\npath = "/m/small.gguf"\nslots = 2\n\n[[models]]\nalias = "big"\npath = "/m/big.gguf"\nslots = 2\n')
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    records = [{"id": f"r{i}"} for i in range(3)]
    (earlier / "state.json").write_text(json.dumps({"identity": {"split": "evaluation", "sha256": "abc", "route": "auto", "config": config},
                                                    "keys": {}, "charged": {"small": 30, "big": 300}}))
    rows = [{"pass": tier, **outcome(i, i != 1, cost, where=tier).__dict__} for tier, cost in (("small", 10), ("big", 100)) for i in range(3)]
    (earlier / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # now: an adapter on the small model (its requests alone use none), the big one with other settings, a new tier
    now = config.replace('slots = 2\n\n[[models]]\nalias = "big"\npath = "/m/big.gguf"\nslots = 2',
                         'slots = 2\n[[models.adapters]]\nname = "d"\npath = "/a/d.gguf"\n\n[[models]]\nalias = "big"\npath = "/m/big.gguf"\nslots = 4')
    identity = {"split": "evaluation", "sha256": "abc", "route": "auto", "config": now}
    (tmp_path / "now").mkdir()
    kept = Kept(tmp_path / "now", identity)
    reuse(kept, earlier, identity, ["small", "small:d", "big"], records)
    assert [o.correct for o in kept.outcomes("small").values()] == [True, False, True] and kept.charged("small") == 30
    assert kept.outcomes("big") == {} and kept.outcomes("small:d") == {}
    again = Kept(tmp_path / "now", identity)  # kept on disk, as a run started again would find it
    assert len(again.outcomes("small")) == 3 and again.charged("small") == 30
    with pytest.raises(SystemExit, match="another split"):
        reuse(kept, earlier, {**identity, "sha256": "def"}, ["small"], records)
