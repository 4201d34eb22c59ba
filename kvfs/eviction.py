"""Which chunk goes when a tier is full: LRU, S3-FIFO (scan-resistant) and ARC (adaptive).

Policies order keys (the daemon uses inode numbers, the host tier offload keys) with their
sizes in bytes. They know
nothing of files: the caller tells them what was inserted, read and removed, and passes an
``exempt`` test (pinned, open for writing) when it asks for a victim. ``evict`` removes the
victim from the policy and returns it; a caller that then fails to delete it inserts it again.

Both rebuild after a restart from what the daemon persists per file (last read time and hit
count): ``restore`` is called oldest first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
Exempt = Callable[[K], bool]


class EvictionPolicy(ABC, Generic[K]):
    name: str

    @abstractmethod
    def insert(self, key: K, size: int) -> None:
        """A new entry (or a new version of one: its size may change)."""

    @abstractmethod
    def restore(self, key: K, size: int, hits: int) -> None:
        """An entry found at start-up, with the hits it had; called oldest first."""

    @abstractmethod
    def access(self, key: K) -> None:
        """The entry was read."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """The entry is gone (deleted, replaced, purged); unknown keys are ignored."""

    @abstractmethod
    def evict(self, exempt: Exempt[K]) -> K | None:
        """Choose a victim that is not exempt, forget it and return it; None if none can go."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRU(EvictionPolicy[K]):
    """Least recently read goes first; a store counts as a read."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, int] = OrderedDict()  # key -> size, oldest first

    def insert(self, key: K, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def restore(self, key: K, size: int, hits: int) -> None:
        self.insert(key, size)

    def access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, exempt: Exempt[K]) -> K | None:
        for key in self._order:
            if not exempt(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class S3FIFO(EvictionPolicy[K]):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new entries, a main FIFO, and ghosts.

    New chunks enter the small queue (10 % of the bytes). Leaving it, a chunk that was read
    meanwhile moves to the main queue; one that was not goes, and its key is remembered as a
    ghost, so that if it comes back it enters the main queue directly. The main queue gives each
    chunk as many second chances as it has reads (up to 3). A scan of one-time chunks therefore
    only churns the small queue and never flushes the reused ones.
    """

    name = "s3fifo"
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[K, int] = OrderedDict()  # key -> size, oldest first
        self._main: OrderedDict[K, int] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._small_bytes = 0
        self._bytes = 0

    def insert(self, key: K, size: int) -> None:
        if key in self._small or key in self._main:
            self._resize(key, size)
            return
        self._freq[key] = 0
        self._bytes += size
        if key in self._ghost:  # it went too early once: straight to the main queue
            del self._ghost[key]
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def restore(self, key: K, size: int, hits: int) -> None:
        self.insert(key, size)
        if hits and key in self._small:  # it was reused before the restart: main queue
            self._small_bytes -= self._small.pop(key)
            self._main[key] = size
        self._freq[key] = min(hits, self.MAX_FREQ)

    def access(self, key: K) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: K) -> None:
        if key in self._small:
            size = self._small.pop(key)
            self._small_bytes -= size
        elif key in self._main:
            size = self._main.pop(key)
        else:
            return
        self._bytes -= size
        del self._freq[key]

    def evict(self, exempt: Exempt[K]) -> K | None:
        small_first = bool(self._small) and (
            self._small_bytes >= self.SMALL_SHARE * self._bytes or not self._main
        )
        for from_small in (True, False) if small_first else (False, True):
            queue = self._small if from_small else self._main
            step = self._evict_small if from_small else self._evict_main
            # Enough steps to age every entry to zero; exempt ones just keep their place.
            for _ in range((self.MAX_FREQ + 1) * len(queue) + 1):
                if not queue:
                    break
                victim = step(exempt)
                if victim is not None:
                    return victim
        return None

    def _evict_small(self, exempt: Exempt[K]) -> K | None:
        """Take the oldest small entry: evict it, promote it, or (exempt) requeue it."""
        key, size = self._small.popitem(last=False)
        if exempt(key):
            self._small[key] = size
            return None
        self._small_bytes -= size
        if self._freq[key] > 0:  # read while in the small queue: it is reused
            self._main[key] = size
            self._freq[key] = 0
            return None
        self._forget(key, size)
        self._ghost[key] = None
        while len(self._ghost) > max(len(self), 1):  # remember as many as the cache holds
            self._ghost.popitem(last=False)
        return key

    def _evict_main(self, exempt: Exempt[K]) -> K | None:
        """Take the oldest main entry: evict it, or give it another round (one read used)."""
        key, size = next(iter(self._main.items()))
        self._main.move_to_end(key)
        if exempt(key):
            return None
        if self._freq[key] > 0:
            self._freq[key] -= 1
            return None
        del self._main[key]
        self._forget(key, size)
        return key

    def _forget(self, key: K, size: int) -> None:
        self._bytes -= size
        del self._freq[key]

    def _resize(self, key: K, size: int) -> None:
        queue = self._small if key in self._small else self._main
        delta = size - queue[key]
        queue[key] = size
        self._bytes += delta
        if queue is self._small:
            self._small_bytes += delta

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


