"""The tiering manager through the one-process connector: host tier, secondary tiers, failures."""

from __future__ import annotations

import gc
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvfs import checksum
from kvfs.config import ConfigError
from kvfs.connector.kv_connector import KVConnector
from kvfs.host_region import region_path
from kvfs.keys import BlockHasher, chunk_keys
from tests import kv_model
from tests.conftest import Mount, free_port, mappings

BPC = 2
CHUNK_TOKENS = kv_model.TOKENS * BPC
HOST = 16 << 20  # a host tier of a few chunks: mapped populated, so no larger than a test needs


class Harness:
    """A connector over CPU 'device' tensors of the test model (group 0: full attention)."""

    def __init__(self, extra: dict[str, Any]) -> None:
        geo = kv_model.geometry(BPC)
        self.kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
        self.original = {name: t.clone() for name, t in self.kv.items()}
        self.name = f"test-{uuid.uuid4().hex[:10]}"
        extra = {"blocks_per_chunk": BPC, **extra}
        self.conn = KVConnector(
            extra, geo, self.kv, "kvfs-test/model", self.name, tokens_per_hash=4
        )
        self.hasher = BlockHasher("sha256_cbor", 4)

    def keys(self, chunks: int, seed: int = 0) -> list[bytes]:
        tokens = [(seed * 7919 + i) % 1000 for i in range(chunks * CHUNK_TOKENS)]
        return chunk_keys(self.hasher.block_hashes(tokens), 0, CHUNK_TOKENS, 4)

    def store(self, keys: list[bytes], first_block: int = 0) -> None:
        blocks = list(range(first_block, first_block + len(keys) * BPC))
        job = self.conn.store(keys, blocks, "req")
        if job is not None:
            self.conn.wait([job])
        assert all(f.success for f in self.conn.step())
        self.conn.manager.drain()

    def settle(self, keys: list[bytes], max_steps: int = 200) -> tuple[int, int]:
        """Ask, step by step, until no answer is RETRY: (hits, steps taken)."""
        for step in range(max_steps):
            found = self.conn.lookup(keys, "req")
            if not found.retry:
                return found.hits, step
            self.conn.step()
            time.sleep(0.005)
        raise AssertionError(f"still RETRY after {max_steps} steps")

    def load(self, keys: list[bytes], first_block: int) -> tuple[str, ...]:
        blocks = list(range(first_block, first_block + len(keys) * BPC))
        job = self.conn.load(keys, blocks, "req")
        self.conn.wait([job])
        [done] = [f for f in self.conn.step() if f.job_id == job]
        assert done.success
        return done.sources

    def loaded_equal(self, stored_first: int, loaded_first: int, count: int) -> bool:
        return all(
            kv_model.same_bytes(
                self.kv[name][loaded_first : loaded_first + count],
                self.original[name][stored_first : stored_first + count],
            )
            for name in ("attn.0", "attn.1")
        )

    def close(self) -> None:
        self.conn.close()
        assert not region_path(self.name).exists()


@pytest.fixture
def harness_factory() -> Iterator[Any]:
    made: list[Harness] = []

    def make(**extra: Any) -> Harness:
        made.append(Harness(extra))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


def test_a_request_partly_in_host_partly_on_the_mount_partly_nowhere(
    kv_mount: Mount, harness_factory: Any
) -> None:
    root = kv_mount.path / f"partial-{uuid.uuid4().hex[:6]}"
    h = harness_factory(
        cpu_bytes_to_use=64 << 20, secondary_tiers=[{"type": "fs", "root_dir": str(root)}]
    )
    keys = h.keys(6)
    h.store(keys[:4])  # host and, by cascade, the mount
    assert len(list(root.rglob("*.bin"))) == 4
    h.conn.manager.reset()  # the host tier forgets them; the mount keeps them
    h.store(keys[:2])  # back in host memory: chunks 0-1 host, 2-3 mount only, 4-5 nowhere

    first = h.conn.lookup(keys, "req")
    assert (first.hits, first.retry) == (2, True)  # the mount's answer comes next step
    hits, steps = h.settle(keys)
    # Lookup, then promotion, then ready: the promotion's reads from the mount take as many
    # 5 ms steps as a loaded machine makes them (52 under a dd and a busy loop beside it).
    assert hits == 4 and steps >= 2
    sources = h.load(keys[:4], first_block=12)
    assert sources == ("host", "host", "fs", "fs")
    assert h.loaded_equal(0, 12, 4 * BPC)
    assert not kv_model.same_bytes(h.kv["attn.0"][20:24], h.original["attn.0"][8:12])
    metrics = h.conn.metrics.registry
    assert metrics.get_sample_value("kvfs_connector_chunks_served_total", {"tier": "fs"}) == 2
    assert (
        metrics.get_sample_value("kvfs_connector_lookups_total", {"tier": "fs", "result": "hit"})
        == 2
    )
    fs = {
        result: metrics.get_sample_value(
            "kvfs_connector_lookups_total", {"tier": "fs", "result": result}
        )
        or 0
        for result in ("hit", "miss", "timeout")
    }
    assert fs["miss"] >= 1  # chunk 4 at least: how many depends on the steps the lookup took
    hit_ratio = metrics.get_sample_value("kvfs_connector_hit_ratio", {"tier": "fs"})
    assert hit_ratio == fs["hit"] / sum(fs.values())
    assert metrics.get_sample_value("kvfs_tier_fs_o_direct", {"tier": "fs"}) == 1
    assert h.conn.manager.host.busy_slots == 0


