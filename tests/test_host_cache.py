"""The host tier's cache: LRU and ARC over fixed slots, pins, and all-or-nothing allocation."""

from __future__ import annotations

import pytest

from kvfs.eviction import ARC
from kvfs.host_cache import HostCache, Lookup


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def store(cache: HostCache, *ids: int) -> dict[bytes, int]:
    allocation = cache.allocate(key(i) for i in ids)
    assert allocation is not None
    cache.complete_write(allocation.slots)
    return allocation.slots


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_store_lookup_and_slots(policy: str) -> None:
    cache = HostCache(4, policy)
    slots = store(cache, 1, 2)
    assert sorted(slots.values()) == [0, 1]
    assert cache.lookup(key(1)) is Lookup.HIT and cache.lookup(key(3)) is Lookup.MISS
    pending = cache.allocate([key(3)])
    assert pending is not None and cache.lookup(key(3)) is Lookup.PENDING
    again = cache.allocate([key(1), key(3), key(4)])  # present keys are skipped
    assert again is not None and list(again.slots) == [key(4)]
    [event] = [e for e in cache.take_events() if not e.removed]
    assert set(event.keys) == {key(1), key(2)}


def test_lru_evicts_the_least_recently_used() -> None:
    cache = HostCache(3, "lru")
    store(cache, 1, 2, 3)
    cache.touch([key(1)])
    freed = cache.slot_of(key(2))
    allocation = cache.allocate([key(4)])
    assert allocation is not None and allocation.evicted == [key(2)]
    assert allocation.slots[key(4)] == freed and cache.slot_of(key(2)) is None


def test_arc_keeps_reused_chunks_through_a_scan() -> None:
    """Chunks read twice sit in ARC's frequency list; a scan of one-time chunks goes through the
    recency list and leaves them, where LRU loses them all."""

    def hot_hits(policy: str) -> int:
        cache = HostCache(8, policy)
        hot = list(range(4))
        store(cache, *hot)
        cache.touch([key(i) for i in hot])  # reused once: frequent
        hits = 0
        for round_ in range(10):
            for i in hot:
                if cache.lookup(key(i)) is Lookup.HIT:
                    hits += 1
                    cache.touch([key(i)])
                else:
                    store(cache, i)
            for i in range(100 + round_ * 10, 110 + round_ * 10):  # a scan of 10 chunks
                store(cache, i)
        return hits

    assert hot_hits("lru") == 4  # only the first round: every scan flushes the hot set
    assert hot_hits("arc") >= 36


def test_arc_adapts_to_ghost_hits() -> None:
    arc: ARC[int] = ARC(capacity=4)
    for i in range(4):
        arc.insert(i, 1)
    assert arc.evict(lambda k: False) == 0  # T1's oldest, remembered as a B1 ghost
    arc.insert(0, 1)  # back soon after: T1 was too small, and 0 is now frequent
    assert arc._target_t1 > 0
    assert arc.evict(lambda k: False) == 1  # T1 above its target goes first, 0 stays


def test_pinned_chunks_are_never_evicted() -> None:
    cache = HostCache(2, "lru")
    store(cache, 1, 2)
    assert cache.pin([key(1)]) == [cache.slot_of(key(1))]
    allocation = cache.allocate([key(3)])
    assert allocation is not None and allocation.evicted == [key(2)]
    cache.complete_write(allocation.slots)
    cache.pin([key(3)])
    assert cache.allocate([key(4)]) is None  # both pinned: refused
    cache.unpin([key(1)])
    allocation = cache.allocate([key(4)])
    assert allocation is not None and allocation.evicted == [key(1)]


def test_pins_are_counted() -> None:
    cache = HostCache(1, "arc")
    store(cache, 1)
    cache.pin([key(1)])
    cache.pin([key(1)])
    cache.unpin([key(1)])
    assert cache.allocate([key(2)]) is None  # still pinned once
    cache.unpin([key(1)])
    assert cache.allocate([key(2)]) is not None
    with pytest.raises(KeyError, match="not pinned"):
        cache.unpin([key(2)])


def test_a_full_region_refuses_new_stores_and_changes_nothing() -> None:
    cache = HostCache(3, "lru")
    store(cache, 1)
    writing = cache.allocate([key(2)])  # being written: busy
    assert writing is not None
    cache.pin([key(1)])
    assert cache.allocate([key(3), key(4)]) is None  # one free slot for two chunks
    assert len(cache) == 2 and cache.free_slots == 1
    assert cache.lookup(key(1)) is Lookup.HIT and cache.lookup(key(2)) is Lookup.PENDING
    assert [e for e in cache.take_events() if e.removed] == []


def test_a_failed_write_frees_its_slot() -> None:
    cache = HostCache(1, "lru")
    allocation = cache.allocate([key(1)])
    assert allocation is not None
    cache.complete_write(allocation.slots, success=False)
    assert cache.lookup(key(1)) is Lookup.MISS and cache.free_slots == 1
    with pytest.raises(KeyError, match="not ready"):
        cache.pin([key(1)])


def test_clear_keeps_busy_chunks() -> None:
    cache = HostCache(3, "lru")
    store(cache, 1, 2)
    cache.pin([key(1)])
    assert cache.clear() == [key(2)]
    assert cache.lookup(key(1)) is Lookup.HIT and cache.free_slots == 2


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction_policy 'fifo'"):
        HostCache(4, "fifo")
    with pytest.raises(ValueError, match="at least one slot"):
        HostCache(0)
