"""KV events of the mount (``kvfs mount ... --events tcp://HOST:PORT``).

Every chunk that becomes visible (published under its final name) is a BlockStored, every chunk
that goes (unlink, eviction, purge, quarantine) a BlockRemoved, so a router knows what this
tier holds. The block hash is the chunk's file name (`<hex>.bin`), the medium is "kvfs". The
wire format is vLLM's (``kvfs.kv_events``).
"""

from __future__ import annotations

import re

import trio

from kvfs.kv_events import EventPublisher

MEDIUM = "kvfs"
FLUSH_INTERVAL = 0.05  # seconds: events are batched, as vLLM batches per engine step
_CHUNK = re.compile(rb"^([0-9a-f]{32}|[0-9a-f]{64})\.bin$")
_GROUP = re.compile(rb"_g(\d+)$")


def block_of(name: bytes, parent_name: bytes) -> tuple[bytes, int | None] | None:
    """The block hash and KV-cache group of a chunk file name; None for any other file."""
    match = _CHUNK.match(name)
    if match is None:
        return None
    group = _GROUP.search(parent_name)
    return bytes.fromhex(match[1].decode()), int(group[1]) if group else None


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