def test_loads_that_fail_become_misses_without_a_livelock(harness_factory: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20, secondary_tiers=[{"type": "memory", "fail_loads": True}]
    )
    keys = h.keys(3)
    h.store(keys)
    h.conn.manager.reset()
    hits, steps = h.settle(keys)
    assert hits == 0 and steps <= 3
    manager = h.conn.manager
    assert manager.host.busy_slots == 0 and len(manager.host) == 0, "failed promotions leak slots"
    assert (
        manager.metrics.registry.get_sample_value(
            "kvfs_connector_job_failures_total", {"tier": "memory", "direction": "load"}
        )
        == 1
    )
    again = h.conn.lookup(keys, "req")  # a known failure is not tried again
    assert (again.hits, again.retry) == (0, False)


def test_a_tier_whose_lookups_hang_costs_a_deadline_not_a_request(harness_factory: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20,
        lookup_timeout_s=0.2,
        secondary_tiers=[{"type": "HangingTier", "module_path": "tests.oot_tiers"}],
    )
    keys = h.keys(2)
    started = time.monotonic()
    hits, _ = h.settle(keys)
    assert hits == 0 and 0.2 <= time.monotonic() - started < 3
    assert h.conn.manager.host.busy_slots == 0 and len(h.conn.manager.host) == 0
    assert (
        h.conn.metrics.registry.get_sample_value(
            "kvfs_connector_lookups_total", {"tier": "HangingTier", "result": "timeout"}
        )
        == 1
    )  # the first key timed out; the second was never asked


def test_an_out_of_tree_tier_takes_part_in_cascade_and_promotion(harness_factory: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20,
        secondary_tiers=[
            {"type": "RecordingTier", "module_path": "tests.oot_tiers", "name": "mine"}
        ],
    )
    keys = h.keys(3)
    h.store(keys)
    tier = h.conn.manager.tiers[0]
    assert all(key in tier._chunks for key in keys)  # type: ignore[attr-defined]
    h.conn.manager.reset()
    hits, _ = h.settle(keys)
    assert hits == 3
    assert h.load(keys, first_block=12) == ("mine",) * 3
    assert h.loaded_equal(0, 12, 3 * BPC)
    assert (
        h.conn.metrics.registry.get_sample_value(
            "kvfs_tier_recordingtier_jobs_total", {"tier": "mine"}
        )
        == 2
    )


def test_a_tier_that_falls_behind_has_cascades_dropped(harness_factory: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20,
        max_pending_stores=2,
        secondary_tiers=[{"type": "SlowTier", "module_path": "tests.oot_tiers", "name": "slow"}],
    )
    keys = h.keys(5)
    for i, key in enumerate(keys):
        job = h.conn.store([key], [i * BPC, i * BPC + 1], "req")
        assert job is not None
        h.conn.wait([job])
        h.conn.step()
    manager = h.conn.manager
    dropped = manager.metrics.registry.get_sample_value(
        "kvfs_connector_cascades_dropped_total", {"tier": "slow"}
    )
    assert dropped == 3 and manager.host.busy_slots == 2  # only the two waiting stores pin
    manager.tiers[0].release.set()  # type: ignore[attr-defined]
    h.conn.step()
    assert manager.host.busy_slots == 0
    assert sorted(manager.tiers[0]._chunks) == sorted(keys[:2])  # type: ignore[attr-defined]


