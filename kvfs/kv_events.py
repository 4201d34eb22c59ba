"""KV events on ZMQ in vLLM's wire format: what a tier stored and removed, for routers.

Wire format, as vLLM's ZmqEventPublisher sends it and its classes decode it: multipart
(topic, 8-byte big-endian sequence number, msgpack payload); the payload is a KVEventBatch,
an array [ts, [event, ...]] whose events are maps tagged with "type" (msgspec's tagged,
omit-defaults encoding). The PUB socket never blocks: a slow or absent subscriber loses
messages past the high-water mark, and the publisher never waits for it.

The mount publishes with medium "kvfs"; the connector with "CPU" for its host tier and
"STORAGE" for secondary tiers, naming the tier in ``ownership`` as vLLM's tiers do.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import zmq


def external_hash(block_hash: bytes) -> bytes | int:
    """A block hash as vLLM publishes it: by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    the low 64 bits as an integer, so that routers can match kvfs's events with vLLM's."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class EventPublisher:
    def __init__(self, address: str, topic: str = "kv-events", high_water_mark: int = 10_000):
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._topic = topic.encode()
        self._pending: list[dict[str, Any]] = []
        self._seq = 0
        self.dropped = 0

    def stored(
        self,
        block_hashes: list[bytes],
        group: int | None,
        block_size: int,
        medium: str,
        ownership: str | None = None,
    ) -> None:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in block_hashes],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        self._pending.append(_optional(event, group_idx=group, ownership=ownership))

    def removed(
        self,
        block_hashes: list[bytes],
        group: int | None,
        medium: str,
        ownership: str | None = None,
    ) -> None:
        hashes = [external_hash(h) for h in block_hashes]
        event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        self._pending.append(_optional(event, group_idx=group, ownership=ownership))

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

    def close(self) -> None:
        self.flush()
        self._socket.close(linger=200)  # ms: let the last batch go, never hang on a subscriber


def _optional(event: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Omit-defaults, as msgspec encodes: a field that is None is left out."""
    event.update((k, v) for k, v in fields.items() if v is not None)
    return event
