"""Passthrough reads (--session kernel --verify first-read): the kernel reads a verified chunk
straight from its backing file; what is not verified yet is served, checked, and only then
passed through."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvfs import checksum
from kvfs.mount.objects import CHECKSUM_LATER_MIN, SPARE_TMPS
from kvfs.mount.scrub import FILE_COST
from kvfs.mount.sealer import QUIET_SECONDS
from tests import vllm_tier
from tests.conftest import Mount, drop_dentries, flip_byte, make_mount, small_filesystem
from tools import vllm_io

ROW = 256 << 10


def served_bytes(mount: Mount) -> int:
    """Bytes the daemon read and checked itself (passthrough reads never reach it)."""
    return int(mount.usage()["counters"].get("bytes_read", 0))


@pytest.fixture
def passthrough_mount(tmp_path: Path) -> Iterator[Mount]:
    # No scrub: it would verify chunks before the first open these tests make.
    mount = make_mount(tmp_path, "--session", "kernel", "--verify", "first-read")
    mount.options += ("--scrub-rate", "0")
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
        vllm_io.store(path, vllm_io.chunk(key, ROW), o_direct=True)
    passthrough_mount.settle()
    passthrough_mount.restart()  # found at mount: not verified by this daemon
    flip_byte(passthrough_mount.on_backing(bad))
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


def test_a_chunk_changed_around_the_mount_after_its_verification_is_checked_at_its_next_open(
    passthrough_mount: Mount,
) -> None:
    """A write to a verified chunk's backing file by another process moves its mtime: the
    next open is served and checked (EIO, quarantine) instead of passing the new bytes
    through, whether it opens the backing file afresh or reopens the one the kernel holds."""
    held, fresh = (vllm_io.chunk_path(str(passthrough_mount.path), k) for k in (1, 2))
    for key, path in ((1, held), (2, fresh)):
        vllm_io.store(path, vllm_io.chunk(key, ROW), o_direct=True)
    passthrough_mount.settle()  # published and sealed: trusted as they stand
    for _ in range(2):  # the second open reuses the backing file the kernel kept
        assert vllm_io.load(held, ROW, o_direct=True) == vllm_io.chunk_bytes(1, ROW)
    session = passthrough_mount.usage()["session"]
    assert session["backing_reused"] >= 1 and served_bytes(passthrough_mount) == 0
    for path in (held, fresh):
        flip_byte(passthrough_mount.on_backing(path))
        with pytest.raises(OSError) as err:
            vllm_io.load(path, ROW, o_direct=path == held)
        assert err.value.errno == errno.EIO
        assert not os.access(path, os.F_OK)
    usage = passthrough_mount.usage()
    assert usage["counters"]["changed_around"] == 2 and usage["checksum_failures"] == 2
    assert len(os.listdir(passthrough_mount.backing / ".kvfs" / "quarantine")) == 2


def test_the_xattrs_kvfs_keeps_on_a_chunk_do_not_make_it_checked_again(
    passthrough_mount: Mount,
) -> None:
    """Pins and recency live in the backing file's xattrs, which move its ctime, not what a
    passthrough open compares: a pinned chunk still passes through."""
    path = vllm_io.chunk_path(str(passthrough_mount.path), 1)
    vllm_io.store(path, vllm_io.chunk(1, ROW), o_direct=True)
    passthrough_mount.settle()
    assert vllm_io.load(path, ROW) == vllm_io.chunk_bytes(1, ROW)
    os.setxattr(path, "user.kvfs.pin", b"1")
    assert os.getxattr(passthrough_mount.on_backing(path), "user.kvfs.pinned") == b"1"
    for _ in range(2):
        assert vllm_io.load(path, ROW, o_direct=True) == vllm_io.chunk_bytes(1, ROW)
    assert served_bytes(passthrough_mount) == 0
    assert passthrough_mount.usage()["counters"]["changed_around"] == 0


def test_a_touch_through_the_mount_is_not_a_change_around_it(passthrough_mount: Mount) -> None:
    """utime through the mount moves the backing file's mtime, which a passthrough open
    compares: the daemon made that change, so the chunk stays trusted (no warning, no count,
    still passed through); a write around the mount after the touch is still caught."""
    path = vllm_io.chunk_path(str(passthrough_mount.path), 1)
    vllm_io.store(path, vllm_io.chunk(1, ROW), o_direct=True)
    passthrough_mount.settle()
    assert vllm_io.load(path, ROW) == vllm_io.chunk_bytes(1, ROW)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    os.utime(path)  # now
    for _ in range(2):
        assert vllm_io.load(path, ROW, o_direct=True) == vllm_io.chunk_bytes(1, ROW)
    assert served_bytes(passthrough_mount) == 0
    assert passthrough_mount.usage()["counters"]["changed_around"] == 0
    flip_byte(passthrough_mount.on_backing(path))
    with pytest.raises(OSError) as err:
        vllm_io.load(path, ROW, o_direct=True)
    assert err.value.errno == errno.EIO
    assert passthrough_mount.usage()["counters"]["changed_around"] == 1


def test_a_chunk_read_in_passthrough_refuses_an_in_place_rewrite_until_its_reader_closes(
    passthrough_mount: Mount,
) -> None:
    """The kernel passes an inode through to one backing file at a time: while a reader holds a
    chunk in passthrough, a writer's open of the same name (its bytes would go to a temp file)
    fails with ETXTBSY and changes nothing. vLLM never rewrites a chunk in place (a new one goes
    to a temp name and is renamed); once the reader closed, the rewrite goes through."""
    path = vllm_io.chunk_path(str(passthrough_mount.path), 1)
    old, new = vllm_io.chunk_bytes(1, ROW), vllm_io.chunk_bytes(2, ROW)
    vllm_io.store(path, old)
    passthrough_mount.settle()
    with open(path, "rb", buffering=0) as reader:
        assert reader.read(4096) == old[:4096]
        with pytest.raises(OSError) as err:
            os.open(path, os.O_WRONLY)
        assert err.value.errno == errno.ETXTBSY
        assert reader.read() == old[4096:]
    assert vllm_io.load(path, ROW) == old
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, new, 0)
    finally:
        os.close(fd)
    passthrough_mount.settle()
    assert vllm_io.load(path, ROW) == new


def test_an_open_whose_backing_path_the_kernel_has_cached_takes_no_trip_to_the_pool(
    passthrough_mount: Mount,
) -> None:
    """After a restart the mount's scan leaves the backing paths in the kernel's caches: a
    reader's open opens its backing file in the receive loop (openat2 RESOLVE_CACHED), the
    first open served and checked, the next passed through. A path the kernel no longer
    caches is opened on the I/O pool, as before."""
    paths = [vllm_io.chunk_path(str(passthrough_mount.path), k) for k in range(4)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk(key, ROW), o_direct=True)
    passthrough_mount.settle()
    passthrough_mount.restart()
    for key, path in enumerate(paths[:3]):
        assert vllm_io.load(path, ROW, o_direct=True) == vllm_io.chunk_bytes(key, ROW)
    counters = passthrough_mount.usage()["counters"]
    assert counters["reads"] == counters["cached_opens"] == 3
    assert counters["bytes_read"] == 3 * ROW  # served and checked
    for key, path in enumerate(paths[:3]):
        assert vllm_io.load(path, ROW, o_direct=True) == vllm_io.chunk_bytes(key, ROW)
    counters = passthrough_mount.usage()["counters"]
    assert counters["reads"] == counters["cached_opens"] == 6
    assert counters["bytes_read"] == 3 * ROW  # passed through
    cold = drop_dentries(passthrough_mount.backing)
    assert vllm_io.load(paths[3], ROW, o_direct=True) == vllm_io.chunk_bytes(3, ROW)
    counters = passthrough_mount.usage()["counters"]
    assert counters["reads"] == 7 and counters["cached_opens"] == (6 if cold else 7)
    assert counters["bytes_read"] == 4 * ROW


def test_an_o_direct_readers_open_of_a_chunk_to_check_starts_reading_it(
    passthrough_mount: Mount,
) -> None:
    """A served open that is O_DIRECT (vLLM's) sends every READ to the daemon, which answers
    none before it has read and checked the whole chunk: that read starts at the open, while
    the open is answered and the reader asks. A buffered reader's open starts nothing (the
    kernel's page cache may answer its reads)."""
    paths = [vllm_io.chunk_path(str(passthrough_mount.path), k) for k in range(2)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk(key, ROW), o_direct=True)
    passthrough_mount.settle()
    passthrough_mount.restart()  # found at mount: each first open is served and checked
    fd = os.open(paths[0], os.O_RDONLY)
    try:
        time.sleep(0.5)
        assert served_bytes(passthrough_mount) == 0
    finally:
        os.close(fd)
    fd = os.open(paths[1], os.O_RDONLY | os.O_DIRECT)
    try:
        deadline = time.monotonic() + 10
        while served_bytes(passthrough_mount) < ROW:  # read and checked, no READ asked yet
            assert time.monotonic() < deadline, "the open did not start the chunk's read"
            time.sleep(0.05)
        buf = vllm_io.aligned(ROW)
        assert os.readv(fd, [buf]) == ROW and bytes(buf) == vllm_io.chunk_bytes(1, ROW)
    finally:
        os.close(fd)
    assert served_bytes(passthrough_mount) == ROW
    assert vllm_io.load(paths[0], ROW, o_direct=True) == vllm_io.chunk_bytes(0, ROW)
    assert served_bytes(passthrough_mount) == 2 * ROW


def test_a_file_written_in_passthrough_is_published_whole_with_its_checksum(
    passthrough_mount: Mount,
) -> None:
    """The kernel writes a new file into its temp backing file; the daemon never sees the
    bytes, checksums them at close and publishes by rename at the last release."""
    path = passthrough_mount.path / "f"
    data = os.urandom(3 << 20)
    with open(path, "wb") as f:
        f.write(data[: 1 << 20])
        with open(path, "rb") as reader:  # opened while written: passes through to the temp file
            assert reader.read(1 << 20) == data[: 1 << 20]
        f.write(data[1 << 20 :])
        os.utime(f.fileno(), ns=(1_000_000_000, 2_000_000_000))  # after the writes: it stays
    backing = passthrough_mount.on_backing(path)
    assert backing.read_bytes() == data
    assert os.stat(path).st_mtime_ns == backing.stat().st_mtime_ns == 2_000_000_000
    digest = os.getxattr(backing, "user.kvfs.checksum")
    assert digest == os.getxattr(path, "user.kvfs.checksum") == checksum.checksum(data).encode()
    assert served_bytes(passthrough_mount) == 0 and path.read_bytes() == data
    assert not os.listdir(passthrough_mount.backing / ".kvfs" / "tmp")


def checksum_backlog(mount: Mount) -> dict[str, int]:
    usage = mount.usage()
    return dict(usage["checksum_backlog"])


@pytest.mark.parametrize(
    ("backlog", "size", "deferred"),
    [(None, 2 << 20, 1), ("0", 2 << 20, 0), ("1M", 2 << 20, 0), (None, 4096, 0)],
    ids=["after_the_publish", "at_the_publish", "beyond_the_backlog", "small_at_the_publish"],
)
def test_a_file_written_with_o_direct_is_checksummed_as_the_disk_holds_it(
    tmp_path: Path, backlog: str | None, size: int, deferred: int
) -> None:
    """An O_DIRECT writer's bytes skip the page cache (the kernel opens the backing file with
    the writer's flags), so they are read back O_DIRECT to be checksummed: by the sealer after
    the publish (the default), or by the publish itself (``--checksum-backlog 0``, a file
    larger than the backlog, or one smaller than CHECKSUM_LATER_MIN). A second, buffered
    writer's tail, still dirty in the page cache then, is in the checksum too."""
    assert (size < CHECKSUM_LATER_MIN) == (size == 4096)
    options = ("--session", "kernel", "--verify", "first-read", "--scrub-rate", "0")
    mount = make_mount(tmp_path, *options)
    if backlog is not None:
        mount.options += ("--checksum-backlog", backlog)
    mount.start()
    try:
        path = mount.path / "direct"
        head, tail = vllm_io.chunk(7, size), os.urandom(1000)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644)
        try:
            assert os.write(fd, head) == len(head)
            with open(path, "ab") as buffered:
                buffered.write(tail)
        finally:
            os.close(fd)
        data = bytes(head) + tail
        backing = mount.on_backing(path)  # published, and sealed
        assert os.getxattr(backing, "user.kvfs.checksum") == checksum.checksum(data).encode()
        assert os.getxattr(path, "user.kvfs.checksum") == checksum.checksum(data).encode()
        assert checksum_backlog(mount) == {
            "deferred": deferred,
            "sealed": deferred,
            "waiting": 0,
            "waiting_bytes": 0,
        }
        assert vllm_io.load(str(path), len(data)) == data
        assert served_bytes(mount) == 0  # the seal is no read: passed through
    finally:
        mount.stop()