def test_the_fs_tier_declares_the_checksum_of_each_chunk_it_stores_on_a_mount(
    kv_mount: Mount, harness_factory: Any
) -> None:
    root = kv_mount.path / f"declared-{uuid.uuid4().hex[:6]}"
    h = harness_factory(
        cpu_bytes_to_use=64 << 20, secondary_tiers=[{"type": "fs", "root_dir": str(root)}]
    )
    before = kv_mount.usage()["counters"]["checksums_declared"]
    h.store(h.keys(3))
    files = sorted(root.rglob("*.bin"))
    assert len(files) == 3
    kv_mount.settle()
    assert kv_mount.usage()["counters"]["checksums_declared"] - before == 3
    for file in files:
        assert os.getxattr(file, checksum.XATTR) == checksum.checksum(file.read_bytes()).encode()


def test_a_full_host_tier_refuses_stores_and_promotions_cleanly(harness_factory: Any) -> None:
    h = harness_factory(cpu_bytes_to_use=2 * 4096 * 4)  # room for a handful of slots
    slots = h.conn.manager.num_slots
    keys = h.keys(slots + 1)
    h.store(keys[:slots])
    plan = h.conn.manager.prepare_load(keys[:slots])  # every slot pinned
    assert h.conn.store(keys[slots:], list(range(20, 22)), "req") is None
    h.conn.manager.complete_load(keys[:slots])
    assert len(plan.slots) == slots
    assert h.conn.store(keys[slots:], list(range(20, 22)), "req") is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "cpu_bytes_to_use: required"),
        ({"cpu_bytes_to_use": HOST, "cpu_byte_to_use": 1}, "unknown key 'cpu_byte_to_use'"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 4095}, "hold no chunk"),
        ({"cpu_bytes_to_use": HOST, "eviction_policy": "fifo"}, "eviction_policy: 'fifo'"),
        ({"cpu_bytes_to_use": HOST, "blocks_per_chunk": 3}, "blocks_per_chunk: 3"),
        (
            {"cpu_bytes_to_use": HOST, "secondary_tiers": {"type": "fs"}},
            "secondary_tiers: a list",
        ),
        (
            {"cpu_bytes_to_use": HOST, "secondary_tiers": [{"root_dir": "/x"}]},
            r"secondary_tiers\[0\].type",
        ),
        (
            {"cpu_bytes_to_use": HOST, "secondary_tiers": [{"type": "s3"}]},
            "'s3' is not built in",
        ),
        (
            {
                "cpu_bytes_to_use": HOST,
                "secondary_tiers": [{"type": "X", "module_path": "no.such"}],
            },
            "cannot load X",
        ),
        ({"cpu_bytes_to_use": HOST, "secondary_tiers": [{"type": "fs"}]}, "root_dir"),
        (
            {"cpu_bytes_to_use": HOST, "secondary_tiers": [{"type": "memory", "size": 3}]},
            "'size'",
        ),
        (
            {
                "cpu_bytes_to_use": HOST,
                "secondary_tiers": [{"type": "memory"}, {"type": "memory", "name": "memory"}],
            },
            "must be unique",
        ),
        ({"cpu_bytes_to_use": HOST, "lookup_timeout_s": 0}, "lookup_timeout_s"),
    ],
)
def test_bad_configuration_names_the_key(extra: dict[str, Any], message: str) -> None:
    geo = kv_model.geometry(BPC)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
    name = f"test-{uuid.uuid4().hex[:10]}"
    with pytest.raises(ConfigError, match=message):
        KVConnector({"blocks_per_chunk": BPC, **extra}, geo, kv, "m", name)
    assert not region_path(name).exists(), "a refused configuration left a host region"


def test_events_name_the_medium_and_the_tier(harness_factory: Any, tmp_path: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20, secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}]
    )
    keys = h.keys(2)
    h.store(keys)
    events = h.conn.manager.take_events()
    stored = {(e.medium, e.tier) for e in events if not e.removed for _ in e.keys}
    assert stored == {("CPU", "host"), ("STORAGE", "fs")}
    assert {k for e in events if e.tier == "fs" for k in e.keys} == set(keys)


