"""The pure decisions of loading on demand (policy/residency.py): what is unloaded to make room,
when a load must wait, when it can never fit, and when an idle model's keep_alive runs out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policy.residency import Resident, expired, next_expiry, plan_load

GIB = 2**30


def r(alias: str, gib: float, busy: int = 0, last_used: float = 0.0, keep_alive_s: float | None = 300.0, pinned: bool = False) -> Resident:
    return Resident(alias, int(gib * GIB), busy, last_used, keep_alive_s, pinned)


def test_no_budget_loads_without_unloading() -> None:
    assert plan_load("c", 50 * GIB, [r("a", 40), r("b", 40)], None).evict == ()


def test_fits_in_free_memory_unloads_nothing() -> None:
    plan = plan_load("c", 2 * GIB, [r("a", 4), r("b", 4)], 10 * GIB)
    assert (plan.verdict, plan.evict) == ("load", ())


def test_unloads_least_recently_used_idle_models_first_and_no_more_than_needed() -> None:
    residents = [r("new", 3, last_used=30), r("old", 3, last_used=10), r("mid", 3, last_used=20)]
    assert plan_load("x", 4 * GIB, residents, 10 * GIB).evict == ("old",)  # 1 free + 3 >= 4
    plan = plan_load("x", 5 * GIB, residents, 10 * GIB)
    assert (plan.verdict, plan.evict) == ("load", ("old", "mid"))  # 1 + 3 + 3 >= 5: 'new' stays


def test_busy_model_is_never_unloaded_under_its_requests() -> None:
    residents = [r("busy", 6, busy=1, last_used=0), r("idle", 2, last_used=50)]
    plan = plan_load("x", 5 * GIB, residents, 9 * GIB)
    assert plan.verdict == "wait" and "busy" not in plan.evict
    assert plan_load("x", 3 * GIB, residents, 9 * GIB).evict == ("idle",)


def test_pinned_models_are_never_unloaded_for_another() -> None:
    residents = [r("pinned", 6, pinned=True), r("forever", 2, keep_alive_s=None)]
    plan = plan_load("x", 3 * GIB, residents, 10 * GIB)
    assert plan.verdict == "never" and "pinned" in plan.reason and "forever" in plan.reason


def test_a_model_larger_than_the_budget_can_never_load() -> None:
    plan = plan_load("huge", 12 * GIB, [], 10 * GIB)
    assert plan.verdict == "never" and "12.00 GiB" in plan.reason and "10.00 GiB" in plan.reason


def test_reloading_a_resident_model_does_not_count_it_twice() -> None:
    assert plan_load("a", 6 * GIB, [r("a", 6)], 8 * GIB).evict == ()


def test_keep_alive_expiry() -> None:
    residents = [r("gone", 1, last_used=0, keep_alive_s=60), r("busy", 1, busy=2, last_used=0, keep_alive_s=60),
                 r("fresh", 1, last_used=50, keep_alive_s=60), r("now", 1, last_used=0, keep_alive_s=0),
                 r("forever", 1, keep_alive_s=None), r("pinned", 1, pinned=True)]
    assert expired(residents, 61) == ("gone", "now")
    assert next_expiry(residents) == 0
    assert next_expiry([r("fresh", 1, last_used=50, keep_alive_s=60)]) == 110
    assert next_expiry([r("forever", 1, keep_alive_s=None)]) is None


residents_st = st.lists(
    st.builds(Resident, st.sampled_from("abcdefgh"), st.integers(1, 8 * GIB), st.integers(0, 2),
              st.floats(0, 1000), st.one_of(st.none(), st.floats(0, 600)), st.booleans()),
    max_size=8, unique_by=lambda x: x.alias)


@settings(max_examples=300, deadline=None)
@given(residents_st, st.integers(1, 16 * GIB), st.integers(1, 32 * GIB))
def test_a_plan_keeps_memory_within_the_budget_and_touches_only_idle_unpinned_models(residents: list[Resident], need: int, budget: int) -> None:
    plan = plan_load("z", need, residents, budget)
    by_alias = {x.alias: x for x in residents}
    for alias in plan.evict:
        assert by_alias[alias].evictable
    if plan.verdict == "load":
        kept = sum(x.bytes for x in residents if x.alias not in plan.evict)
        assert kept + need <= budget
        # The fewest LRU-first: putting back the last one evicted would no longer fit.
        if plan.evict:
            assert kept + by_alias[plan.evict[-1]].bytes + need > budget
    else:
        assert plan.evict == () and plan.reason
    if plan.verdict == "never":
        # Nothing the manager may unload, now or once idle, would make room.
        unmovable = sum(x.bytes for x in residents if x.pinned or x.keep_alive_s is None)
        assert need + unmovable > budget
