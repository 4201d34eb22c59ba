"""KvfsTier, loaded by vLLM 0.33.0's own SecondaryTierFactory from the README's config: stores
and loads through a real mount byte-exact, shares files with vLLM's fs tier both ways, asks one
batched lookup per step, declares each chunk's checksum as it stores it, fails a store job at
its first failed block as vLLM's fs tier does, and turns a corrupt chunk into a failed load and
a miss."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfs import checksum
from tests import vllm_tier
from tests.conftest import Mount
from tests.vllm_tier import LookupResult

ROW = 64 << 10
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_config() -> dict[str, Any]:
    """The --kv-transfer-config the README gives for KvfsTier."""
    for block in re.findall(r"--kv-transfer-config '(.*?)'", README.read_text(), re.S):
        if "KvfsTier" in block:
            return dict(json.loads(block))
    raise AssertionError("README gives no --kv-transfer-config for KvfsTier")


def kvfs_tier_config() -> dict[str, Any]:
    (tier,) = readme_config()["kv_connector_extra_config"]["secondary_tiers"]
    return dict(tier)


def test_the_readme_config_is_vllms_tiering_spec_with_the_kvfs_tier() -> None:
    config = readme_config()
    assert config["kv_connector"] == "OffloadingConnector"
    assert config["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    assert kvfs_tier_config() == {
        "type": "KvfsTier",
        "module_path": "kvfs.connector.vllm_tier",
        "root_dir": "/mnt/kv-cache",
    }


def filled(region: vllm_tier.HostRegion, rows: range, seed: int) -> None:
    rng = np.random.default_rng(seed)
    region.array[rows.start : rows.stop] = rng.integers(0, 256, (len(rows), ROW), np.uint8)


@pytest.fixture
def region() -> vllm_tier.HostRegion:
    return vllm_tier.HostRegion(rows=16, row_bytes=ROW)


def kvfs_tier(root: Path, region: vllm_tier.HostRegion) -> vllm_tier.Tier:
    return vllm_tier.Tier(str(root), region, config=kvfs_tier_config())


def test_vllm_loads_the_tier_by_module_path(kv_mount: Mount, region: vllm_tier.HostRegion) -> None:
    from kvfs.connector.vllm_tier import KvfsTier

    tier = kvfs_tier(kv_mount.path / "loaded", region)
    try:
        assert type(tier.fs) is KvfsTier
        assert tier.fs.tier_type == "KvfsTier"
        assert tier.uses_o_direct  # vLLM's probe passed on the mount
    finally:
        tier.close()


def test_round_trip_and_both_ways_with_vllms_fs_tier(
    kv_mount: Mount, region: vllm_tier.HostRegion
) -> None:
    root = kv_mount.path / "interop"
    filled(region, range(0, 8), seed=1)
    ours, theirs = vllm_tier.new_keys(4), vllm_tier.new_keys(4)
    kvfs = kvfs_tier(root, region)
    fs = vllm_tier.Tier(str(root), region)
    try:
        assert kvfs.lookup(ours + theirs) == [LookupResult.MISS] * 8
        assert kvfs.store(ours, [0, 1, 2, 3]).success
        assert fs.store(theirs, [4, 5, 6, 7]).success
        assert kvfs.path(ours[0]) == fs.path(ours[0])  # one FileMapper: the same files
    finally:
        kvfs.close()
        fs.close()
    # Fresh tiers (no cached verdicts): each finds and loads the other's chunks byte-exact.
    for make, keys, source in ((kvfs_tier, theirs, 4), (None, ours, 0)):
        tier = make(root, region) if make else vllm_tier.Tier(str(root), region)
        try:
            missing = vllm_tier.new_keys(2)
            assert tier.lookup(keys + missing) == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 2
            region.array[8:12] = 0
            assert tier.load(keys, [8, 9, 10, 11]).success
            assert np.array_equal(region.array[8:12], region.array[source : source + 4])
        finally:
            tier.close()
    kv_mount.settle()
    for key, row in zip(ours, region.array[0:4], strict=True):
        assert kv_mount.on_backing(kvfs_tier_path(root, region, key)).read_bytes() == row.tobytes()


def kvfs_tier_path(root: Path, region: vllm_tier.HostRegion, key: Any) -> str:
    tier = vllm_tier.Tier(str(root), region)
    try:
        return tier.path(key)
    finally:
        tier.close()


def test_one_batched_request_per_step_for_every_request(
    kv_mount: Mount, region: vllm_tier.HostRegion
) -> None:
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    tier = kvfs_tier(kv_mount.path / "batched", region)
    try:
        filled(region, range(0, 2), seed=2)
        stored = vllm_tier.new_keys(2)
        assert tier.store(stored, [0, 1]).success
        asked: list[int] = []
        manager = tier.fs._lookup_manager
        ask = manager.batch_lookup

        def counted(keys: list[Any], ctx: Any) -> list[bool]:
            asked.append(len(keys))
            return list(ask(keys, ctx))

        manager.batch_lookup = counted
        requests = [ReqContext(req_id=f"r{i}") for i in range(3)]
        keys = [[stored[i % 2], *vllm_tier.new_keys(50)] for i in range(3)]
        for ctx, mine in zip(requests, keys, strict=True):  # one scheduler step, 3 requests
            assert {tier.fs.lookup(k, ctx) for k in mine} == {LookupResult.RETRY}
        tier.fs.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        results = tier.lookup(keys[0])  # waits for the answers (RETRY until then)
        # One request for the step's 152 distinct keys (requests 0 and 2 share one), not one
        # per request.
        assert asked == [152]
        assert results == [LookupResult.HIT] + [LookupResult.MISS] * 50
        answered = [tier.fs.lookup(k, requests[2]) for k in keys[2][:2]]
        assert answered == [LookupResult.HIT, LookupResult.MISS]
    finally:
        tier.close()


def test_a_corrupt_chunk_fails_its_load_and_becomes_a_miss(
    kv_mount: Mount, region: vllm_tier.HostRegion
) -> None:
    root = kv_mount.path / "corrupt"
    filled(region, range(0, 3), seed=3)
    keys = vllm_tier.new_keys(3)
    tier = kvfs_tier(root, region)
    try:
        assert tier.store(keys, [0, 1, 2]).success
        backing = kv_mount.on_backing(tier.path(keys[1]))
    finally:
        tier.close()
    with open(backing, "r+b") as f:  # one flipped byte on the disk, behind the mount's back
        f.seek(ROW // 2)
        byte = f.read(1)
        f.seek(ROW // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    tier = kvfs_tier(root, region)
    try:
        assert tier.lookup(keys) == [LookupResult.HIT] * 3  # not read yet: still there
        region.array[8:11] = 0
        result = tier.load(keys, [8, 9, 10])
        assert not result.success
        assert list(result.successful_keys or ()) == keys[:1]  # the good chunk before it kept
        assert np.array_equal(region.array[8], region.array[0])
        assert not region.array[9].any()  # never the corrupt bytes
        # vLLM's verdict for the bad key is now a miss, and the mount quarantined the chunk.
        assert tier.fs.lookup(keys[1], tier.ctx) == LookupResult.MISS
    finally:
        tier.close()
    fresh = kvfs_tier(root, region)
    try:
        assert fresh.lookup(keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    finally:
        fresh.close()


def test_a_root_off_any_kvfs_mount_is_refused(tmp_path: Path, region: vllm_tier.HostRegion) -> None:
    with pytest.raises(ValueError, match="not on a kvfs mount"):
        kvfs_tier(tmp_path / "plain", region)
    assert not (tmp_path / "plain").exists()  # refused before vLLM's fs tier made anything


def test_stores_declare_their_checksums_where_vllms_fs_tier_leaves_them_to_the_mount(
    kv_mount: Mount, region: vllm_tier.HostRegion
) -> None:
    """vLLM's fs tier writes O_DIRECT and declares nothing: a passthrough mount never sees
    those bytes and reads each chunk back from its disk for its checksum. KvfsTier declares
    each chunk's checksum as it writes it; a chunk already there is neither written nor
    declared again."""
    root = kv_mount.path / "declared"
    filled(region, range(0, 8), seed=4)
    ours, theirs = vllm_tier.new_keys(4), vllm_tier.new_keys(4)

    def declared() -> int:
        return int(kv_mount.usage()["counters"]["checksums_declared"])

    before = declared()
    kvfs, fs = kvfs_tier(root, region), vllm_tier.Tier(str(root), region)
    try:
        assert kvfs.store(ours, [0, 1, 2, 3]).success
        assert fs.store(theirs, [4, 5, 6, 7]).success
        assert kvfs.store([ours[0], *theirs[:1]], [0, 4]).success  # both there: nothing written
    finally:
        kvfs.close()
        fs.close()
    assert declared() - before == 4
    kv_mount.settle()
    for key, row in zip(ours, region.array[0:4], strict=True):
        backing = kv_mount.on_backing(kvfs_tier_path(root, region, key))
        assert os.getxattr(backing, checksum.XATTR) == checksum.checksum(row.tobytes()).encode()
        assert backing.read_bytes() == row.tobytes()


def test_a_store_job_fails_at_its_first_failed_block(
    kv_mount: Mount, region: vllm_tier.HostRegion
) -> None:
    """As vLLM's fs tier: the job fails, the blocks before the failure stay stored."""
    root = kv_mount.path / "failing"
    filled(region, range(0, 2), seed=5)
    keys = vllm_tier.new_keys(2)
    tier = kvfs_tier(root, region)
    try:
        second = Path(tier.path(keys[1]))
        second.parent.parent.mkdir(parents=True, exist_ok=True)
        second.parent.write_bytes(b"")  # a file where the second chunk's directory goes
        assert not tier.store(keys, [0, 1]).success
        assert tier.lookup(keys) == [LookupResult.HIT, LookupResult.MISS]
    finally:
        tier.close()
