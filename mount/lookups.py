"""The hit rate an operator means, per namespace: a hit is a chunk opened for reading; a miss
is a lookup of a final chunk name (``<hash>.bin``) that no store of that name followed. A
store's own exists() check, its temp name and each step of its mkdir -p are not misses."""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

from kvfs import namespaces
from kvfs.index import ROOT_INO, Node
from kvfs.vllm_layout import is_chunk

# Missed names remembered, so that a store which then makes one takes its miss back.
RECENT_MISSES = 65536
# Misses noted and not yet counted, at most (see ``miss``).
UNSETTLED_MISSES = 256


class LookupCounts:
    def __init__(self) -> None:
        self._by_namespace: defaultdict[int, Counter[str]] = defaultdict(Counter)
        # (directory, name) -> (namespace, how many times it was missed)
        self._missed: OrderedDict[tuple[int, bytes], tuple[int, int]] = OrderedDict()
        self._unsettled: list[tuple[Node, bytes]] = []

    @property
    def by_namespace(self) -> defaultdict[int, Counter[str]]:
        self.settle()
        return self._by_namespace

    def hit(self, parent: Node) -> None:
        top = _namespace(parent)
        if top is not None:
            self._by_namespace[top.ino]["hit"] += 1

    def miss(self, parent: Node, name: bytes) -> None:
        """Noted now (in the receive loop, on every first-time miss: before its answer),
        counted by ``settle``: once the loop has answered what it holds, or before anything
        reads or changes the counts."""
        self._unsettled.append((parent, name))
        if len(self._unsettled) >= UNSETTLED_MISSES:
            self.settle()

    def settle(self) -> None:
        unsettled, self._unsettled = self._unsettled, []
        for parent, name in unsettled:
            self._count_miss(parent, name)

    def made(self, parent: Node, name: bytes) -> None:
        """A name appeared (created, renamed or linked there): a store, not a miss."""
        self.settle()
        top_ino, times = self._missed.pop((parent.ino, name), (0, 0))
        if times:
            self._by_namespace[top_ino]["miss"] -= times

    def _count_miss(self, parent: Node, name: bytes) -> None:
        if not is_chunk(name):  # the cheapest test first
            return
        top = _namespace(parent)
        if top is None:
            return
        self._by_namespace[top.ino]["miss"] += 1
        key = (parent.ino, name)
        _, times = self._missed.pop(key, (top.ino, 0))  # the store's own lookups come twice
        self._missed[key] = (top.ino, times + 1)
        if len(self._missed) > RECENT_MISSES:
            self._missed.popitem(last=False)


def _namespace(parent: Node) -> Node | None:
    return namespaces.top_level(parent) if parent.ino != ROOT_INO else None
