"""A name shows whole, current, verified bytes or nothing: publish once, at the last release
(or at the rename that names a closed file), of what a writer closed; a name that went is gone
for every later lookup."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import Mount, flip_byte, make_mount
from tools import vllm_io

CHUNK = 256 << 10


def publishes(mount: Mount) -> int:
    return int(mount.usage()["counters"].get("publishes", 0))


def published(mount: Mount, count: int, timeout: float = 10) -> None:
    """Wait until ``count`` files have been published since the mount (a rename to a free name
    returns before its file's publish, which follows in the background)."""
    deadline = time.monotonic() + timeout
    while publishes(mount) < count:
        assert time.monotonic() < deadline, f"{publishes(mount)} published, not {count}"
        time.sleep(0.005)


def test_closing_a_dup_publishes_nothing_until_the_last_close(fresh_mount: Mount) -> None:
    path = fresh_mount.path / "f"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"a" * 4096)
    os.close(os.dup(fd))  # a FLUSH, but the file is still open
    assert not (fresh_mount.backing / "f").exists()
    assert publishes(fresh_mount) == 0
    os.write(fd, b"b" * 4096)
    os.close(fd)
    fresh_mount.settle()
    assert (fresh_mount.backing / "f").read_bytes() == b"a" * 4096 + b"b" * 4096
    assert publishes(fresh_mount) == 1


