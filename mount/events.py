"""KV events on ZMQ (``kvfs mount ... --events tcp://HOST:PORT``), in vLLM's wire format.

Every chunk that becomes visible (published under its final name) is a BlockStored, every chunk
that goes (unlink, eviction, purge, quarantine) a BlockRemoved, so a router knows what this
tier holds. The block hash is the chunk's file name (`<hex>.bin`), the medium is "kvfs".

Wire format, as vLLM's ZmqEventPublisher sends it and its classes decode it: multipart
(topic, 8-byte big-endian sequence number, msgpack payload); the payload is a KVEventBatch,
an array [ts, [event, ...]] whose events are maps tagged with "type" (msgspec's tagged,
omit-defaults encoding). The PUB socket never blocks: a slow or absent subscriber loses
messages past the high-water mark, the mount never waits for it.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgpack
import trio
import zmq

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


class EventPublisher:
    def __init__(self, address: str, topic: str = "kv-events", high_water_mark: int = 10_000):
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._topic = topic.encode()
        self._pending: list[dict[str, Any]] = []
        self._seq = 0
        self.dropped = 0

    def stored(self, block_hash: bytes, group: int | None, block_size: int) -> None:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [block_hash],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }
        if group is not None:
            event["group_idx"] = group
        self._pending.append(event)

    def removed(self, block_hash: bytes, group: int | None) -> None:
        event: dict[str, Any] = {
            "type": "BlockRemoved",
            "block_hashes": [block_hash],
            "medium": MEDIUM,
        }
        if group is not None:
            event["group_idx"] = group
        self._pending.append(event)

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        payload = msgpack.packb([time.time(), batch], use_bin_type=True)
        try:
            self._socket.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.dropped += len(batch)
        self._seq += 1

    async def flush_forever(self) -> None:
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._socket.close()
