"""Checksums taken after the publish, for files whose bytes only the disk holds.

A chunk vLLM writes O_DIRECT through a passthrough open goes from the engine's memory straight
to the disk: neither the page cache nor the daemon sees its bytes, so its checksum must read
them back from the disk, a second trip of every byte. Taken at the publish, that trip competes
with the engine's next writes for the same device (about half the plain directory's store
throughput on one disk: docs/benchmarks.md). So such a file (256 KiB or more:
``objects.CHECKSUM_LATER_MIN``) is published without a checksum, trusted meanwhile as this
daemon's own write (as a checksummed one is until the scrub), and the sealer reads it back
once the engine pauses for QUIET_SECONDS (no publish, and no file opened for reading: its
loads want the disk too), or once it has waited MAX_WAIT_SECONDS whatever the engine does. At
most ``--checksum-backlog`` bytes wait (give or take the publishes under way when it is
checked: each is admitted alone): past that a publish reads its file back itself (as every
publish does with 0, and every publish of a file written through the page cache, where the
read-back costs no disk).

What waiting costs: bytes that change on the disk between the publish and the seal are sealed
as they are then (as a file written around the mount is adopted at its first read); a daemon
killed with files waiting leaves them without a checksum, and the next mount adopts each at its
first read, served and checked whole before any passthrough.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from kvfs.index import Node

log = logging.getLogger(__name__)

# The engine paused its stores and loads this long: the disk is free for the read-back.
QUIET_SECONDS = 0.1
# No file waits longer for its checksum, however busy the engine is.
MAX_WAIT_SECONDS = 5.0

Recheck = Callable[[Node], Awaitable[tuple[int, bool] | None]]


@dataclass
class SealerStats:
    deferred: int = 0  # files published without their checksum
    sealed: int = 0  # of them, checksummed since by the sealer
    waiting: int = 0  # files waiting now
    waiting_bytes: int = 0


class Sealer:
    def __init__(self, limit: int, recheck: Recheck) -> None:
        self.limit = limit  # bytes that may wait
        self._recheck = recheck  # reads a published file back whole; keeps its checksum
        self._waiting: deque[tuple[Node, int, float]] = deque()  # node, bytes, published at
        self._last_busy = -math.inf  # the engine's last publish or open for reading
        self._arrived = trio.lowlevel.ParkingLot()
        self.stats = SealerStats()

    def admits(self, size: int) -> bool:
        """Whether a publish of ``size`` bytes may leave its checksum to the sealer."""
        return self.stats.waiting_bytes + size <= self.limit

    def defer(self, node: Node, size: int) -> None:
        """``node`` was published without its checksum (``admits`` said so)."""
        now = trio.current_time()
        self._waiting.append((node, size, now))
        self._last_busy = now
        self.stats.deferred += 1
        self.stats.waiting += 1
        self.stats.waiting_bytes += size
        self._arrived.unpark_all()

    def busy(self) -> None:
        """The engine published a file or opened one for reading: its I/O wants the disk."""
        self._last_busy = trio.current_time()

    async def run_forever(self) -> None:
        while True:
            if not self._waiting:
                await self._arrived.park()
                continue
            node, size, since = self._waiting[0]
            ready = min(self._last_busy + QUIET_SECONDS, since + MAX_WAIT_SECONDS)
            if trio.current_time() < ready:
                await trio.sleep_until(ready)  # a publish or open meanwhile pushes it on
                continue
            self._waiting.popleft()
            try:
                # A served read may have checked it meanwhile; gone or rewritten: nothing to do.
                if node.checksum is None and await self._recheck(node) is not None:
                    self.stats.sealed += 1
            except OSError as err:  # it stays without one: the scrub or a served read takes it
                log.warning("checksum of inode %d after its publish: %s", node.ino, err)
            finally:
                self.stats.waiting -= 1
                self.stats.waiting_bytes -= size
