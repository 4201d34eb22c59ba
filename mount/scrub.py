"""The background scrub: every published file read again from the backing store and checked
against its checksum, at a bounded rate, pass after pass; what fails is quarantined.

Why: with ``--verify first-read`` a chunk is checked once, then the kernel reads it straight
from its backing file (passthrough) and the daemon never sees those bytes again. A byte that
rots on the disk, or that another process changes behind the mount, would be served for ever;
the scrub finds it within one pass (the bytes held over the rate). It reads with O_DIRECT where
the store takes it (the disk, not the page cache) and never counts as a read: hits, recency and
the eviction order stay the engines'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from kvfs.mount.objects import Objects

log = logging.getLogger(__name__)

# A pass over a small tree takes at least this long: the scrub never spins.
MIN_PASS_SECONDS = 1.0
# Bytes of the rate a file costs at least: its open, thread hop and checksum setup cost about
# what reading this much does, so a tree of small files never keeps the scrub busy (4 KiB files
# at 16 MiB/s were 4,000 files a second, taking the request loop's CPU).
FILE_COST = 256 << 10


@dataclass
class ScrubStats:
    files: int = 0  # checked
    bytes: int = 0
    passes: int = 0  # complete
    failures: int = 0  # mismatches found (each quarantined)


class Scrub:
    def __init__(self, objects: Objects, bytes_per_second: int) -> None:
        self.objects = objects
        self.rate = bytes_per_second
        self.stats = ScrubStats()

    async def run_forever(self) -> None:
        if self.rate <= 0:
            return
        while True:
            started = trio.current_time()
            for node in list(self.objects.index.walk_files()):
                try:
                    outcome = await self.objects.recheck(node)
                except OSError as err:  # the store failed this one: the next pass tries again
                    log.warning("scrub of inode %d: %s", node.ino, err)
                    continue
                if outcome is None:  # gone, or being written: its publish checksums it
                    continue
                size, matched = outcome
                self.stats.files += 1
                self.stats.bytes += size
                self.stats.failures += not matched
                await trio.sleep(max(size, FILE_COST) / self.rate)
            self.stats.passes += 1
            await trio.sleep_until(started + MIN_PASS_SECONDS)