def test_the_read_back_waits_while_the_engine_loads(passthrough_mount: Mount) -> None:
    """A chunk published without its checksum is read back once the engine pauses its loads
    too (QUIET_SECONDS without an open for reading): the read-back would share the disk with
    them. While another chunk is loaded again and again, the seal comes only after a gap of
    QUIET_SECONDS between two loads (a stall of this test is one); once they stop, it comes."""
    mount = passthrough_mount
    loaded, waiting = (vllm_io.chunk_path(str(mount.path), key) for key in (1, 2))
    vllm_io.store(loaded, vllm_io.chunk(1, ROW), o_direct=True)
    mount.settle()
    sealed = checksum_backlog(mount)["sealed"]  # the first one's
    start = time.monotonic()
    vllm_io.store(waiting, vllm_io.chunk(2, ROW), o_direct=True)  # its seal deferred
    busy = [(start, time.monotonic())]  # each store's or load's start and end
    sealed_while_loading = False
    until = start + 5 * QUIET_SECONDS
    while time.monotonic() < until:
        start = time.monotonic()
        assert vllm_io.load(loaded, ROW, o_direct=True) == vllm_io.chunk_bytes(1, ROW)
        busy.append((start, time.monotonic()))
        if checksum_backlog(mount)["sealed"] > sealed:
            sealed_while_loading = True
            break
    if sealed_while_loading:  # only after a pause: the longest from one's start to the next's end
        assert max(end - begun for (begun, _), (_, end) in itertools.pairwise(busy)) >= (
            QUIET_SECONDS
        )
    mount.settle()  # sealed once the loads stopped
    assert checksum_backlog(mount)["sealed"] == sealed + 1