def test_touch_keeps_a_chunk_hot_in_the_host_tier(harness_factory: Any) -> None:
    h = harness_factory(cpu_bytes_to_use=2 * 4096 * 4)  # 8 slots of 4 KiB
    slots = h.conn.manager.num_slots
    keys = h.keys(slots + 1)
    h.store(keys[:slots])
    h.conn.touch([keys[0]])  # a device prefix hit on the oldest chunk
    h.store(keys[slots:], first_block=20)
    host = h.conn.manager.host
    assert keys[0] in host and keys[1] not in host  # the next oldest went instead


def test_kv_events_reach_a_subscriber_in_vllms_wire_format(harness_factory: Any) -> None:
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        h = harness_factory(
            cpu_bytes_to_use=64 << 20,
            kv_events=f"tcp://127.0.0.1:{port}",
            secondary_tiers=[{"type": "memory", "name": "ram"}],
        )
        time.sleep(0.3)  # let the subscription reach the publisher
        keys = h.keys(2)
        h.store(keys)
        h.conn.step()
        seen: dict[tuple[str | None, str | None], set[bytes | int]] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(seen) < 2:
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
                for event in batch.events:
                    assert isinstance(event, BlockStored)
                    where = (event.medium, event.ownership)
                    seen.setdefault(where, set()).update(event.block_hashes)
        hashes = {maybe_convert_block_hash(key[:-4]) for key in keys}  # as vLLM publishes them
        assert seen == {("CPU", "host"): hashes, ("CPU", "ram"): hashes}
    finally:
        sub.close()


def test_a_lookup_that_timed_out_is_not_waited_for_again(harness_factory: Any) -> None:
    timeout = 0.2
    h = harness_factory(
        cpu_bytes_to_use=64 << 20,
        lookup_timeout_s=timeout,
        secondary_tiers=[{"type": "HangingTier", "module_path": "tests.oot_tiers"}],
    )
    keys = h.keys(1)
    h.settle(keys)
    started = time.monotonic()
    found = h.conn.lookup(keys, "req")  # a later request for the same chunk
    # Answered in less than one lookup timeout: it did not wait for the hung tier again.
    assert (found.hits, found.retry) == (0, False) and time.monotonic() - started < timeout


def test_a_prefix_longer_than_the_host_tier_ends_where_it_is_full(harness_factory: Any) -> None:
    """Promotions must not evict the chunks found before them (or a request chases itself)."""
    h = harness_factory(cpu_bytes_to_use=2 * 4096, secondary_tiers=[{"type": "memory"}])
    keys = h.keys(3)
    for i, key in enumerate(keys):  # one at a time: each evicts the one before from host
        h.store([key], first_block=i * BPC)
    h.conn.manager.reset()
    hits, steps = h.settle(keys, max_steps=20)
    assert hits == 2 and steps <= 4
    assert h.load(keys[:2], first_block=12) == ("memory", "memory")
    assert h.loaded_equal(0, 12, 2 * BPC)


def test_a_promotion_that_never_ends_is_a_miss_after_the_deadline(harness_factory: Any) -> None:
    h = harness_factory(
        cpu_bytes_to_use=64 << 20,
        lookup_timeout_s=0.2,
        secondary_tiers=[{"type": "StuckLoadTier", "module_path": "tests.oot_tiers"}],
    )
    keys = h.keys(2)
    h.store(keys)
    h.conn.manager.reset()
    started = time.monotonic()
    hits, _ = h.settle(keys)
    assert hits == 0 and time.monotonic() - started < 3


def test_a_closed_connector_unmaps_its_host_region_at_once(tmp_path: Any) -> None:
    """Not at the next cycle collection: a process that makes connectors one after another
    (a benchmark, a test run) would hold every old region until then."""
    geo = kv_model.geometry(BPC)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
    name = f"test-{uuid.uuid4().hex[:10]}"
    extra = {
        "cpu_bytes_to_use": 64 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
    }
    conn = KVConnector({"blocks_per_chunk": BPC, **extra}, geo, kv, "m", name)
    path = region_path(name)
    tier = weakref.ref(conn.manager.tiers[0])
    assert len(mappings(path)) == 1
    with os.fdopen(os.open(path, os.O_RDONLY)) as region:  # (close removes the name)
        gc.disable()
        try:
            conn.close()
            del conn
            assert tier() is None, "something still holds the closed connector's fs tier"
            assert mappings(Path(f"/proc/self/fd/{region.fileno()}")) == []
        finally:
            gc.enable()
