"""Which KV holder has which token prefix: a radix tree over token sequences.

A holder is anything that can hand a new request the KV of a prefix: a slot's sequence in the
KV cache, or a sequence saved in host RAM. Every holder is inserted under a key (the request's
adapter set and prefix scope, engines.interface.PrefixKey), so a request never reuses KV computed under
another key: not another adapter's, and not another scope's (another tenant's prompt, whose reuse
would show in the caller's cached-token count and its time to first token). Pure bookkeeping: the
engine does the copying. `HostCache` is the host-RAM tier every local engine shares.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engines.interface import PrefixStats

Holder = Hashable
State = TypeVar("State")


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


class HostCache(Generic[State]):
    """Sequences' KV saved in host RAM, least recently used first out under a byte budget. Each
    entry is listed in a prefix index as the holder ("host", id) under its model key, beside
    whatever else that index lists (an engine's slots), so one match finds every source of a
    prefix. What a state is (llama.cpp's bytes, MLX's per-layer caches) is the engine's business."""

    def __init__(self, index: PrefixIndex, budget_bytes: int, stats: PrefixStats) -> None:
        self.index, self.budget, self.stats = index, budget_bytes, stats
        self._entries: OrderedDict[int, tuple[State, int]] = OrderedDict()  # id -> (state, bytes), LRU first
        self._ids = itertools.count()

    def put(self, key: Hashable, tokens: tuple[int, ...], state: State, size: int, protect: int | None = None) -> None:
        """Saves `state` (holding `tokens` under `key`), evicting the least recently used entries
        to fit, never `protect` (an entry about to be restored); a state over the budget is not kept."""
        if size > self.budget:
            return
        ident = next(self._ids)
        self._entries[ident] = (state, size)
        self.index.insert(key, ("host", ident), tokens)
        stats = self.stats
        stats.host_saves += 1
        stats.host_bytes += size
        while stats.host_bytes > self.budget:
            victim = next((i for i in self._entries if i != protect), None)
            if victim is None:
                break
            self.drop(victim)
            stats.host_evictions += 1
        stats.host_entries = len(self._entries)

    def get(self, ident: int) -> State:
        """The saved state, now the most recently used."""
        self._entries.move_to_end(ident)
        return self._entries[ident][0]

    def drop(self, ident: int) -> None:
        entry = self._entries.pop(ident, None)
        if entry is not None:
            self.index.remove(("host", ident))
            self.stats.host_bytes -= entry[1]
            self.stats.host_entries = len(self._entries)
