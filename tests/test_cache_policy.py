"""The semantic cache's decisions as plain functions, and its quality on the labelled pairs with
the real embedder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.answer_cache import (
    AskJudge,
    Cacheable,
    CachePolicy,
    Candidate,
    Hit,
    Miss,
    NotCacheable,
    classify,
    judge_candidates,
    normalise,
    threshold_for,
)
from policy.answer_guards import NO_LEXICON, Comparison, Lexicon, compare, lexicon_from_vocab, spelled

VOCAB = Path(__file__).resolve().parent.parent / "appliance" / "data" / "all-minilm-l6-v2" / "vocab.txt"
LEXICON = lexicon_from_vocab(VOCAB.read_text(encoding="utf-8").splitlines())

POLICY = CachePolicy(similarity_threshold=0.8, judge_band=0.6)


def _classify(**overrides: object) -> Cacheable | NotCacheable:
    args: dict[str, object] = dict(
        tenant="acme", role="dev", model="m", model_version="v1",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is DNS?"}],
        settings={"max_tokens": 64}, temperature=0.0, n=1, wants_logprobs=False, has_tools=False, policy=POLICY,
    )
    args.update(overrides)
    return classify(**args)  # type: ignore[arg-type]


def test_the_bucket_is_tenant_role_model_version_and_prompt_version() -> None:
    base = _classify()
    assert isinstance(base, Cacheable) and base.question == "What is DNS?"
    variants = [
        _classify(tenant="zeta"), _classify(role="admin"), _classify(model="m2"), _classify(model_version="v2"),
        _classify(messages=[{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "What is DNS?"}]),
        _classify(messages=[{"role": "user", "content": "What is DNS?"}]),
        _classify(settings={"max_tokens": 65}),
    ]
    keys = {v.bucket.key for v in variants if isinstance(v, Cacheable)}
    assert len(keys) == len(variants) and base.bucket.key not in keys
    # the question itself is not part of the bucket
    other = _classify(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain DNS"}])
    assert isinstance(other, Cacheable) and other.bucket.key == base.bucket.key


def test_what_is_not_cached() -> None:
    assert _classify(temperature=1.0) == NotCacheable("temperature")
    assert isinstance(_classify(temperature=None), Cacheable)  # set by nobody: the server's usual answer
    assert _classify(n=2) == NotCacheable("n")
    assert _classify(wants_logprobs=True) == NotCacheable("logprobs")
    assert _classify(has_tools=True) == NotCacheable("tools")
    assert isinstance(_classify(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]), NotCacheable)
    assert _classify(policy=CachePolicy(enabled=False)) == NotCacheable("disabled")


@given(st.text(min_size=1, max_size=40))
def test_normalising_is_idempotent(text: str) -> None:
    assert normalise(normalise(text)) == normalise(text)


def test_normalising_ignores_case_space_and_final_punctuation() -> None:
    assert normalise("  What is   DNS?? ") == normalise("what is dns") == "what is dns"


# Pairs written for these tests, in other wordings than tests/data/cache_pairs.jsonl.
@pytest.mark.parametrize(("a", "b", "reason"), [
    # negations and opposites, in the lists or by a negating prefix
    ("Which foods are safe for dogs?", "Which foods are not safe for dogs?", "negation"),
    ("Can I drink alcohol while taking antibiotics?", "Can't I drink alcohol while taking antibiotics?", "negation"),
    ("Which metals are magnetic?", "Which metals are non-magnetic?", "negation"),
    ("Is it legal to own a pet fox?", "Is it illegal to own a pet fox?", "negation"),
    ("Is coffee good for your heart?", "Is coffee bad for your heart?", "opposite"),
    ("Which foods raise cholesterol?", "Which foods lower cholesterol?", "opposite"),
    ("How do I tighten a loose screw?", "How do I loosen a tight screw?", "opposite"),
    ("How do I turn on dark mode in Slack?", "How do I turn off dark mode in Slack?", "opposite"),
    ("What foods help you fall asleep?", "What foods keep you awake?", "opposite"),
    ("How do I upload a file?", "How do I download a file?", "opposite"),
    # numbers, dates, quantifiers, names
    ("Convert 5 miles to km", "Convert 50 miles to km", "number"),
    ("Is it cold at ten degrees?", "Is it cold at five degrees?", "number"),
    ("What's open on Monday?", "What's open on Sunday?", "date"),
    ("What should I pack for Oslo in winter?", "What should I pack for Oslo in autumn?", "date"),
    ("Do all birds fly?", "Do some birds fly?", "opposite"),
    ("Which countries run only on solar power?", "Which countries run on solar power?", "scope"),
    ("What are the cheapest flights to Rome?", "What are flights to Rome?", "scope"),
    ("What is the capital of Austria?", "What is the capital of Australia?", "entity"),
    ("How do I sort a list in Python?", "how do I sort a list in rust", "entity"),
    ("Who founded Amazon?", "Who founded Tesla?", "entity"),
    # another group or place in the same slot, lower case or not a name
    ("What vaccines do puppies need?", "What vaccines do kittens need?", "swap"),
    ("How many hours should toddlers sleep?", "How many hours should teenagers sleep?", "swap"),
    ("how long is maternity leave in germany", "how long is maternity leave in france", "swap"),
    ("How do I cook quinoa?", "How do I cook couscous?", "swap"),
    ("Can pregnant women drink coffee?", "Can breastfeeding women drink coffee?", "swap"),
    # a narrower question: a phrase the other side lacks
    ("What are common symptoms of diabetes?", "What are common symptoms of diabetes in cats?", "scope"),
    ("How do I file taxes?", "How do I file taxes as a freelancer?", "scope"),
    ("How do I get a mortgage?", "How do I get a mortgage if I'm self-employed?", "scope"),
    # the same words turned round, another kind of answer
    ("How do I convert dollars to euros?", "How do I convert euros to dollars?", "scope"),
    ("Is whole milk healthier than skim milk?", "Is skim milk healthier than whole milk?", "scope"),
    ("When was the Eiffel Tower built?", "Where was the Eiffel Tower built?", "question"),
    # which time, which unit, and negations said as a verb or a conjunction (tests/data/cache_pairs_tune2.jsonl)
    ("Is the support desk staffed at 8 am?", "Is the support desk staffed at 8 pm?", "date"),
    ("How many vacation days did I use this year?", "How many vacation days did I use last year?", "date"),
    ("Is the office open on Thanksgiving Day?", "Is the office open on the day after Thanksgiving?", "date"),
    ("How long does it take to drive 100 miles at 60 mph?", "How long does it take to drive 100 kilometers at 60 mph?", "number"),
    ("What is 72 degrees Fahrenheit in Celsius?", "What is 72 degrees Celsius in Fahrenheit?", "number"),
    ("How do I show hidden files in Finder?", "How do I stop showing hidden files in Finder?", "negation"),
    ("Can my manager read my messages if I use private channels?", "Can my manager read my messages unless I use private channels?",
     "negation"),
    ("What leave is offered to birth mothers?", "What leave is offered to adoptive parents?", "swap"),
    # a modifier on one side narrows the thing (tests/data/cache_pairs_tune3.jsonl), and opposites by prefix
    ("How much water should a pregnant woman drink daily?", "How much water should a woman drink daily?", "scope"),
    ("How do I export data from Salesforce?", "How do I export contact data from Salesforce?", "scope"),
    ("What happens if I underpay my quarterly taxes?", "What happens if I overpay my quarterly taxes?", "opposite"),
    ("How do I deny an access request?", "How do I grant an access request?", "opposite"),
    ("What should I do if my dog hardly eats?", "What should I do if my dog eats?", "negation"),
    # from the first held-out set, a tuning set since: opposites said in the other order, give / receive,
    # full / part time, and the same two measures turned round an "in"
    ("Why is my unit test passing locally but failing in CI?", "Why is my unit test failing locally but passing in CI?", "opposite"),
    ("Do I pay tax on money I receive as a gift?", "Do I pay tax on money I give as a gift?", "opposite"),
    ("Does the parental leave policy apply to full-time staff?", "Does the parental leave policy apply to part-time staff?", "opposite"),
    ("How many teaspoons are in a tablespoon?", "How many tablespoons are in a teaspoon?", "scope"),
    ("Which city has the most museums?", "Which city has the most famous museums?", "scope"),
])
def test_near_misses_are_caught(a: str, b: str, reason: str) -> None:
    assert compare(a, b, LEXICON).guard == reason
    assert compare(b, a, LEXICON).guard is not None


@pytest.mark.parametrize(("a", "b", "differs"), [
    ("What is the capital of France?", "Tell me France's capital", ()),
    ("How can I reset my password?", "What is the way to reset my password", ()),
    ("Who painted the Mona Lisa?", "The Mona Lisa was painted by whom?", ()),
    ("How do I convert a string to an integer in Java?", "In Java, what's the way to parse a String into an int?",
     ("convert", "parse")),
    ("How can I lower my blood pressure?", "How can I reduce my blood pressure?", ("lower", "reduce")),
    ("How do I make my Wi-Fi faster?", "How do I make my wifi faster?", ()),
    ("How do I set an env var?", "How do I set an environment variable?", ()),
    ("What is the difference between a virus and a bacterium?", "How do viruses differ from bacteria?", ()),
    ("Why do leaves change colour in autumn?", "Why do leaves change color in autumn?", ()),
    ("How many litres of water should I drink each day?", "How many litres of water should I drink daily?", ()),
    ("What is compound interest?", "Can you explain how compound interest works?", ("works",)),
    ("Does the store offer a 10 percent discount?", "Does the store offer a 10% discount?", ()),
    ("Thanks in advance, how do I map a network drive?", "How do I map a network drive?", ()),
    ("How do I get rid of hiccups?", "What's a good way to stop hiccups?", ("good", "rid", "stop")),
    ("Can I get a refund after 30 days?", "Is a refund still possible once 30 days have passed?", ("after", "once", "passed", "possible", "still")),
    ("How many teaspoons are in a tablespoon?", "tablespoon = how many teaspoons?", ()),
    ("How do I make a cup of pour-over coffee?", "Walk me through brewing pour-over coffee.", ("brewing", "cup", "through", "walk")),
    # how many days / how much leave / how long, how many times / how often: one kind of answer each
    ("How long do I rest a steak after grilling it?", "After grilling, how many minutes should a steak rest?", ("long", "many", "minutes")),
    ("How often should I water a cactus?", "How many times a month should I water a cactus?", ("many", "month", "often", "times")),
    # "most" before an adjective is a superlative, "the most recent" is "the last"; a demonym is its place; OK is no name
    ("Which country has the largest population in South America?", "What is South America's most populous country?",
     ("largest", "population", "populous")),
    ("How do I undo my last Git commit?", "How can I undo the most recent commit in Git?", ()),
    ("What is the longest river in Africa?", "Which African river is the longest one?", ()),
    ("Can you freeze fresh basil?", "Is it OK to freeze fresh basil?", ()),
])
def test_rewordings_pass_the_guards(a: str, b: str, differs: tuple[str, ...]) -> None:
    assert compare(a, b, LEXICON) == Comparison(None, differs)


@pytest.mark.parametrize(("typo", "right"), [
    ("How do I recieve payments?", "How do I receive payments?"),  # two letters swapped
    ("What is the diffrence between a lake and a pond?", "What is the difference between a lake and a pond?"),  # a vowel dropped
    ("How do I seperate eggs?", "How do I separate eggs?"),  # a vowel for a vowel
    ("How do I change my adress?", "How do I change my address?"),  # a doubled letter dropped
    ("How do I boil an egg untill it is hard?", "How do I boil an egg until it is hard?"),  # a letter doubled
])
def test_typos_are_spelled_right_and_pass_the_guards(typo: str, right: str) -> None:
    assert spelled(typo, LEXICON) == right
    assert compare(typo, right, LEXICON) == Comparison(None)


def test_spelling_leaves_known_words_names_and_unlikely_slips_alone() -> None:
    lexicon = Lexicon({"vegas": 900, "receive": 100, "ethanol": 800})
    assert spelled("Vegans recieve ethanol", lexicon) == "Vegans receive ethanol"  # capitalised: a name, not a slip
    assert spelled("vegans methanol", lexicon) == "vegans methanol"  # n dropped is no common slip; the first letter is never one
    assert spelled("recieve", NO_LEXICON) == "recieve"
    # both spelled right: two words, not a slip
    assert compare("What is the capital of Austria?", "What is the capital of Australia?", lexicon).guard == "entity"
    assert compare("How toxic is ethanol?", "How toxic is methanol?", lexicon).guard == "swap"


def test_a_pair_that_differs_in_a_word_needs_the_full_threshold() -> None:
    policy = CachePolicy(similarity_threshold=0.8, same_words_relief=0.05, judge_band=0.8)
    assert threshold_for(Comparison(None, ("works",)), policy) == 0.8
    assert threshold_for(Comparison(None), policy) == pytest.approx(0.75)
    asked = "Can you explain how compound interest works?"
    stored = "What is compound interest?"
    assert judge_candidates(asked, [_candidate(0.78, question=stored)], 1000.0, policy) == Miss("similarity")
    assert judge_candidates("What's compound interest", [_candidate(0.78, question=stored)], 1000.0, policy) == Hit(1, 0.78, judged=False)


def _candidate(similarity: float, state: str = "verified", question: str = "How do I reset my password?", age: float = 0.0) -> Candidate:
    return Candidate(1, question, similarity, state, 1000.0 - age)


def test_judging_candidates() -> None:
    asked = "What is the way to reset my password?"
    assert judge_candidates(asked, [_candidate(0.9)], 1000.0, POLICY) == Hit(1, 0.9, judged=False)
    assert judge_candidates(asked, [_candidate(0.7)], 1000.0, POLICY) == AskJudge(_candidate(0.7))
    assert judge_candidates("How do I reset my password on Android?", [_candidate(0.9)], 1000.0, POLICY) == Miss("guard:entity")
    assert judge_candidates(asked, [_candidate(0.5)], 1000.0, POLICY) == Miss("similarity")
    assert judge_candidates(asked, [_candidate(0.99, "rejected")], 1000.0, POLICY) == Miss("rejected")
    assert judge_candidates(asked, [_candidate(0.99, "stale")], 1000.0, POLICY) == Miss("stale")
    old = _candidate(0.99, age=POLICY.freshness_s + 1)
    assert judge_candidates(asked, [old], 1000.0, POLICY) == Miss("stale")
    assert judge_candidates("How do I reset my password in 2 steps?", [_candidate(0.95)], 1000.0, POLICY) == Miss("guard:number")
    unverified = _candidate(0.9, "unverified")
    assert isinstance(judge_candidates(asked, [unverified], 1000.0, POLICY), Hit)
    strict = CachePolicy(similarity_threshold=0.8, judge_band=0.6, serve_unverified=False)
    assert judge_candidates(asked, [unverified], 1000.0, strict) == Miss("stale")


def test_the_labelled_set_at_the_default_threshold() -> None:
    """False hits and paraphrase recall on the report half, with the real embedder and guards
    (measured: recall 67.6%, false hits 1.5%, typo pairs served 95%; asserted with margins)."""
    from bench import cache_quality

    from appliance.config.settings import CacheSettings

    pairs = cache_quality.load_pairs()
    assert len(pairs) >= 400 and sum(p.hit for p in pairs) >= 200
    cache_quality.embed_pairs(pairs)
    report = [p for p in pairs if p.split == "report"]
    policy = CachePolicy()
    rule = {"threshold": CacheSettings().similarity_threshold, "guards": True, "relief": policy.same_words_relief}
    recall, false_hits = cache_quality.rates(report, **rule)
    assert false_hits <= 0.02, false_hits
    assert recall >= 0.62, recall
    assert cache_quality.by_kind(report, **rule)["typo"] >= 0.9
    # without the guards the same threshold serves near-misses
    assert cache_quality.rates(report, threshold=CacheSettings().similarity_threshold, guards=False)[1] > 0.3


@pytest.mark.parametrize(("name", "most_traps", "least_recall"), [("tune2", 0.02, 0.62), ("tune3", 0.06, 0.62), ("heldout", 0.02, 0.55)])
def test_the_later_tuning_sets_at_the_defaults(name: str, most_traps: float, least_recall: float) -> None:
    """tests/data/cache_pairs_{tune2,tune3,heldout}.jsonl (300, 240 and 322 pairs written apart from the
    guards, then tuned on; the last was the held-out set until 2026-12-04): measured traps served 0/150,
    4/120 (3.3%) and 1/193 (0.5%), paraphrases 67%, 68% and 58%; asserted with margins."""
    from bench import cache_quality

    pairs = cache_quality.load_pairs(Path(__file__).resolve().parent / "data" / f"cache_pairs_{name}.jsonl")
    cache_quality.embed_pairs(pairs, augment=False)
    policy = CachePolicy()
    rule = {"threshold": policy.similarity_threshold, "guards": True, "relief": policy.same_words_relief}
    recall, false_hits = cache_quality.rates(pairs, **rule)
    assert false_hits <= most_traps, false_hits
    assert recall >= least_recall, recall
