"""The hit rate an operator means, per namespace: a hit is a chunk opened for reading; a miss
is a lookup of a final chunk name (``<hash>.bin``) that no store of that name followed. A
store's own exists() check, its temp name and each step of its mkdir -p are not misses."""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable

from kvfs import namespaces
from kvfs.index import ROOT_INO, Node
from kvfs.vllm_layout import is_chunk

# Missed names remembered, so that a store which then makes one takes its miss back.
RECENT_MISSES = 65536
# Misses noted and not yet counted, at most (see ``miss``).
UNSETTLED_MISSES = 256
# Directories whose misses are answered in C, at most (``FastMisses``); past it they start over.
FAST_DIRS = 65536


class LookupCounts:
    def __init__(self, resolve: Callable[[int], Node | None]) -> None:
        """``resolve``: a directory's node by its inode (the index's)."""
        self._resolve = resolve
        self._by_namespace: defaultdict[int, Counter[str]] = defaultdict(Counter)
        # (directory, name) -> (namespace, how many times it was missed)
        self._missed: OrderedDict[tuple[int, bytes], tuple[int, int]] = OrderedDict()
        # (directory, name) of misses answered and not yet counted
        self.unsettled: list[tuple[int, bytes]] = []

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
        counted by ``settle``: once the loop has answered all it holds, or before anything
        reads or changes the counts."""
        self.unsettled.append((parent.ino, name))
        if len(self.unsettled) >= UNSETTLED_MISSES:
            self.settle()

    def settle(self) -> None:
        for parent_ino, name in self.unsettled:
            parent = self._resolve(parent_ino)
            if parent is not None:
                self._count_miss(parent, name)
        self.unsettled.clear()  # (in place: FastMisses appends to it)

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


class FastMisses:
    """First-time misses that the kernel session answers in C, the interpreter untouched
    (``_dev_read.answer_miss``): a LOOKUP in a directory of ``dirs`` of a name its children
    lack. They are the misses ``NameRequests._lookup`` answers, with the same negative entry
    (``timeout``), noted in the same list for the hit rate, timed into the same latencies.

    A directory joins ``dirs`` as Python answers a miss in it. Never the root (the control
    directory is not among its children), and none on a shared mount, where a name the index
    lacks may be on the backing store (the operations then offer no FastMisses). Its children
    dict is the index's own, never replaced: a name made later is found there. Inodes are never
    reused, so a removed directory's entry answers only for a directory without names."""

    def __init__(
        self, counts: LookupCounts, observe: Callable[[float], None], timeout: float
    ) -> None:
        self.dirs: dict[int, dict[bytes, Node]] = {}
        self.noted = counts.unsettled
        self.timeout = timeout
        self._counts = counts
        self._observe = observe

    def register(self, parent: Node) -> None:
        if parent.ino == ROOT_INO or parent.children is None:
            return
        if len(self.dirs) >= FAST_DIRS:
            self.dirs.clear()
        self.dirs[parent.ino] = parent.children

    def answered(self, seconds: float) -> None:
        """One was answered in C, taking ``seconds`` before its reply's write."""
        self._observe(seconds)
        if len(self.noted) >= UNSETTLED_MISSES:
            self._counts.settle()


def _namespace(parent: Node) -> Node | None:
    return namespaces.top_level(parent) if parent.ino != ROOT_INO else None
