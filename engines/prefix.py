"""Which KV holder has which token prefix: a radix tree over token sequences.

A holder is anything that can hand a new request the KV of a prefix: a slot's sequence in the
KV cache, or a sequence saved in host RAM. Every holder is inserted under a model key (the model
and its adapter set), so a request never reuses KV computed under another key. Pure bookkeeping:
the engine does the copying.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

Holder = Hashable


@dataclass
class _Node:
    label: tuple[int, ...]  # the tokens on the edge into this node
    children: dict[int, _Node] = field(default_factory=dict)
    holders: set[Holder] = field(default_factory=set)  # holders whose sequence passes through


class PrefixIndex:
    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._held: dict[Holder, tuple[Hashable, tuple[int, ...]]] = {}

    def __contains__(self, holder: Holder) -> bool:
        return holder in self._held

    def tokens(self, holder: Holder) -> tuple[int, ...]:
        return self._held[holder][1]

    def key(self, holder: Holder) -> Hashable:
        return self._held[holder][0]

    def holders(self) -> list[Holder]:
        return list(self._held)

    def insert(self, key: Hashable, holder: Holder, tokens: tuple[int, ...]) -> None:
        """Records that `holder` holds `tokens` (replacing what it held before)."""
        if holder in self._held:
            self.remove(holder)
        self._held[holder] = (key, tokens)
        node = self._roots.setdefault(key, _Node(()))
        node.holders.add(holder)
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:])
                node.children[tokens[i]] = child
                child.holders.add(holder)
                return
            shared = _shared(child.label, tokens, i)
            if shared < len(child.label):
                # Split the edge where the new sequence leaves it.
                upper = _Node(child.label[:shared], {child.label[shared]: child}, set(child.holders))
                child.label = child.label[shared:]
                node.children[tokens[i]] = upper
                child = upper
            child.holders.add(holder)
            node = child
            i += shared

    def remove(self, holder: Holder) -> None:
        entry = self._held.pop(holder, None)
        if entry is None:
            return
        key, tokens = entry
        root = self._roots[key]
        root.holders.discard(holder)
        node, i = root, 0
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.holders.discard(holder)
            if not child.holders:
                del node.children[tokens[i]]
                break
            node, i = child, i + len(child.label)
        if not root.holders:
            del self._roots[key]

    def match(self, key: Hashable, tokens: tuple[int, ...]) -> dict[Holder, int]:
        """For every holder under `key`, how many leading tokens it shares with `tokens`."""
        root = self._roots.get(key)
        if root is None:
            return {}
        lengths: dict[Holder, int] = {}
        node, depth = root, 0
        while True:
            child = node.children.get(tokens[depth]) if depth < len(tokens) else None
            if child is None:
                for h in node.holders:
                    lengths.setdefault(h, depth)
                return lengths
            shared = _shared(child.label, tokens, depth)
            for h in node.holders - child.holders:  # these leave the path at this node
                lengths.setdefault(h, depth)
            if shared < len(child.label):
                for h in child.holders:
                    lengths.setdefault(h, depth + shared)
                return lengths
            node, depth = child, depth + shared


def _shared(label: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = 0
    limit = min(len(label), len(tokens) - start)
    while n < limit and label[n] == tokens[start + n]:
        n += 1
    return n
