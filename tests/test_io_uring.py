"""The kernel session over FUSE-over-io_uring (mount/ring.py): what only that transport does.
Everything else the mount tests check over it in `make test`'s third run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfs.mount.ring import ENABLE_URING, io_uring_offered
from tests.conftest import Mount, make_mount

pytestmark = pytest.mark.skipif(
    not os.access(ENABLE_URING, os.W_OK),
    reason="this kernel has no FUSE-over-io_uring (Linux 6.14+)",
)


def started(tmp_path: Path, *options: str) -> Mount:
    mount = make_mount(tmp_path, "--session", "kernel", *options)
    with io_uring_offered():
        return mount.start()


def test_first_time_misses_are_answered_on_the_callers_cpu_and_never_outlive_a_store(
    tmp_path: Path,
) -> None:
    mount = started(tmp_path, "--io-uring", "auto")
    try:
        assert mount.usage()["session"]["io_uring"] is True
        folder = mount.path / "ns" / "d"
        folder.mkdir(parents=True)
        (folder / "present.bin").write_bytes(b"x" * 4096)
        names = [f"{i:064x}.bin" for i in range(300)]
        for name in names:  # (the first is Python's: it makes the directory's misses fast)
            assert not (folder / name).exists()
        assert int(mount.usage()["session"]["ring_misses"]) >= 250
        # A name missed on a ring thread, then stored: found, whole (the negative entry went).
        (folder / names[7]).write_bytes(b"y" * 8192)
        assert (folder / names[7]).read_bytes() == b"y" * 8192
        assert (folder / "present.bin").read_bytes() == b"x" * 4096
    finally:
        mount.stop()


def test_off_keeps_the_session_on_dev_fuse(tmp_path: Path) -> None:
    mount = started(tmp_path, "--io-uring", "off")
    try:
        assert mount.usage()["session"]["io_uring"] is False
        (mount.path / "ns").mkdir()
        (mount.path / "ns" / "f").write_bytes(b"z")
        assert (mount.path / "ns" / "f").read_bytes() == b"z"
    finally:
        mount.stop()
