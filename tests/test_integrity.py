"""Checksums: a flipped byte is never served; it fails with EIO and is quarantined."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests import vllm_tier
from tests.conftest import Mount, flip_byte, kvfs
from tools import vllm_io

CHUNK = 256 << 10


def test_a_flipped_byte_fails_with_eio_is_quarantined_and_then_misses(
    unscrubbed_mount: Mount,
) -> None:
    path = vllm_io.chunk_path(str(unscrubbed_mount.path), 1)
    vllm_io.store(path, vllm_io.chunk(1, CHUNK), o_direct=True)
    flip_byte(unscrubbed_mount.on_backing(path))
    with pytest.raises(OSError) as err:
        vllm_io.load(path, CHUNK, o_direct=True)
    assert err.value.errno == errno.EIO
    assert not os.access(path, os.F_OK)  # the kernel forgot the name at once
    assert not os.path.exists(unscrubbed_mount.on_backing(path))
    quarantined = list((unscrubbed_mount.backing / ".kvfs" / "quarantine").iterdir())
    assert len(quarantined) == 1
    assert os.getxattr(unscrubbed_mount.path, "user.kvfs.checksum_failures") == b"1"
    assert vllm_io.store(path, vllm_io.chunk_bytes(1, CHUNK))  # stored again: a fresh chunk
    assert vllm_io.load(path, CHUNK) == vllm_io.chunk_bytes(1, CHUNK)


def test_vllm_fs_tier_reports_a_failed_load_and_never_gets_the_bad_bytes(
    unscrubbed_mount: Mount,
) -> None:
    region = vllm_tier.HostRegion(rows=6, row_bytes=CHUNK)
    rng = np.random.default_rng(3)
    region.array[:3] = rng.integers(0, 256, size=(3, CHUNK), dtype=np.uint8)
    tier = vllm_tier.Tier(str(unscrubbed_mount.path), region)
    try:
        keys = vllm_tier.new_keys(3)
        assert tier.store(keys, [0, 1, 2]).success
        flip_byte(unscrubbed_mount.on_backing(tier.path(keys[1])))
        region.array[3:] = 0
        result = tier.load(keys, [3, 4, 5])
        assert not result.success
        assert list(result.successful_keys or ()) == keys[:1]
        assert np.array_equal(region.array[3], region.array[0])
        assert not region.array[4].any()  # not one byte of the corrupt chunk reached vLLM
        assert tier.lookup(vllm_tier.new_keys(1) + keys[1:2]) == [vllm_tier.LookupResult.MISS] * 2
    finally:
        tier.close()


def test_kvfs_verify_on_a_mount_counts_no_read(unscrubbed_mount: Mount) -> None:
    """Issue 14, item 2: verify read every chunk through the mount, so every chunk's hits and
    last read changed, every namespace showed a 100 % hit rate and the eviction order was
    lost. The daemon now checks each file on request (``user.kvfs.verify``), as its scrub
    does: no read is counted."""
    paths = [vllm_io.chunk_path(str(unscrubbed_mount.path), k) for k in range(4)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk(key, CHUNK), o_direct=True)
    unscrubbed_mount.settle()
    vllm_io.load(paths[1], CHUNK)
    usage = unscrubbed_mount.path / ".kvfs" / "usage.json"

    def seen() -> tuple[object, ...]:
        marks = [{n: os.getxattr(p, n) for n in os.listxattr(p)} for p in paths]
        return json.loads(usage.read_bytes())["lookups"], marks

    before = seen()
    result = kvfs("verify", "--json", str(unscrubbed_mount.path))
    assert json.loads(result.stdout)["files"] == 4
    assert seen() == before
    not_a_flag = subprocess.run(
        ["setfattr", "-n", "user.kvfs.verify", "-v", "1", str(unscrubbed_mount.path)],
        capture_output=True,
        text=True,
    )
    assert not_a_flag.returncode != 0  # a directory is not checked: walk it (kvfs verify)


def test_kvfs_verify_on_a_mount_and_on_a_backing_directory(unscrubbed_mount: Mount) -> None:
    paths = [vllm_io.chunk_path(str(unscrubbed_mount.path), k) for k in range(6)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk(key, CHUNK), o_direct=True)
    flip_byte(unscrubbed_mount.on_backing(paths[2]))
    result = kvfs("verify", "--json", str(unscrubbed_mount.path), check=False)
    report = json.loads(result.stdout)
    assert result.returncode == 1
    assert report["files"] == 5 and report["bad"] == [paths[2]]
    assert not os.access(paths[2], os.F_OK)

    # Unmounted: the backing directory is checked directly, with the same quarantine.
    bad = unscrubbed_mount.on_backing(paths[4])
    unscrubbed_mount.stop()
    flip_byte(bad)
    refused = kvfs("verify", str(unscrubbed_mount.path), check=False)  # the bare mountpoint
    assert refused.returncode == 2 and "neither in a kvfs mount" in refused.stderr
    result = kvfs("verify", "--json", str(unscrubbed_mount.backing), check=False)
    report = json.loads(result.stdout)
    assert report["files"] == 4 and report["bad"] == [str(bad)]
    assert len(list(Path(unscrubbed_mount.backing, ".kvfs", "quarantine").iterdir())) == 2
    unscrubbed_mount.start()
    assert sorted(os.access(p, os.F_OK) for p in paths) == [False, False, True, True, True, True]