WRITER = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.write(fd, b"p" * (1 << 20))  # a quarter of the chunk, then killed with it open
    os.kill(os.getpid(), 9)
    """
)


def test_renaming_a_closed_file_publishes_it_and_a_write_after_that_is_never_served_mixed(
    fresh_mount: Mount,
) -> None:
    """The engine's store renames its temp file after close(), maybe before the RELEASE: the
    rename publishes it (in the background: the rename has returned). A write through a dup
    after that is published again (buffered), or, written in passthrough behind the checksum,
    makes the last release take the file out: its name never serves a mix."""
    tmp, final = fresh_mount.path / "f.tmp", fresh_mount.path / "f"
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"a" * CHUNK)
    held = os.dup(fd)
    os.close(fd)  # a FLUSH; the RELEASE waits for the dup's close
    os.rename(tmp, final)
    published(fresh_mount, 1)
    assert (fresh_mount.backing / "f").read_bytes() == b"a" * CHUNK
    os.pwrite(held, b"b" * 4096, 0)
    os.close(held)
    fresh_mount.settle()
    rewritten = b"b" * 4096 + b"a" * (CHUNK - 4096)
    counters = fresh_mount.usage()["counters"]
    if final.exists():  # the daemon's buffer took the write: published again
        assert final.read_bytes() == rewritten
        assert (fresh_mount.backing / "f").read_bytes() == rewritten
        assert counters["publishes"] == 2
    else:  # the kernel wrote the published file itself
        assert not (fresh_mount.backing / "f").exists()
        assert counters["quarantined"] == 1


def test_a_closed_temp_file_waits_for_its_rename_and_is_published_under_the_new_name_only(
    tmp_path: Path,
) -> None:
    """The engine's store: temp file, close(), rename. The release that the close sends waits
    (``--rename-wait``) for the rename, which then publishes the file under the chunk's name in
    one step: the temp name never reaches the backing store, and the waiting release ends with
    that publish, not at the wait's end; as it does with an unlink of the temp file (a store
    that gave up), and with a rename over a published chunk (which returns with the new bytes
    in place: the name held a chunk)."""
    mount = make_mount(tmp_path, "--rename-wait", "10").start()
    try:
        tmp, final = mount.path / "c.bin_1.tmp", mount.path / "c.bin"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, b"c" * CHUNK)
        os.close(fd)
        time.sleep(0.3)  # its RELEASE came, and waits
        assert not (mount.backing / tmp.name).exists()
        os.rename(tmp, final)
        assert final.read_bytes() == b"c" * CHUNK  # from the temp file until published
        mount.settle(timeout=5)  # the release ended with the rename's publish (else: 10 s)
        assert (mount.backing / final.name).read_bytes() == b"c" * CHUNK
        assert not (mount.backing / tmp.name).exists()
        assert publishes(mount) == 1
        given_up = mount.path / "d.bin_2.tmp"  # a store that failed: it unlinks its temp file
        given_up.write_bytes(b"d" * CHUNK)
        time.sleep(0.3)
        given_up.unlink()
        mount.settle(timeout=5)  # no rename will come: the release ended with the unlink
        assert publishes(mount) == 1 and not (mount.backing / given_up.name).exists()
        again = mount.path / "c.bin_3.tmp"  # another engine stores the same key: over it
        again.write_bytes(b"e" * CHUNK)
        time.sleep(0.3)
        os.rename(again, final)
        assert (mount.backing / final.name).read_bytes() == b"e" * CHUNK
        mount.settle(timeout=5)  # the release ended with that rename too
        assert publishes(mount) == 2 and mount.usage()["counters"]["renames_missed"] == 0
        mount.kill()
        mount.start()
        assert final.read_bytes() == b"e" * CHUNK
    finally:
        mount.stop()


def test_a_closed_temp_file_never_renamed_is_published_under_its_own_name_when_the_wait_ends(
    tmp_path: Path,
) -> None:
    """A store whose rename never comes (its engine went): the last release, answered at once,
    publishes the temp file under its own name once ``--rename-wait`` is over. An unmount does
    not wait that out (the next mount removes an engine's temp files found on the backing
    store as orphans: what waits for its rename then is dropped)."""
    mount = make_mount(tmp_path, "--rename-wait", "1").start()
    try:
        tmp = mount.path / "c.bin_1.tmp"
        tmp.write_bytes(b"c" * CHUNK)
        assert os.getxattr(mount.path, "user.kvfs.unpublished") != b"0"  # it waits
        mount.settle(timeout=5)
        assert (mount.backing / tmp.name).read_bytes() == b"c" * CHUNK
        assert publishes(mount) == 1 and mount.usage()["counters"]["renames_missed"] == 1
        mount.stop()
        mount.options = (*mount.options[:-1], "10")  # (--rename-wait)
        mount.start()
        assert not tmp.exists() and not (mount.backing / tmp.name).exists()  # an orphan
        again = mount.path / "d.bin_2.tmp"
        again.write_bytes(b"d" * CHUNK)
        time.sleep(0.3)  # its RELEASE came, and was answered: the wait holds no request
        assert os.getxattr(mount.path, "user.kvfs.unpublished") != b"0"
        began = time.monotonic()
        mount.stop()
        assert time.monotonic() - began < 5  # (it waited the 10 s out before)
        mount.start()
        assert not again.exists() and sorted(os.listdir(mount.backing)) == [".kvfs"]
        assert publishes(mount) == 0
    finally:
        mount.stop()


@contextmanager
def released_later(fd: int) -> Iterator[None]:
    """``fd`` closed (a FLUSH) while a dup keeps the file open: its RELEASE comes only as the
    block ends, so what the block does meets a closed file that no release has published."""
    held = os.dup(fd)
    os.close(fd)
    try:
        yield
    finally:
        os.close(held)


def test_a_rename_over_a_stored_chunk_returns_once_the_new_bytes_replaced_it(
    fresh_mount: Mount,
) -> None:
    """Two engines store one key: the second renames its closed temp file over the chunk the
    first published. Once that rename has returned, the name must hold the new bytes on the
    backing store (a kill -9 then loses nothing), never the old ones gone and the new ones
    still to come."""
    tmp, final = fresh_mount.path / "k.tmp", fresh_mount.path / "k"
    final.write_bytes(b"a" * CHUNK)
    fresh_mount.settle()
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"b" * CHUNK)
    with released_later(fd):
        os.rename(tmp, final)
        assert (fresh_mount.backing / "k").read_bytes() == b"b" * CHUNK
    fresh_mount.settle()
    assert final.read_bytes() == b"b" * CHUNK and not tmp.exists()
    assert sorted(os.listdir(fresh_mount.backing)) == [".kvfs", "k"]


def test_a_rewritten_chunk_renamed_over_another_returns_once_its_new_bytes_are_there(
    fresh_mount: Mount,
) -> None:
    """A published file opened again, rewritten and closed (a dup still open: its RELEASE
    waits), then renamed over another chunk: once the rename has returned, the target's name
    holds the rewritten bytes on the backing store, neither chunk's old bytes."""
    src, dst = fresh_mount.path / "a", fresh_mount.path / "b"
    src.write_bytes(b"a" * CHUNK)
    dst.write_bytes(b"b" * CHUNK)
    fresh_mount.settle()
    fd = os.open(src, os.O_WRONLY)
    os.pwrite(fd, b"c" * CHUNK, 0)
    with released_later(fd):
        os.rename(src, dst)
        assert (fresh_mount.backing / "b").read_bytes() == b"c" * CHUNK
    fresh_mount.settle()
    assert dst.read_bytes() == b"c" * CHUNK and not src.exists()
    assert sorted(os.listdir(fresh_mount.backing)) == [".kvfs", "b"]


def test_a_writer_killed_mid_file_leaves_no_partial_file_under_its_name(
    fresh_mount: Mount,
) -> None:
    path = fresh_mount.path / "chunk.bin"
    vllm_io.store(str(path), vllm_io.chunk_bytes(1, 4 << 20))  # an older, whole version
    fresh = fresh_mount.path / "fresh.bin"
    for target in (path, fresh):
        done = subprocess.run([sys.executable, "-c", WRITER, str(target)], check=False)
        assert done.returncode == -signal.SIGKILL
    fresh_mount.settle()
    assert vllm_io.load(str(path), 4 << 20) == vllm_io.chunk_bytes(1, 4 << 20)
    assert (fresh_mount.backing / "chunk.bin").read_bytes() == vllm_io.chunk_bytes(1, 4 << 20)
    assert not fresh.exists() and not (fresh_mount.backing / "fresh.bin").exists()
    fresh_mount.restart()  # and nothing partial waits in the backing store either
    assert sorted(os.listdir(fresh_mount.path)) == ["chunk.bin"]