class ARC(EvictionPolicy[K]):
    """ARC (Megiddo and Modha, FAST 2003): an LRU list of entries seen once (T1), one of entries
    reused (T2), and a ghost list of the keys recently evicted from each (B1, B2).

    A miss whose key is a B1 ghost means T1 was too small: the target size of T1 grows; a B2
    ghost shrinks it. Eviction takes T1's oldest while T1 is above its target, else T2's, so
    the split between recency and frequency follows the workload. Entries are counted, not
    weighed: the tiers' chunks are all one size. ``capacity`` (entries) bounds the ghosts; it
    defaults to the most entries ever held.
    """

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        self._t1: OrderedDict[K, int] = OrderedDict()  # key -> size, oldest first
        self._t2: OrderedDict[K, int] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._target_t1 = 0.0
        self._fixed_capacity = capacity
        self._capacity = capacity or 0

    def insert(self, key: K, size: int) -> None:
        if key in self._t1:
            self._t1[key] = size
            return
        if key in self._t2:
            self._t2[key] = size
            return
        if key in self._b1:  # evicted from T1 too soon: T1 should be bigger
            step = max(1.0, len(self._b2) / len(self._b1))
            self._target_t1 = min(self._target_t1 + step, float(self._capacity))
            del self._b1[key]
            self._t2[key] = size
        elif key in self._b2:  # evicted from T2 too soon: T2 should be bigger
            step = max(1.0, len(self._b1) / len(self._b2))
            self._target_t1 = max(self._target_t1 - step, 0.0)
            del self._b2[key]
            self._t2[key] = size
        else:
            self._t1[key] = size
        if self._fixed_capacity is None:
            self._capacity = max(self._capacity, len(self))

    def restore(self, key: K, size: int, hits: int) -> None:
        (self._t2 if hits else self._t1)[key] = size
        if self._fixed_capacity is None:
            self._capacity = max(self._capacity, len(self))

    def access(self, key: K) -> None:
        if key in self._t1:
            self._t2[key] = self._t1.pop(key)
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def evict(self, exempt: Exempt[K]) -> K | None:
        t1_first = bool(self._t1) and (len(self._t1) > self._target_t1 or not self._t2)
        lists = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        for entries in lists:
            for key in entries:
                if exempt(key):
                    continue
                del entries[key]
                ghosts = self._b1 if entries is self._t1 else self._b2
                ghosts[key] = None
                while len(ghosts) > max(self._capacity, 1):
                    ghosts.popitem(last=False)
                return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {"lru": LRU, "s3fifo": S3FIFO, "arc": ARC}


def make_policy(name: str) -> EvictionPolicy[Any]:
    try:
        policy = POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r}: choose one of {', '.join(POLICIES)}") from None
    return policy
