"""The prefix index against a brute-force model, as a Hypothesis state machine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engines.interface import GenerationRequest, PrefixKey, PrefixStats
from engines.prefix import HostCache, PrefixIndex
from engines.scheduler import common_prefix

# A tiny alphabet makes shared prefixes, splits and exact duplicates common.
sequences = st.lists(st.integers(0, 3), max_size=12).map(tuple)
holders = st.sampled_from(["s0", "s1", "s2", "h0", "h1"])
keys = st.sampled_from([PrefixKey((), "tenant:a"), PrefixKey((), "tenant:b"), PrefixKey((("lora", 1.0),), "tenant:a"), PrefixKey((), "")])


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[str, tuple[str, tuple[int, ...]]] = {}

    @rule(key=keys, holder=holders, tokens=sequences)
    def insert(self, key, holder, tokens):
        self.index.insert(key, holder, tokens)
        self.model[holder] = (key, tokens)

    @rule(holder=holders)
    def remove(self, holder):
        self.index.remove(holder)
        self.model.pop(holder, None)

    @rule(key=keys, tokens=sequences)
    def match_agrees_with_brute_force(self, key, tokens):
        expected = {h: common_prefix(t, tokens) for h, (k, t) in self.model.items() if k == key}
        assert self.index.match(key, tokens) == expected

    @invariant()
    def holders_agree(self):
        assert sorted(self.index.holders()) == sorted(self.model)
        for h, (k, t) in self.model.items():
            assert self.index.tokens(h) == t and self.index.key(h) == k


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestIndex = IndexMachine.TestCase


def test_keys_never_mix():
    index = PrefixIndex()
    index.insert("base", "s0", (1, 2, 3))
    assert index.match("base+lora", (1, 2, 3)) == {}
    assert index.match("base", (1, 2, 9)) == {"s0": 2}


def test_scopes_never_mix():
    """Tenant A's prompt (a secret in its system prompt) is in a slot and in host RAM: tenant B's
    right guess and wrong guess match nothing, so B's reuse, and what it reports, is the same."""
    secret, right, wrong = (5, 6, 7, 8, 9), (5, 6, 7, 8, 9, 1), (5, 6, 3, 3, 3, 1)
    a, b = GenerationRequest("a", secret, 1, prefix_scope="tenant:a"), GenerationRequest("b", right, 1, prefix_scope="tenant:b")
    index = PrefixIndex()
    host: HostCache[str] = HostCache(index, 100, PrefixStats())
    index.insert(a.prefix_key, ("slot", 0), secret)
    host.put(a.prefix_key, secret, "kv", 10)
    assert index.match(b.prefix_key, right) == index.match(b.prefix_key, wrong) == {}
    assert index.match(a.prefix_key, right) == {("slot", 0): 5, ("host", 0): 5}  # the same tenant still reuses it
    assert index.match(GenerationRequest("c", right, 1).prefix_key, right) == {}  # nor does the unscoped (shared) scope
    shared = GenerationRequest("s", secret, 1).prefix_key
    index.insert(shared, ("slot", 1), secret)
    assert index.match(PrefixKey((), ""), wrong) == {("slot", 1): 2}


def test_a_request_key_is_its_adapters_and_its_scope():
    plain = GenerationRequest("r", (1,), 1, adapters=(("x", 0.0),), prefix_scope="tenant:a")
    assert plain.prefix_key == PrefixKey((), "tenant:a") != GenerationRequest("r", (1,), 1, prefix_scope="tenant:b").prefix_key
    assert GenerationRequest("r", (1,), 1, adapters=(("x", 1.0),)).prefix_key == PrefixKey((("x", 1.0),), "")