def test_a_chunk_left_without_its_checksum_by_a_kill_is_checked_at_its_first_read(
    tmp_path: Path,
) -> None:
    """A daemon killed before its sealer got to a chunk leaves it published without a
    checksum. The next daemon trusts no such file: its first read is served and checked
    whole (its checksum kept from then on), the reads after it pass through."""
    mount = make_mount(tmp_path, "--session", "kernel", "--verify", "first-read")
    mount.options += ("--scrub-rate", "0")
    mount.start()
    try:
        path = vllm_io.chunk_path(str(mount.path), 5)
        vllm_io.store(path, vllm_io.chunk(5, ROW), o_direct=True)
        mount.settle(sealed=False)
        backing = mount.backing / Path(path).relative_to(mount.path)
        mount.kill()
        # What the kill leaves when it comes before the seal (the sealer waits 0.1 s for the
        # writers to pause: it may have come first; this test must not depend on it).
        with contextlib.suppress(OSError):
            os.removexattr(backing, "user.kvfs.checksum")
        mount.start()
        assert vllm_io.load(path, ROW, o_direct=True) == vllm_io.chunk_bytes(5, ROW)
        assert served_bytes(mount) == ROW  # served and checked
        digest = checksum.checksum(vllm_io.chunk_bytes(5, ROW)).encode()
        assert os.getxattr(backing, "user.kvfs.checksum") == digest  # and adopted
        for _ in range(2):
            assert vllm_io.load(path, ROW) == vllm_io.chunk_bytes(5, ROW)
        assert served_bytes(mount) == ROW  # passed through from then on
    finally:
        mount.stop()


