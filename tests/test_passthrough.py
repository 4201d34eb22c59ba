"""Passthrough reads (--session kernel --verify first-read): the kernel reads a verified chunk
straight from its backing file; what is not verified yet is served, checked, and only then
passed through."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import vllm_tier
from tests.conftest import Mount, make_mount
from tests.test_integrity import backing_of, flip_byte
from tools import vllm_io

ROW = 256 << 10


def served_bytes(mount: Mount) -> int:
    """Bytes the daemon read and checked itself (passthrough reads never reach it)."""
    usage = json.loads((mount.path / ".kvfs" / "usage.json").read_bytes())
    return int(usage["counters"].get("bytes_read", 0))


@pytest.fixture
def passthrough_mount(tmp_path: Path) -> Iterator[Mount]:
    mount = make_mount(tmp_path, "--session", "kernel", "--verify", "first-read")
    try:
        yield mount.start()
    finally:
        mount.stop()


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_vllm_fs_tier_stores_and_loads_through_passthrough_byte_exact(
    passthrough_mount: Mount, o_direct: bool
) -> None:
    log = Path("/var/log/kvfs") / (
        str(passthrough_mount.path).strip("/").replace("/", "_") + ".log"
    )
    assert "reads pass through" in log.read_text()
    region = vllm_tier.HostRegion(rows=16, row_bytes=ROW)
    tier = vllm_tier.Tier(str(passthrough_mount.path), region, o_direct=o_direct)
    try:
        assert tier.uses_o_direct is o_direct  # vLLM's O_DIRECT probe passes
        rng = np.random.default_rng(11)
        region.array[:8] = rng.integers(0, 256, size=(8, ROW), dtype=np.uint8)
        keys = vllm_tier.new_keys(8)
        assert tier.store(keys, list(range(8))).success
        passthrough_mount.settle()
        region.array[8:] = 0
        assert tier.load(keys, list(range(8, 16))).success
        assert np.array_equal(region.array[8:], region.array[:8])
        assert served_bytes(passthrough_mount) == 0  # its own publishes: trusted, passed through
    finally:
        tier.close()


def test_a_chunk_from_before_the_restart_is_checked_once_then_passed_through(
    passthrough_mount: Mount,
) -> None:
    good, bad = (vllm_io.chunk_path(str(passthrough_mount.path), k) for k in (1, 2))
    for key, path in ((1, good), (2, bad)):
        vllm_io.store(path, vllm_io.chunk_bytes(key, ROW), o_direct=True)
    passthrough_mount.settle()
    passthrough_mount.restart()  # found at mount: not verified by this daemon
    flip_byte(backing_of(passthrough_mount, bad))
    with pytest.raises(OSError) as err:  # a flipped byte before the first open: served, caught
        vllm_io.load(bad, ROW, o_direct=True)
    assert err.value.errno == errno.EIO
    assert not os.access(bad, os.F_OK)
    assert len(os.listdir(passthrough_mount.backing / ".kvfs" / "quarantine")) == 1
    assert vllm_io.load(good, ROW, o_direct=True) == vllm_io.chunk_bytes(1, ROW)
    checked = served_bytes(passthrough_mount)
    assert checked == ROW  # the first read of the good one was served and checked
    for _ in range(3):
        assert vllm_io.load(good, ROW) == vllm_io.chunk_bytes(1, ROW)
    assert served_bytes(passthrough_mount) == checked  # and then passed through