INHERITED = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    child = os.fork()
    if child == 0:  # writes a quarter of the chunk through the descriptor it inherited, and dies
        os.write(fd, b"p" * (1 << 20))
        os.kill(os.getpid(), 9)
    os.close(fd)  # the opener closes its copy, alive and well
    _, status = os.waitpid(child, 0)
    sys.exit(0 if os.WIFSIGNALED(status) else 1)
    """
)


def test_a_file_whose_last_writer_was_killed_mid_file_is_not_published(
    fresh_mount: Mount,
) -> None:
    """The writer killed with the file open need not be the process that created it: a child
    that inherited the descriptor, wrote through it and was killed leaves nothing under the
    name either, though the creator closed its copy and lives on. (Where the FLUSH names the
    thread that closes: kvfs's own session; pyfuse3 tells the daemon only who opened it.)"""
    usage = fresh_mount.usage()
    if usage["session"]["name"] != "kernel":
        pytest.skip("pyfuse3's flush() is not told its caller: the opener's kill is checked")
    path = fresh_mount.path / "inherited.bin"
    subprocess.run([sys.executable, "-c", INHERITED, str(path)], check=True)
    fresh_mount.settle()
    assert not path.exists() and not (fresh_mount.backing / "inherited.bin").exists()


def test_a_quarantined_chunk_is_gone_for_every_later_lookup_and_never_read_short(
    unscrubbed_mount: Mount,
) -> None:
    for key in range(12):  # the kernel drops names asynchronously unless told to wait
        path = vllm_io.chunk_path(str(unscrubbed_mount.path), key)
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
        resolved = os.open(path, os.O_PATH)  # a name the kernel resolved before the damage
        try:
            unscrubbed_mount.settle()
            flip_byte(unscrubbed_mount.on_backing(path))
            with pytest.raises(OSError) as err:
                vllm_io.load(path, CHUNK, o_direct=key % 2 == 0)
            assert err.value.errno == errno.EIO
            assert not os.access(path, os.F_OK)
            # Never zero bytes while stat says CHUNK.
            with pytest.raises(OSError) as err, open(f"/proc/self/fd/{resolved}", "rb") as stale:
                stale.read()
            assert err.value.errno in (errno.ENOENT, errno.ESTALE, errno.EIO)
        finally:
            os.close(resolved)
    assert os.getxattr(unscrubbed_mount.path, "user.kvfs.checksum_failures") == b"12"


def rewrite_in_place(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)  # no O_TRUNC, no temp name: the same inode
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


@pytest.fixture
def served_mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount that serves every read: its readers of a chunk and an in-place rewriter of it
    may hold it at once (a reader passed through pins the file's backing in the kernel, which
    then refuses a writer's open: test_passthrough)."""
    mount = make_mount(tmp_path, "--verify", "every-read")
    try:
        yield mount.start()
    finally:
        mount.stop()


def test_a_reader_of_the_old_version_is_not_checked_against_the_new_one(
    served_mount: Mount,
) -> None:
    path = str(served_mount.path / "f")
    old, new = vllm_io.chunk_bytes(1, CHUNK), vllm_io.chunk_bytes(2, CHUNK)
    vllm_io.store(path, old)
    served_mount.settle()  # else the reader may pass through to the temp file (test_passthrough)
    with open(path, "rb") as reader:  # opened: its version is fixed, not yet read
        rewrite_in_place(path, new)
        served_mount.settle()
        assert reader.read() == old
    assert vllm_io.load(path, CHUNK) == new
    assert os.getxattr(served_mount.path, "user.kvfs.checksum_failures") == b"0"
    assert not os.listdir(served_mount.backing / ".kvfs" / "quarantine")


def test_after_an_in_place_rewrite_a_fresh_read_gets_the_new_bytes(served_mount: Mount) -> None:
    """Even when a reader of the old version fills the page cache after the rewrite."""
    path = str(served_mount.path / "f")
    size = 4 << 20
    versions = [vllm_io.chunk_bytes(k, size) for k in range(3)]
    vllm_io.store(path, versions[0])
    served_mount.settle()  # else the reader may pass through to the temp file (test_passthrough)
    for previous, current in itertools.pairwise(versions):
        with open(path, "rb", buffering=0) as old_reader:
            assert old_reader.read(4096) == previous[:4096]
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)  # no O_TRUNC, no temp name
            try:
                aligned = mmap.mmap(-1, size)
                aligned.write(current)
                os.pwrite(fd, aligned, 0)
            finally:
                os.close(fd)
            served_mount.settle()
            assert old_reader.read() == previous[4096:]  # its version, through the page cache
        with open(path, "rb") as f:
            assert f.read() == current
        assert vllm_io.load(path, size, o_direct=True) == current