def test_a_rewrite_in_place_waits_for_the_readers_that_pass_through(
    passthrough_mount: Mount,
) -> None:
    """The kernel fails (EIO) a served open of an inode it passes through; the daemon says
    why first: ETXTBSY, and nothing changes. Once the readers are gone, the rewrite works."""
    path = passthrough_mount.path / "f"
    path.write_bytes(b"old" * 1000)
    passthrough_mount.settle()
    with open(path, "rb") as reader:
        assert reader.read(3) == b"old"
        with pytest.raises(OSError) as err:
            os.open(path, os.O_RDWR)
        assert err.value.errno == errno.ETXTBSY
        assert reader.read() == b"old" * 999
    with open(path, "r+b") as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" + b"old" * 999


def test_a_passthrough_file_beyond_the_capacity_fails_at_close_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    """No write buffer bounds a file the kernel writes: the capacity does, at close()."""
    mount = make_mount(tmp_path, "--session", "kernel", "--capacity", "4M").start()
    try:
        path = mount.path / "big"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for _ in range(5):
                assert os.write(fd, os.urandom(1 << 20)) == 1 << 20
        finally:
            with pytest.raises(OSError) as closed:
                os.close(fd)
        assert closed.value.errno == errno.ENOSPC
        mount.settle()
        assert not path.exists() and not (mount.backing / "big").exists()
        assert not os.listdir(mount.backing / ".kvfs" / "tmp")
        (mount.path / "fits").write_bytes(b"x" * (3 << 20))
        assert mount.on_backing(mount.path / "fits").stat().st_size == 3 << 20
    finally:
        mount.stop()


