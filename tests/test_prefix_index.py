"""The prefix index against a brute-force model, as a Hypothesis state machine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engines.prefix import PrefixIndex
from engines.scheduler import common_prefix

# A tiny alphabet makes shared prefixes, splits and exact duplicates common.
sequences = st.lists(st.integers(0, 3), max_size=12).map(tuple)
holders = st.sampled_from(["s0", "s1", "s2", "h0", "h1"])
keys = st.sampled_from(["base", "base+lora"])


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
