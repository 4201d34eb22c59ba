"""Nothing lost, nothing wrong: a killed daemon, a full backing store."""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvfs.buffers import EXTENT
from tests.conftest import Mount, buffered_mount, make_mount
from tools import vllm_io
from tools.crash_loop import unpublished

CHUNK = 512 << 10


def _storm(mountpoint: str, log_path: str, first_key: int) -> None:
    """Store chunks from 8 threads until the mount dies; log every key whose store completed,
    and when (``time.monotonic``, one clock for every process).

    Paths go through a file descriptor of the mount's root, so once the daemon is killed they
    fail (ENOTCONN) instead of landing in the directory under the mountpoint.
    """
    root_fd = os.open(mountpoint, os.O_PATH | os.O_DIRECTORY)
    root = f"/proc/self/fd/{root_fd}"

    def one(i: int) -> None:
        key = first_key + i * 100_000
        while True:
            try:
                vllm_io.store(vllm_io.chunk_path(root, key), vllm_io.chunk_bytes(key, CHUNK))
            except OSError:
                return
            log.write(f"{key} {time.monotonic()}\n")
            key += 1

    with open(log_path, "a", buffering=1) as log, ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))


def test_kill_9_during_a_write_storm_loses_nothing_published(fresh_mount: Mount) -> None:
    log_path = fresh_mount.path.parent / "stored.log"
    storm = multiprocessing.get_context("spawn").Process(
        target=_storm, args=(str(fresh_mount.path), str(log_path), 1)
    )
    storm.start()
    deadline = time.monotonic() + 30
    while (not log_path.exists() or len(log_path.read_text().splitlines()) < 40) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    killed = time.monotonic()
    fresh_mount.kill()
    storm.join(60)
    assert storm.exitcode == 0
    acked = {int(k): float(t) for k, t in map(str.split, log_path.read_text().splitlines())}
    assert len(acked) >= 40

    # Every chunk whose store returned is there, but those whose publish (in the background,
    # one trip to the disk after their rename returned) the kill cut short: their bytes lie
    # whole in a temp file that the remount removes (a cache miss, never a mix).
    published = {int(p.stem, 16) for p in fresh_mount.backing.rglob("*.bin")}
    cut_short = unpublished(fresh_mount.backing, acked.keys() - published, CHUNK)
    fresh_mount.start()  # remount the same backing directory
    assert not list((fresh_mount.backing / ".kvfs" / "tmp").iterdir())
    assert not list(fresh_mount.backing.rglob("*.tmp")), "orphan temp files survived"
    finals = list(fresh_mount.path.rglob("*.bin"))
    missing = acked.keys() - {int(p.stem, 16) for p in finals}
    lost = missing - cut_short
    assert not lost, sorted(lost)
    for path in finals:  # ... and no final name holds partial or wrong bytes
        key = int(path.stem, 16)
        assert vllm_io.load(str(path), CHUNK) == vllm_io.chunk_bytes(key, CHUNK)
    oldest = max((killed - acked[key] for key in missing), default=0.0)
    print(
        f"{len(acked)} stored, {len(finals)} final, {len(missing)} dropped at the kill, their "
        f"bytes in temp files (acked up to {oldest:.3f}s before it)"
    )


@pytest.fixture
def tiny_backing_mount(tmp_path: Path) -> Iterator[Mount]:
    """A 4 MiB tmpfs as backing, with a capacity beyond it: the disk fills up first."""
    mount = make_mount(tmp_path, "--capacity", "1G")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount.backing)], check=True
    )
    try:
        yield mount.start()
    finally:
        mount.stop()
        subprocess.run(["umount", str(mount.backing)], check=True)


def test_a_full_backing_store_gives_enospc_and_leaves_nothing_partial(
    tiny_backing_mount: Mount,
) -> None:
    mount = tiny_backing_mount
    os.setxattr(mount.path, "user.kvfs.pin", b"1")  # nothing may be evicted to make room
    root = str(mount.path)
    stored, error = [], None
    for key in range(100):
        try:
            vllm_io.store(vllm_io.chunk_path(root, key), vllm_io.chunk_bytes(key, CHUNK))
        except OSError as err:
            error = err
            break
        stored.append(key)
    # ENOSPC; or, where the kernel writes the backing file itself (passthrough), what a plain
    # directory gives: the write that meets the full disk comes back short.
    assert error is not None
    assert error.errno == errno.ENOSPC or "short write" in str(error)
    assert 1 <= len(stored) < 8
    assert not list(mount.path.rglob("*.tmp")) and not list(mount.backing.rglob("*.tmp"))
    assert not list((mount.backing / ".kvfs" / "tmp").iterdir())
    # Temp files opened ahead for passthrough writes: only unused (empty) ones may stay.
    assert all(f.stat().st_size == 0 for f in (mount.backing / ".kvfs" / "spare").iterdir())
    finals = sorted(mount.path.rglob("*.bin"))
    assert [int(p.stem, 16) for p in finals] == stored
    for key in stored:
        assert vllm_io.load(vllm_io.chunk_path(root, key), CHUNK) == vllm_io.chunk_bytes(key, CHUNK)
    # The daemon keeps serving: make room, and the next store goes through.
    os.unlink(vllm_io.chunk_path(root, stored[0]))
    assert vllm_io.store(vllm_io.chunk_path(root, 1000), vllm_io.chunk_bytes(1000, CHUNK))
    assert vllm_io.load(vllm_io.chunk_path(root, 1000), CHUNK) == vllm_io.chunk_bytes(1000, CHUNK)


@pytest.fixture
def small_buffer_mount(tmp_path: Path) -> Iterator[Mount]:
    with buffered_mount(tmp_path, "--write-buffer", "2M") as mount:
        yield mount


def test_writers_wait_for_the_write_buffer_and_never_fail_for_it(
    small_buffer_mount: Mount,
) -> None:
    """Two open files hold the whole 2 MiB budget; a third writer waits until one closes."""
    mnt = small_buffer_mount.path
    with open(mnt / "a", "wb") as first, open(mnt / "b", "wb") as second:
        first.write(b"a" * EXTENT)
        first.flush()
        second.write(b"b" * EXTENT)
        second.flush()
        with ThreadPoolExecutor(1) as pool:
            third = pool.submit((mnt / "c").write_bytes, b"c" * EXTENT)
            time.sleep(0.5)
            assert not third.done(), "a writer got memory beyond the budget"
            first.close()
            assert third.result(timeout=30) == EXTENT
    assert [(mnt / n).read_bytes() for n in "abc"] == [n.encode() * EXTENT for n in "abc"]