def test_the_scrub_charges_every_file_a_minimum_so_small_files_never_keep_it_busy(
    tmp_path: Path,
) -> None:
    """The scrub's rate bounds its cost per file too: a tree of small files is checked at most
    rate / FILE_COST files a second, not pass after pass as fast as the rate in bytes allows."""
    mount = make_mount(tmp_path, "--session", "kernel", "--verify", "first-read")
    rate = 4 << 20
    mount.options += ("--scrub-rate", str(rate))
    started = time.monotonic()
    mount.start()
    try:
        for key in range(100):
            vllm_io.store(vllm_io.chunk_path(str(mount.path), key), b"x" * 4096)
        time.sleep(1.5)
        usage = mount.usage()
        limit = (time.monotonic() - started) * rate / FILE_COST + 1
        assert 1 <= usage["scrub"]["files"] <= limit, (usage["scrub"], limit)
    finally:
        mount.stop()


def test_the_scrub_finds_a_byte_flipped_after_verification(tmp_path: Path) -> None:
    """Passthrough reads never reach the daemon: a chunk changed on the disk after it was
    verified is found by the scrub, quarantined, and misses from then on."""
    mount = make_mount(tmp_path, "--session", "kernel", "--verify", "first-read")
    mount.options += ("--scrub-rate", "1G")
    mount.start()
    try:
        paths = [vllm_io.chunk_path(str(mount.path), k) for k in range(4)]
        for key, path in enumerate(paths):
            vllm_io.store(path, vllm_io.chunk(key, ROW), o_direct=True)
        mount.settle()
        for key, path in enumerate(paths):
            assert vllm_io.load(path, ROW) == vllm_io.chunk_bytes(key, ROW)  # passed through
        flip_byte(mount.on_backing(paths[2]))
        deadline = time.monotonic() + 10
        while os.access(paths[2], os.F_OK):
            assert time.monotonic() < deadline, "the scrub did not find the flipped byte"
            time.sleep(0.05)
        usage = mount.usage()
        assert usage["scrub"]["failures"] == 1 and usage["checksum_failures"] == 1
        assert usage["scrub"]["files"] >= 1 and usage["counters"]["reads"] == 4  # no reads
        assert len(os.listdir(mount.backing / ".kvfs" / "quarantine")) == 1
        for key in (0, 1, 3):
            assert vllm_io.load(paths[key], ROW) == vllm_io.chunk_bytes(key, ROW)
    finally:
        mount.stop()


