"""A writer's declared checksum (``user.kvfs.checksum`` set on a file it is writing, as kvfs's
connector does): a passthrough file is published with it instead of being read back from the
disk (its bytes never pass the daemon), and the scrub checks the disk against it later; where
the daemon holds the bytes, they must match it; anything else is refused and changes nothing."""

from __future__ import annotations

import errno
import os
import time
import uuid
from pathlib import Path

import pytest

from kvfs import checksum, chunk_io
from tests.conftest import Mount, buffered_mount, make_mount
from tools import vllm_io

CHUNK = 1 << 20  # past objects.CHECKSUM_LATER_MIN: an O_DIRECT file this large is read back
XATTR = checksum.XATTR


def passthrough_mount(tmp_path: Path, scrub_rate: str = "0") -> Mount:
    options = ("--session", "kernel", "--verify", "first-read", "--scrub-rate", scrub_rate)
    return make_mount(tmp_path, *options).start()


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "read_back"])
def test_a_declared_checksum_is_kept_and_the_file_never_read_back(
    tmp_path: Path, declare: bool
) -> None:
    mount = passthrough_mount(tmp_path)
    try:
        path = vllm_io.chunk_path(str(mount.path), 1)
        data = vllm_io.chunk(1, CHUNK)
        digest = checksum.checksum(data)
        assert chunk_io.store(path, data, o_direct=True, declare=declare)
        backing = mount.on_backing(path)  # published and sealed
        assert os.getxattr(backing, XATTR) == os.getxattr(path, XATTR) == digest.encode()
        usage = mount.usage()
        assert usage["counters"]["checksums_declared"] == int(declare)
        assert usage["checksum_backlog"]["deferred"] == int(not declare)  # the sealer's read-back
        assert vllm_io.load(path, CHUNK, o_direct=True) == bytes(data)
        assert mount.usage()["counters"]["bytes_read"] == 0  # passed through, as any own publish
    finally:
        mount.stop()


def test_a_wrong_declaration_in_passthrough_is_found_by_the_scrub(tmp_path: Path) -> None:
    """The daemon cannot check bytes it never saw: the file is published with the checksum its
    writer declared, and the scrub finds that the disk holds other bytes and quarantines it (a
    dropped chunk, never one served against a checksum it fails)."""
    mount = passthrough_mount(tmp_path, scrub_rate="1G")
    try:
        good, bad = (vllm_io.chunk_path(str(mount.path), k) for k in (1, 2))
        assert chunk_io.store(good, vllm_io.chunk(1, CHUNK), o_direct=True, declare=True)
        os.makedirs(os.path.dirname(bad), exist_ok=True)
        fd = os.open(bad, os.O_CREAT | os.O_WRONLY | os.O_DIRECT)
        try:
            os.write(fd, vllm_io.chunk(2, CHUNK))
            os.setxattr(fd, XATTR, checksum.checksum(b"other bytes").encode())
        finally:
            os.close(fd)
        deadline = time.monotonic() + 10
        while os.access(bad, os.F_OK):
            assert time.monotonic() < deadline, "the scrub did not find the wrong declaration"
            time.sleep(0.05)
        usage = mount.usage()
        assert usage["scrub"]["failures"] == 1 and usage["checksum_failures"] == 1
        assert len(os.listdir(mount.backing / ".kvfs" / "quarantine")) == 1
        assert vllm_io.load(good, CHUNK, o_direct=True) == vllm_io.chunk_bytes(1, CHUNK)
    finally:
        mount.stop()


def test_a_buffered_file_is_published_only_if_its_bytes_match_the_declaration(
    tmp_path: Path,
) -> None:
    """Where the daemon holds the bytes (the pyfuse3 session's write buffer) it checksums them
    itself: a declaration that differs fails the writer's close (EBADMSG) and publishes
    nothing; one that matches publishes as usual."""
    with buffered_mount(tmp_path) as mount:
        path = mount.path / "chunk"
        data = os.urandom(CHUNK)
        with open(path, "wb") as f:
            f.write(data)
            os.setxattr(f.fileno(), XATTR, checksum.checksum(b"other bytes").encode())
            with pytest.raises(OSError) as err:
                f.close()
        assert err.value.errno == errno.EBADMSG
        mount.settle()
        assert not path.exists() and not mount.on_backing(path).exists()
        usage = mount.usage()
        assert usage["counters"]["publish_failures"]["checksum"] == 1
        assert usage["counters"]["publishes"] == 0

        with open(path, "wb") as f:
            f.write(data)
            os.setxattr(f.fileno(), XATTR, checksum.checksum(data).encode())
        assert path.read_bytes() == data
        assert os.getxattr(mount.on_backing(path), XATTR) == checksum.checksum(data).encode()
        assert mount.usage()["counters"]["checksums_declared"] == 1


@pytest.mark.parametrize(
    "value",
    [b"", b"garbage", b"xxh3-64:", b"xxh3-64:0123456789ABCDEF", b"xxh3-64:0123456789abcdef0",
     b"xxh3-64:0123456789abcde", b"md5:0123456789abcdef", b"xxh3-64:0123456789abcdef\n",
     b"\xff" * 300],
    ids=["empty", "garbage", "no_digits", "uppercase", "too_long", "too_short", "other_algorithm",
         "newline", "binary"],
)  # fmt: skip
def test_a_malformed_declaration_is_refused_and_changes_nothing(
    kv_mount: Mount, value: bytes
) -> None:
    path = kv_mount.path / f"malformed-{uuid.uuid4().hex[:8]}"
    data = os.urandom(300_000)
    with open(path, "wb") as f:
        f.write(data)
        with pytest.raises(OSError) as err:
            os.setxattr(f.fileno(), XATTR, value)
        assert err.value.errno == errno.EINVAL
    assert path.read_bytes() == data  # published as if nothing had been asked
    assert os.getxattr(kv_mount.on_backing(path), XATTR) == checksum.checksum(data).encode()


def test_only_a_file_being_written_takes_a_declaration(kv_mount: Mount) -> None:
    """A published file's checksum is the daemon's: neither set nor removed (EPERM), nor is
    one declared for a directory; the file and its checksum stay as they were."""
    path = kv_mount.path / f"published-{uuid.uuid4().hex[:8]}"
    data = os.urandom(5000)
    path.write_bytes(data)
    kv_mount.settle()
    digest = checksum.checksum(data).encode()
    other = checksum.checksum(b"other bytes").encode()
    directory = kv_mount.path / f"dir-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    for target in (path, directory, kv_mount.path):
        with pytest.raises(OSError) as err:
            os.setxattr(target, XATTR, other)
        assert err.value.errno == errno.EPERM
    with pytest.raises(OSError) as err:
        os.removexattr(path, XATTR)
    assert err.value.errno == errno.EPERM
    assert os.getxattr(path, XATTR) == os.getxattr(kv_mount.on_backing(path), XATTR) == digest
    assert path.read_bytes() == data
