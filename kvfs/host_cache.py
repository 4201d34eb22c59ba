"""The host tier's bookkeeping: which chunk sits in which slot of the host region, and which
slots may be evicted.

This is a cache, not a staging buffer: a chunk stays in its slot after its transfer, until the
policy (LRU or ARC) evicts it to make room. A slot is busy, and never evicted, while it is being
written (a store from the device or a load from a secondary tier) or while a transfer reads it
(a pin; pins are counted). ``allocate`` is all or nothing: when there are not enough free or
evictable slots it returns None and changes nothing, so a full region refuses new stores
cleanly and the caller drops them.

It runs in one process (the scheduler's); workers only ever see slot numbers. Not thread-safe:
the caller serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum

from kvfs.eviction import EvictionPolicy, make_policy

HOST_POLICIES = ("lru", "arc")


class Lookup(Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # present, still being written


@dataclass
class _Entry:
    slot: int
    ready: bool = False
    pins: int = 0


@dataclass
class Allocation:
    """Slots for the keys that were missing; ``evicted`` made room for them."""

    slots: dict[bytes, int]
    evicted: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class CacheEvent:
    keys: tuple[bytes, ...]
    removed: bool


class HostCache:
    def __init__(self, num_slots: int, policy: str = "lru") -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots {num_slots}: the host tier needs at least one slot")
        if policy not in HOST_POLICIES:
            raise ValueError(
                f"eviction_policy {policy!r}: choose one of {', '.join(HOST_POLICIES)}"
            )
        self.num_slots = num_slots
        self.policy_name = policy
        self._policy: EvictionPolicy[bytes] = make_policy(policy)
        self._entries: dict[bytes, _Entry] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._busy = 0  # entries being written or pinned
        self._events: list[CacheEvent] = []

    # -- queries ----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> Lookup:
        entry = self._entries.get(key)
        if entry is None:
            return Lookup.MISS
        return Lookup.HIT if entry.ready else Lookup.PENDING

    def slot_of(self, key: bytes) -> int | None:
        entry = self._entries.get(key)
        return entry.slot if entry is not None else None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def busy_slots(self) -> int:
        return self._busy

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- writing ----------------------------------------------------------------------------

    def allocate(self, keys: Iterable[bytes], keep: Collection[bytes] = ()) -> Allocation | None:
        """Slots to write the missing ``keys`` into (present ones are skipped), marked busy
        until ``complete_write``; None, with nothing changed, if they do not all fit.
        Chunks in ``keep`` are not evicted for them (a lookup's hits, about to be loaded)."""
        wanted = list(dict.fromkeys(k for k in keys if k not in self._entries))
        shortfall = len(wanted) - len(self._free)
        evictable = len(self._entries) - self._busy  # before what ``keep`` holds back
        # ``keep`` is counted only where it could decide: a prefix lookup asks this per chunk
        # with every chunk before it kept (the scheduler's GIL time).
        if shortfall > evictable - len(keep) and shortfall > evictable - self._kept(keep):
            return None
        exempt = (lambda k: self._is_busy(k) or k in keep) if keep else self._is_busy
        evicted = [self._evict_one(exempt) for _ in range(max(0, shortfall))]
        slots = {}
        for key in wanted:
            entry = _Entry(self._free.pop())
            self._entries[key] = entry
            self._busy += 1
            slots[key] = entry.slot
        if evicted:
            self._events.append(CacheEvent(tuple(evicted), removed=True))
        return Allocation(slots, evicted)

    def _kept(self, keys: Collection[bytes]) -> int:
        """How many of ``keys`` are ready, unpinned chunks here (eviction could take them)."""
        return sum(
            1
            for k in set(keys)
            if (e := self._entries.get(k)) is not None and e.ready and not e.pins
        )

    def complete_write(self, keys: Iterable[bytes], success: bool = True) -> None:
        """The slots of ``keys`` hold their chunks (or, on failure, are freed)."""
        stored = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            self._busy -= 1
            if success:
                entry.ready = True
                self._policy.insert(key, 1)
                stored.append(key)
            else:
                del self._entries[key]
                self._free.append(entry.slot)
        if stored:
            self._events.append(CacheEvent(tuple(stored), removed=False))

    # -- reading ----------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> list[int]:
        """Protect ready chunks from eviction while a transfer reads them; their slots."""
        keys = list(keys)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                raise KeyError(f"chunk {key.hex()} is not ready in the host tier")
        slots = []
        for key in keys:
            entry = self._entries[key]
            if entry.pins == 0:
                self._busy += 1
            entry.pins += 1
            self._policy.access(key)
            slots.append(entry.slot)
        return slots

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise KeyError(f"chunk {key.hex()} is not pinned")
            entry.pins -= 1
            if entry.pins == 0 and entry.ready:
                self._busy -= 1

    def touch(self, keys: Collection[bytes]) -> None:
        """Mark chunks as recently used (a prefix hit in device memory, say)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.ready:
                self._policy.access(key)

    # -- removal ----------------------------------------------------------------------------

    def _evict_one(self, exempt: Callable[[bytes], bool]) -> bytes:
        victim = self._policy.evict(exempt)
        assert victim is not None, "allocate counted an evictable slot that is not there"
        self._free.append(self._entries.pop(victim).slot)
        return victim

    def _is_busy(self, key: bytes) -> bool:
        entry = self._entries[key]
        return entry.pins > 0 or not entry.ready

    def clear(self) -> list[bytes]:
        """Drop every chunk that is not busy; the keys dropped."""
        dropped = [k for k, e in self._entries.items() if e.ready and not e.pins]
        for key in dropped:
            self._policy.remove(key)
            self._free.append(self._entries.pop(key).slot)
        if dropped:
            self._events.append(CacheEvent(tuple(dropped), removed=True))
        return dropped

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events
