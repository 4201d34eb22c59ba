"""KV events of the mount (``kvfs mount ... --events tcp://HOST:PORT``).

Every chunk that becomes visible (published under its final name) is a BlockStored, every chunk
that goes (unlink, eviction, purge, quarantine) a BlockRemoved, so a router knows what this
tier holds. The block hash is the chunk's file name (`<hex>.bin`), the medium is "kvfs". The
wire format is vLLM's (``kvfs.kv_events``).
"""

from __future__ import annotations

import trio

from kvfs.kv_events import EventPublisher

MEDIUM = "kvfs"
FLUSH_INTERVAL = 0.05  # seconds: events are batched, as vLLM batches per engine step


class MountEvents(EventPublisher):
    """The mount's publisher: one chunk per event, flushed from the trio loop."""

    def chunk_stored(self, block_hash: bytes, group: int | None, block_size: int) -> None:
        self.stored([block_hash], group, block_size, MEDIUM)

    def chunk_removed(self, block_hash: bytes, group: int | None) -> None:
        self.removed([block_hash], group, MEDIUM)

    async def flush_forever(self) -> None:
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            self.flush()
