"""vLLM 0.33.0's own FileSystemTierManager stores, looks up and loads chunks through the mount."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests import vllm_tier
from tests.conftest import Mount

ROW = 256 << 10


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_fs_tier_round_trip_through_the_mount(kv_mount: Mount, o_direct: bool) -> None:
    region = vllm_tier.HostRegion(rows=16, row_bytes=ROW)
    root = kv_mount.path / f"vllm-{o_direct}"
    tier = vllm_tier.Tier(str(root), region, o_direct=o_direct)
    try:
        assert tier.uses_o_direct is o_direct  # the mount passed vLLM's O_DIRECT probe
        rng = np.random.default_rng(7)
        region.array[:8] = rng.integers(0, 256, size=(8, ROW), dtype=np.uint8)
        keys = vllm_tier.new_keys(8)
        assert tier.lookup(keys) == [vllm_tier.LookupResult.MISS] * 8
        assert tier.store(keys, list(range(8))).success

        tier2 = vllm_tier.Tier(str(root), region, o_direct=o_direct)  # a fresh lookup cache
        try:
            missing = vllm_tier.new_keys(2)
            results = tier2.lookup(keys + missing)
            assert results == [vllm_tier.LookupResult.HIT] * 8 + [vllm_tier.LookupResult.MISS] * 2
            region.array[8:] = 0
            assert tier2.load(keys, list(range(8, 16))).success
        finally:
            tier2.close()
        assert np.array_equal(region.array[8:], region.array[:8])
        kv_mount.settle()  # published at each file's last release, just after its close()
        for key, row in zip(keys, region.array[:8], strict=True):
            backing = tier.path(key).replace(str(kv_mount.path), str(kv_mount.backing), 1)
            assert Path(backing).read_bytes() == row.tobytes()
        config = json.loads(next(root.glob("*/config.json")).read_text())
        assert config["model_name"] == "kvfs-test/tiny-model"
        assert not list(root.rglob("*.tmp"))
    finally:
        tier.close()


def test_fs_tier_load_of_a_vanished_chunk_fails_cleanly(kv_mount: Mount) -> None:
    region = vllm_tier.HostRegion(rows=4, row_bytes=ROW)
    tier = vllm_tier.Tier(str(kv_mount.path / "vanish"), region)
    try:
        keys = vllm_tier.new_keys(2)
        assert tier.store(keys, [0, 1]).success
        os.unlink(tier.path(keys[1]))
        result = tier.load(keys, [2, 3])
        assert not result.success
        assert list(result.successful_keys or ()) == keys[:1]
    finally:
        tier.close()
