"""Prometheus /metrics and KV events on ZMQ, checked against a known workload."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tests.conftest import Mount, free_port, kvfs, make_mount
from tools import vllm_io

CHUNK = 128 << 10


def scrape(port: int) -> dict[str, float]:
    time.sleep(1.2)  # the daemon refreshes what /metrics serves every second
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(kvfs_[^ ]+) ([0-9.e+-]+)$", line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


@pytest.fixture
def observed_mount(tmp_path: Path) -> Iterator[tuple[Mount, int, int]]:
    metrics, events = free_port(), free_port()
    mount = make_mount(
        tmp_path, "--metrics-port", str(metrics), "--events", f"tcp://127.0.0.1:{events}"
    )
    try:
        yield mount.start(), metrics, events
    finally:
        mount.stop()


def test_metrics_deltas_match_a_known_workload(observed_mount: tuple[Mount, int, int]) -> None:
    mount, port, _ = observed_mount
    before = scrape(port)
    paths = [vllm_io.chunk_path(str(mount.path), k) for k in range(5)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
    for path in paths[:3]:
        vllm_io.load(path, CHUNK)
    assert not os.access(vllm_io.chunk_path(str(mount.path), 99), os.F_OK)  # never stored
    after = scrape(port)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("kvfs_publishes_total") == 5
    assert delta("kvfs_written_bytes_total") == 5 * CHUNK
    assert delta("kvfs_reads_total") == 3
    assert delta("kvfs_read_bytes_total") == 3 * CHUNK
    assert delta('kvfs_lookups_total{result="hit"}') == 3
    assert delta('kvfs_lookups_total{result="miss"}') == 1  # a store's own exists() is none
    assert after["kvfs_used_bytes"] == 5 * CHUNK and after["kvfs_chunks"] == 5
    assert delta('kvfs_operation_duration_seconds_count{operation="write"}') >= 5
    assert delta('kvfs_operation_duration_seconds_count{operation="flush"}') >= 5
    assert after["kvfs_capacity_bytes"] > 0 and "kvfs_checksum_failures_total" in after


def _subscribe(port: int) -> zmq.Socket:  # type: ignore[type-arg]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ's slow joiner: a subscription takes a moment to reach the publisher
    return sub


def _events(sub: zmq.Socket, until: float) -> list[object]:  # type: ignore[type-arg]
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[object] = []
    sequences = []
    while time.monotonic() < until:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            sequences.append(int.from_bytes(seq, "big"))
            events.extend(decoder.decode(payload).events)
    assert sequences == sorted(sequences)
    return events


def test_kv_events_decode_with_vllms_classes_and_name_every_chunk(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, _, port = observed_mount
    sub = _subscribe(port)
    keys = [0xABC0 + k for k in range(4)]
    paths = [vllm_io.chunk_path(str(mount.path), k) for k in keys]
    for key, path in zip(keys, paths, strict=True):
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
    Path(paths[0]).unlink()  # purge one by hand
    kvfs("evict", str(mount.path), "--namespace", f"{vllm_io.NAMESPACE}_r0")  # and the rest
    events = _events(sub, time.monotonic() + 1.5)
    sub.close()
    hashes = [maybe_convert_block_hash(k.to_bytes(32, "big")) for k in keys]  # vLLM's encoding
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored == hashes  # once each, under the final name only (not the temp name)
    assert sorted(removed) == sorted(hashes)
    assert {e.medium for e in events} == {"kvfs"}  # type: ignore[attr-defined]
    assert {e.group_idx for e in events} == {0}  # type: ignore[attr-defined]


def test_a_subscriber_that_stops_reading_never_slows_the_mount(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, _, port = observed_mount
    stalled = _subscribe(port)
    stalled.setsockopt(zmq.RCVHWM, 1)
    start = time.monotonic()
    for key in range(300):  # far more events than the stalled subscriber will take
        vllm_io.store(vllm_io.chunk_path(str(mount.path), key), b"z" * 4096)
    elapsed = time.monotonic() - start
    live = _subscribe(port)
    vllm_io.store(vllm_io.chunk_path(str(mount.path), 999), b"z" * 4096)
    events = _events(live, time.monotonic() + 1.0)
    stalled.close()
    live.close()
    assert elapsed < 60  # 300 stores went through while nobody read the events
    seen = [h for e in events for h in e.block_hashes]  # type: ignore[attr-defined]
    assert maybe_convert_block_hash((999).to_bytes(32, "big")) in seen  # still serves a reader