def test_a_hot_chunk_reopens_without_io_and_its_space_goes_with_it(tmp_path: Path) -> None:
    """The session keeps a chunk's backing file registered after its last close, so the next
    open needs no I/O; the file's eviction or unlink drops it (else the kernel's reference
    would hold the disk space of a deleted file)."""
    with small_filesystem(tmp_path / "disk", "tmpfs", "size=96m") as disk:
        mount = Mount(tmp_path / "mnt", disk / "backing", ("--session", "kernel"))
        mount.options += ("--verify", "first-read", "--scrub-rate", "0")
        mount.path.mkdir()
        mount.backing.mkdir()
        mount.start()
        try:
            path = mount.path / "big"
            path.write_bytes(os.urandom(32 << 20))
            mount.settle()
            for _ in range(3):
                assert len(path.read_bytes()) == 32 << 20
            usage = mount.usage()
            assert usage["session"]["backing_reused"] >= 2 and served_bytes(mount) == 0
            assert usage["counters"]["reads"] == 3  # reopens still count as reads
            before = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            path.unlink()  # the bytes go once the kernel forgets the name's inode
            deadline = time.monotonic() + 10
            while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - before < 32 << 20:
                assert time.monotonic() < deadline, "something held a deleted chunk's space"
                time.sleep(0.05)
        finally:
            mount.stop()


def test_the_first_read_of_a_stored_chunk_reuses_its_writers_backing_file(
    passthrough_mount: Mount,
) -> None:
    """vLLM stores under a temp name and renames: the rename keeps the bytes, so the backing
    file the kernel wrote stays registered and the first load opens nothing (a rename used to
    drop it like an unlink)."""
    root = str(passthrough_mount.path)
    final = vllm_io.chunk_path(root, 7)
    tmp = f"{final}_123.tmp"
    os.makedirs(os.path.dirname(final))
    Path(tmp).write_bytes(vllm_io.chunk_bytes(7, 1 << 20))
    passthrough_mount.settle()  # published under the temp name: the rename moves a chunk
    os.rename(tmp, final)
    assert vllm_io.load(final, 1 << 20) == vllm_io.chunk_bytes(7, 1 << 20)
    usage = passthrough_mount.usage()
    assert usage["session"]["backing_reused"] == 1


def test_more_files_open_at_once_than_spare_temp_files_are_each_published_whole(
    passthrough_mount: Mount,
) -> None:
    """A create takes a spare temp file in the receive loop; with none left it opens one on
    the I/O pool: both kinds publish whole, and no temp file stays behind."""
    paths = [passthrough_mount.path / f"f{i}" for i in range(3 * SPARE_TMPS)]
    files = [open(path, "wb") for path in paths]  # noqa: SIM115  # all open at once
    try:
        for i, f in enumerate(files):
            f.write(vllm_io.chunk_bytes(i, 64 << 10))
    finally:
        for f in files:
            f.close()
    for i, path in enumerate(paths):
        assert passthrough_mount.on_backing(path).read_bytes() == vllm_io.chunk_bytes(i, 64 << 10)
    assert not os.listdir(passthrough_mount.backing / ".kvfs" / "tmp")


def test_a_file_renamed_by_its_writer_before_its_close_is_published_under_the_new_name(
    passthrough_mount: Mount,
) -> None:
    """Renamed while open (only the index changes, in the receive loop), then written on: the
    publish places the whole file under its last name; a rename of the next one over it
    (the old bytes must go: served in a task) leaves the new bytes there."""
    first, second = os.urandom(2 << 20), os.urandom(1 << 20)
    tmp, final = passthrough_mount.path / "k.tmp", passthrough_mount.path / "k"
    with open(tmp, "wb") as f:
        f.write(first[: 1 << 20])
        os.rename(tmp, final)
        f.write(first[1 << 20 :])
    assert passthrough_mount.on_backing(final).read_bytes() == first
    assert not tmp.exists() and not passthrough_mount.on_backing(tmp).exists()
    tmp.write_bytes(second)
    os.rename(tmp, final)
    assert passthrough_mount.on_backing(final).read_bytes() == second == final.read_bytes()
    assert sorted(os.listdir(passthrough_mount.backing)) == [".kvfs", "k"]
    with pytest.raises(FileExistsError):
        os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY)


