"""kvfs's fs tier: vLLM 0.33.0's fs tier reads what it writes and the other way round, on one
root on the mount; and its own failure paths."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kvfs.connector.tiers.base import JobResult, LookupResult, TierContext, TransferJob
from kvfs.connector.tiers.fs import FsTier
from kvfs.run_config import KVCacheGroupConfig, RunConfig
from tests import vllm_tier
from tests.conftest import Mount, small_filesystem

pytestmark = pytest.mark.vllm

ROW = 256 << 10
# What vLLM computes from tests/vllm_tier.minimal_spec(): one namespace for both tiers.
RUN = RunConfig(
    "kvfs-test/tiny-model", 16, 1, "bfloat16", (KVCacheGroupConfig(16, ("layers.0", "layers.1")),)
)


def kvfs_tier(root: Path, region: vllm_tier.HostRegion, **options: object) -> FsTier:
    context = TierContext("fs", RUN, ROW)
    return FsTier(
        region.view, context, root_dir=str(root), n_read_threads=2, n_write_threads=2, **options
    )  # type: ignore[arg-type]


def run(tier: FsTier, job: TransferJob) -> JobResult:
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    tier.drain()
    [result] = tier.get_finished_jobs()
    assert result.job_id == job.job_id
    return result


def lookups(tier: FsTier, keys: list[bytes]) -> list[LookupResult]:
    for _ in range(200):
        found = [tier.lookup(key, "r") for key in keys]
        if LookupResult.RETRY not in found:
            return found
        tier.on_schedule_end()
        time.sleep(0.005)
    raise AssertionError("lookups never resolved")


def fill(region: vllm_tier.HostRegion, rows: range, seed: int) -> None:
    region.array[rows.start : rows.stop] = np.random.default_rng(seed).integers(
        0, 256, (len(rows), ROW), dtype=np.uint8
    )


def test_kvfs_and_vllm_share_one_root_both_ways(kv_mount: Mount) -> None:
    root = kv_mount.path / "interop"
    ours_region, theirs_region = vllm_tier.HostRegion(16, ROW), vllm_tier.HostRegion(16, ROW)
    ours = kvfs_tier(root, ours_region)
    theirs = vllm_tier.Tier(str(root), theirs_region)
    try:
        assert ours.o_direct and theirs.uses_o_direct
        assert RUN.config_path(str(root)) == theirs.fs.file_mapper.get_config_file_path()

        # kvfs stores, vLLM looks up and loads
        fill(ours_region, range(0, 8), seed=1)
        keys = vllm_tier.new_keys(8)
        assert run(ours, TransferJob(1, keys, list(range(8)), False, "r")).success
        assert theirs.lookup(keys) == [vllm_tier.LookupResult.HIT] * 8
        assert theirs.load(keys, list(range(8, 16))).success
        assert np.array_equal(theirs_region.array[8:16], ours_region.array[0:8])

        # vLLM stores, kvfs looks up and loads
        fill(theirs_region, range(0, 8), seed=2)
        others = vllm_tier.new_keys(8)
        assert theirs.store(others, list(range(8))).success
        missing = vllm_tier.new_keys(1)
        assert lookups(ours, others + missing) == [LookupResult.HIT] * 8 + [LookupResult.MISS]
        assert run(ours, TransferJob(2, others, list(range(8, 16)), True, "r")).success
        assert np.array_equal(ours_region.array[8:16], theirs_region.array[0:8])
        for key in others:  # the bytes on the backing store are vLLM's rows, unchanged
            assert kv_mount.on_backing(ours.path(key)).stat().st_size == ROW
        assert not list(root.rglob("*.tmp"))
    finally:
        ours.drain()
        ours.shutdown()
        theirs.close()


def test_a_directory_without_o_direct_falls_back_to_buffered_io(tmp_path: Path) -> None:
    region = vllm_tier.HostRegion(4, ROW)
    with small_filesystem(tmp_path / "ramfs", "ramfs") as root:
        tier = kvfs_tier(root, region)
        try:
            assert not tier.o_direct
            fill(region, range(0, 2), seed=3)
            keys = vllm_tier.new_keys(2)
            assert run(tier, TransferJob(1, keys, [0, 1], False, "r")).success
            assert run(tier, TransferJob(2, keys, [2, 3], True, "r")).success
            assert np.array_equal(region.array[2:4], region.array[0:2])
        finally:
            tier.shutdown()
        with pytest.raises(Exception, match="o_direct"):
            kvfs_tier(root, region, o_direct=True)


def test_a_full_disk_fails_the_store_and_leaves_nothing(tmp_path: Path) -> None:
    region = vllm_tier.HostRegion(8, ROW)
    with small_filesystem(tmp_path / "tiny", "tmpfs", "size=600k") as root:
        tier = kvfs_tier(root, region)
        try:
            fill(region, range(0, 8), seed=4)
            keys = vllm_tier.new_keys(4)
            result = run(tier, TransferJob(1, keys, [0, 1, 2, 3], False, "r"))
            assert not result.success
            assert not list(root.rglob("*.tmp")), "a failed store left its temp file"
            stored = [k for k in keys if os.path.exists(tier.path(k))]
            assert 1 <= len(stored) < 4  # what fit was stored, whole
            for key in stored:
                assert os.path.getsize(tier.path(key)) == ROW
            assert lookups(tier, keys) == [
                LookupResult.HIT if k in stored else LookupResult.MISS for k in keys
            ]
        finally:
            tier.shutdown()


def test_files_of_the_wrong_size_are_misses_and_never_load(tmp_path: Path) -> None:
    region = vllm_tier.HostRegion(4, ROW)
    tier = kvfs_tier(tmp_path, region)
    try:
        keys = vllm_tier.new_keys(3)
        for key, size in zip(keys, (ROW // 2, ROW + 4096, ROW), strict=True):
            os.makedirs(os.path.dirname(tier.path(key)), exist_ok=True)
            Path(tier.path(key)).write_bytes(b"x" * size)
        assert lookups(tier, keys) == [LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
        region.array[:] = 7
        result = run(tier, TransferJob(1, keys, [0, 1, 2], True, "r"))
        assert not result.success and list(result.successful_keys or ()) == keys[2:]
        assert (region.array[0] == 7).all(), "a failed load wrote into its slot"
        assert not os.path.exists(tier.path(keys[0])), "a torn (short) file is removed"
        assert os.path.exists(tier.path(keys[1])), "a longer file (another config?) is kept"
        assert lookups(tier, keys[:1]) == [LookupResult.MISS]
    finally:
        tier.shutdown()


def test_a_load_keeps_every_chunk_that_arrived_whole(tmp_path: Path) -> None:
    region = vllm_tier.HostRegion(6, ROW)
    tier = kvfs_tier(tmp_path, region)
    try:
        fill(region, range(0, 3), seed=5)
        keys = vllm_tier.new_keys(3)
        assert run(tier, TransferJob(1, keys, [0, 1, 2], False, "r")).success
        os.unlink(tier.path(keys[1]))  # evicted between its lookup and its load
        result = run(tier, TransferJob(2, keys, [3, 4, 5], True, "r"))
        assert not result.success and list(result.successful_keys or ()) == [keys[0], keys[2]]
        assert np.array_equal(region.array[[3, 5]], region.array[[0, 2]])
        assert lookups(tier, keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        assert run(tier, TransferJob(3, [], [], True, "r")).success  # an empty job is reported
    finally:
        tier.shutdown()


def test_a_store_makes_its_directory_where_it_finds_it_missing(tmp_path: Path) -> None:
    """A store opens its temp file first and makes the directories only if that finds one
    missing (on a mount, a mkdir of one that is there still costs a round trip): directories
    removed under the tier are made again by the next store into them."""
    region = vllm_tier.HostRegion(2, ROW)
    tier = kvfs_tier(tmp_path, region)
    try:
        fill(region, range(0, 1), seed=9)
        keys = vllm_tier.new_keys(1)
        assert run(tier, TransferJob(1, keys, [0], False, "r")).success
        shutil.rmtree(os.path.dirname(os.path.dirname(tier.path(keys[0]))))  # two levels
        assert run(tier, TransferJob(2, keys, [0], False, "r")).success
        assert os.path.getsize(tier.path(keys[0])) == ROW
        assert run(tier, TransferJob(3, keys, [1], True, "r")).success
        assert np.array_equal(region.array[1], region.array[0])
    finally:
        tier.shutdown()


def test_on_a_kvfs_mount_a_steps_lookups_are_one_batched_request(kv_mount: Mount) -> None:
    """On a mount, the tier asks the daemon's index once for every key of a step
    (`.kvfs/lookup`) instead of a stat per chunk, each a FUSE round trip; on a plain directory
    it stats."""
    region = vllm_tier.HostRegion(4, ROW)
    tier = kvfs_tier(kv_mount.path / "batched", region)
    try:
        assert tier._mount_lookups is not None
        asked: list[int] = []
        ask = tier._mount_lookups.ask

        def counted(base: str, names: list[str]) -> list[bool]:
            asked.append(len(names))
            return ask(base, names)

        tier._mount_lookups.ask = counted  # type: ignore[method-assign]
        fill(region, range(0, 2), seed=3)
        stored = vllm_tier.new_keys(2)
        assert run(tier, TransferJob(1, stored, [0, 1], False, "r")).success
        kv_mount.settle()
        missing = vllm_tier.new_keys(7)
        assert lookups(tier, stored + missing) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 7
        assert asked == [7]  # one request; the two stored keys the tier knows from the store
    finally:
        tier.drain()
        tier.shutdown()
