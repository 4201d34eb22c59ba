"""The capacity bound: room for every publish, and a sweep between the watermarks.

Usage counts the published files' sizes in whole 4 KiB blocks (what `du -b` and `df` report;
xattr blocks are metadata and not charged) plus the room reserved by publishes in flight. A
publish that does not fit evicts, there and then, in the policy's order; only when nothing can
go (everything pinned or open for writing) does the writer get ENOSPC. After each publish, if
usage passed the high watermark, a background sweep evicts down to the low one, so most
publishes never wait for an eviction.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Protocol

import trio

from kvfs.buffers import on_disk
from kvfs.index import Index, Node
from kvfs.mount.bridge import NeedsIO

log = logging.getLogger(__name__)

HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90


class EvictionReason(StrEnum):
    """Why a file was evicted: the ``reason`` label of the eviction metrics (snake_case)."""

    CAPACITY = "capacity"  # a publish needed room under the capacity
    WATERMARK = "watermark"  # the background sweep, from the high watermark down to the low
    DISK_FULL = "disk_full"  # the backing filesystem filled up before the capacity did
    REQUEST = "request"  # `kvfs evict`


class SharedOrder(Protocol):
    """A shared backing directory's one capacity and global eviction order (mount/share.py)."""

    @property
    def used(self) -> int: ...

    def holding(self) -> bool: ...

    async def admit(self, need: int) -> None: ...

    async def evict_oldest(self, reason: EvictionReason) -> bool: ...

    def released(self) -> None: ...


class Evictor:
    def __init__(
        self,
        index: Index,
        capacity: int,
        exempt: Callable[[Node], bool],
        remove: Callable[[Node, EvictionReason], Awaitable[bool]],
    ) -> None:
        """``exempt``: may this file not go now; ``remove``: delete it (False if it can't)."""
        self.index = index
        self.capacity = capacity
        self._exempt = exempt
        self._remove = remove
        self.reserved = 0
        self.evictions: Counter[EvictionReason] = Counter()  # files
        self.evicted_bytes: Counter[EvictionReason] = Counter()  # their sizes
        self._sweep_wanted = trio.Event()
        # --shared: the share's usage and order instead of this index's (its sweep runs there)
        self.shared: SharedOrder | None = None

    @property
    def used(self) -> int:
        return self.index.charged if self.shared is None else self.shared.used

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used - self.reserved)

    async def reserve(self, size: int) -> int:
        """Make room for a publish of ``size`` bytes and hold it; returns what to release."""
        need = on_disk(size)
        if self.shared is not None:  # the share's room (its sweeper evicts, the others wait)
            await self.shared.admit(need)
            self.reserved += need
            return need
        while not self._fits(need):
            if not await self._evict_one(EvictionReason.CAPACITY):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.reserved += need
        return need

    def reserve_now(self, size: int) -> int:
        """``reserve`` where there is room already (NeedsIO where it would evict or wait)."""
        need = on_disk(size)
        if self.shared is not None or not self._fits(need):
            raise NeedsIO()
        self.reserved += need
        return need

    def _fits(self, need: int) -> bool:
        return self.used + self.reserved + need <= self.capacity

    def release(self, held: int) -> None:
        self.reserved -= held
        if self.shared is not None:
            self.shared.released()
        if self.used > HIGH_WATERMARK * self.capacity:
            self._sweep_wanted.set()

    def evicted(self, reason: EvictionReason, size: int) -> None:
        """Count a file of ``size`` bytes evicted."""
        self.evictions[reason] += 1
        self.evicted_bytes[reason] += size

    async def free_up(self, size: int, reason: EvictionReason) -> bool:
        """Evict until ``size`` more bytes are free on disk (the backing store said ENOSPC)."""
        target = self.used - on_disk(size)
        while self.used > target:
            if not await self._evict_one(reason):
                return False
        return True

    async def sweep_forever(self) -> None:
        self._sweep_wanted.set()  # the capacity may have shrunk since the last mount
        while True:
            await self._sweep_wanted.wait()
            self._sweep_wanted = trio.Event()
            before, count = self.used, 0
            try:
                while self.used > LOW_WATERMARK * self.capacity and await self._evict_one(
                    EvictionReason.WATERMARK
                ):
                    count += 1
            except OSError as err:  # the backing store failed one: try next time
                log.warning("eviction sweep stopped: %s", err)
            if count:
                log.info(
                    "eviction sweep: %d files, %d bytes; %d of %d bytes used",
                    count,
                    before - self.used,
                    self.used,
                    self.capacity,
                )

    async def _evict_one(self, reason: EvictionReason) -> bool:
        """Evict the policy's next victim; False if nothing can go."""
        if self.shared is not None:  # only the lease holder evicts, in the share's order
            return self.shared.holding() and await self.shared.evict_oldest(reason)
        policy = self.index.policy
        while True:
            ino = policy.evict(lambda key: self._exempt_ino(key))
            if ino is None:
                return False
            node = self.index.get(ino)
            if node is None or not node.attached:
                continue
            size = node.size
            try:
                removed = await self._remove(node, reason)
            except BaseException:
                if node.attached:  # still there: keep it evictable
                    policy.insert(ino, node.size)
                raise
            if removed:
                self.evicted(reason, size)
                return True
            if node.attached:  # it became busy meanwhile: keep it (now exempt), pick another
                policy.insert(ino, node.size)

    def _exempt_ino(self, ino: int) -> bool:
        node = self.index.get(ino)
        return node is None or self._exempt(node)