# Written O_DIRECT and checksummed at its publish (``--checksum-backlog 0``), a file this large
# is sealed by a read-back that takes far longer than the engine's rename takes to follow.
LONG_SEAL = 64 << 20


@pytest.fixture
def long_seals(tmp_path: Path) -> Iterator[Mount]:
    """A release publishes at once (no wait for a rename): the rename comes during its seal."""
    options = ("--session", "kernel", "--verify", "first-read", "--scrub-rate", "0")
    mount = make_mount(tmp_path, *options, "--checksum-backlog", "0", "--rename-wait", "0")
    mount.start()
    try:
        yield mount
    finally:
        mount.stop()


def closed_after_a_long_seal_began(tmp: Path) -> None:
    """Write ``tmp`` O_DIRECT and close it: the kernel sends the RELEASE, whose publish seals
    it (``LONG_SEAL``)."""
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, vllm_io.chunk(9, LONG_SEAL)) == LONG_SEAL
    finally:
        os.close(fd)


def test_a_rename_during_the_releases_publish_places_the_chunk_under_the_new_name(
    long_seals: Mount,
) -> None:
    """The engine's store closes its temp file and renames it. The kernel sends the RELEASE at
    the close, so it usually reaches the daemon first; its publish then seals the temp file
    without the namespace lock. A rename arriving meanwhile moves the name and returns; the
    publish under way places the file under the new name, never the old one, and it stays
    there through a kill -9 of the daemon."""
    mount = long_seals
    tmp, final = mount.path / "c.tmp", mount.path / "c"
    closed_after_a_long_seal_began(tmp)
    os.rename(tmp, final)
    mount.settle()
    assert sorted(os.listdir(mount.backing)) == [".kvfs", "c"]
    assert (mount.backing / "c").stat().st_size == LONG_SEAL
    mount.kill()
    mount.start()
    assert vllm_io.load(str(final), LONG_SEAL) == vllm_io.chunk_bytes(9, LONG_SEAL)
    assert not tmp.exists()


def test_a_chunk_loaded_right_after_its_rename_is_read_as_published(long_seals: Mount) -> None:
    """A load that opens the chunk while the publish its rename waits on is still sealing it
    waits for that publish and reads the chunk as published: passed through, and counted as a
    read (eviction's recency, the hit rate), not served from the temp file."""
    mount = long_seals
    tmp, final = mount.path / "c.tmp", mount.path / "c"
    closed_after_a_long_seal_began(tmp)
    before = mount.usage()
    os.rename(tmp, final)
    assert vllm_io.load(str(final), LONG_SEAL) == vllm_io.chunk_bytes(9, LONG_SEAL)
    after = mount.usage()
    assert after["counters"]["reads"] == before["counters"].get("reads", 0) + 1
    assert after["session"]["passthrough_opens"] == before["session"]["passthrough_opens"] + 1


def test_a_renamed_chunk_whose_publish_fails_is_dropped_with_its_name(long_seals: Mount) -> None:
    """The release's publish of a closed file fails (its directory on the backing store
    refuses the new name: immutable) after the engine's rename has moved the name and
    returned: the chunk is dropped, its name with it; nothing is left under either name."""
    mount = long_seals
    directory = mount.backing / "d"
    (mount.path / "d").mkdir()
    (mount.path / "d" / "first").write_bytes(b"x")  # the directory, on the backing store
    mount.settle()
    tmp, final = mount.path / "d" / "c.tmp", mount.path / "d" / "c"
    closed_after_a_long_seal_began(tmp)
    if subprocess.run(["chattr", "+i", directory], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable directories")
    try:
        os.rename(tmp, final)
        mount.settle()
        assert not final.exists() and not tmp.exists()
        assert sorted(os.listdir(directory)) == ["first"]
    finally:
        subprocess.run(["chattr", "-i", directory], check=False)
