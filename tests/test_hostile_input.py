"""Whatever a client writes, the daemon lives on: bad input fails its own request, clearly."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from pyfuse3 import FUSEError

from kvfs.mount.bridge import contained
from tests.conftest import Mount, buffered_mount, kvfs, make_mount
from tools import vllm_io

CHUNK = 256 << 10
HOSTILE_CONFIGS = {
    "deep": b"[" * 200_000,
    "types": json.dumps(
        {
            "model_name": {"not": "a string"},
            "dtype": 7,
            "blocks_per_file": "x",
            "kv_cache_groups": [{"tokens_per_block": [16]}],
            "hash_block_size": True,
        }
    ).encode(),
    "huge": b'{"model_name": "' + b"m" * (2 << 20) + b'"}',
    "binary": os.urandom(4096),
}


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_a_hostile_config_json_neither_kills_the_daemon_nor_stops_a_remount(
    fresh_mount: Mount,
) -> None:
    for name, data in HOSTILE_CONFIGS.items():
        namespace = fresh_mount.path / f"model-{name}_0123456789ab"
        namespace.mkdir()
        (namespace / "config.json").write_bytes(data)
        vllm_io.store(str(fresh_mount.path / f"{namespace.name}_r0" / "x.bin"), os.urandom(4096))
    for _ in range(2):  # served, then after a restart that scans them from the backing store
        names = os.listxattr(fresh_mount.path)
        assert b"user.kvfs.pid" not in names and "user.kvfs.pid" in names
        for namespace in fresh_mount.path.iterdir():
            for attr in os.listxattr(namespace):
                os.getxattr(namespace, attr)  # every namespace answers, model unknown or not
        report = json.loads(kvfs("du", "--json", str(fresh_mount.path)).stdout)
        assert report["files"] == 2 * len(HOSTILE_CONFIGS)
        kvfs("ls", str(fresh_mount.path))
        fresh_mount.settle()
        fresh_mount.restart()


def test_a_handler_that_fails_unexpectedly_fails_only_its_request() -> None:
    async def buggy() -> None:
        raise ValueError("a bug")

    async def refused() -> None:
        raise PermissionError(errno.EACCES, "no")

    async def main() -> None:
        for handler, expected in ((buggy, errno.EIO), (refused, errno.EACCES)):
            with pytest.raises(FUSEError) as err:
                await contained("op", handler)()
            assert err.value.errno == expected

    trio.run(main)


@pytest.fixture
def small_buffer_mount(tmp_path: Path) -> Iterator[Mount]:
    """Files written through the daemon's buffer (a mount that passes writes through has
    none: tests/test_passthrough.py checks what bounds those)."""
    with buffered_mount(tmp_path, "--write-buffer", "4M", "--io-timeout", "3") as mount:
        yield mount


def test_a_file_larger_than_the_write_buffer_fails_at_once_and_publishes_nothing(
    small_buffer_mount: Mount,
) -> None:
    path = small_buffer_mount.path / "big"
    start = time.monotonic()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for _ in range(4):
            assert os.write(fd, os.urandom(1 << 20)) == 1 << 20
        with pytest.raises(OSError) as err:
            os.write(fd, b"x")  # past the 4 MiB buffer: it would wait on itself
        assert err.value.errno == errno.EFBIG
    finally:
        with pytest.raises(OSError) as closed:
            os.close(fd)  # the writer hears it again: the file is not what it meant
    assert closed.value.errno == errno.EFBIG
    assert time.monotonic() - start < 2  # no wait for the deadline
    small_buffer_mount.settle()
    assert not path.exists() and not (small_buffer_mount.backing / "big").exists()
    # The budget was given back: files that fit still go through.
    for key in range(3):
        target = str(small_buffer_mount.path / f"ok{key}")
        assert vllm_io.store(target, vllm_io.chunk_bytes(key, 2 << 20))
        assert vllm_io.load(target, 2 << 20) == vllm_io.chunk_bytes(key, 2 << 20)


def test_a_deadline_of_zero_or_forever_is_refused(tmp_path: Path) -> None:
    mount = make_mount(tmp_path, "--io-timeout", "0")
    done = kvfs(
        "mount", str(mount.path), "--backing", str(mount.backing), "--io-timeout", "0", check=False
    )
    assert done.returncode != 0 and "io_timeout" in done.stderr
    assert "Traceback" not in done.stderr
    assert str(mount.path) not in Path("/proc/self/mountinfo").read_text()


def test_sparse_files_take_no_daemon_memory_and_stay_sparse(fresh_mount: Mount) -> None:
    """Neither in the write buffer nor while the file is checksummed at its publish: a hole is
    hashed as zeros, not faulted into the page cache (a 1 GiB hole mapped whole took the
    daemon's resident set to ~1 GB, and as much page cache from what the tier caches)."""
    before = rss(fresh_mount.pid)
    path = fresh_mount.path / "sparse"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # the whole default write buffer, as a hole
        f.seek((1 << 30) - 3)
        f.write(b"end")
    peak = rss(fresh_mount.pid)
    deadline = time.monotonic() + 30
    while any(
        os.getxattr(fresh_mount.path, n) != b"0"
        for n in ("user.kvfs.unpublished", "user.kvfs.unsealed")
    ):
        assert time.monotonic() < deadline, "not published"
        peak = max(peak, rss(fresh_mount.pid))
        time.sleep(0.002)
    assert max(peak, rss(fresh_mount.pid)) - before < 64 << 20
    backing = fresh_mount.backing / "sparse"
    assert os.stat(path).st_size == backing.stat().st_size == 1 << 30
    assert backing.stat().st_blocks * 512 <= 2 << 20  # the extent written, not a gigabyte
    with open(backing, "rb") as f:
        f.seek((1 << 30) - 4096)
        assert f.read() == bytes(4093) + b"end"


def test_a_write_past_the_buffer_at_a_far_offset_takes_no_memory_and_fails(
    small_buffer_mount: Mount,
) -> None:
    before = rss(small_buffer_mount.pid)
    fd = os.open(small_buffer_mount.path / "beyond", os.O_CREAT | os.O_WRONLY, 0o644)
    with pytest.raises(OSError) as err:
        os.pwrite(fd, b"x", 4 << 20)  # ends past what one file may hold
    assert err.value.errno == errno.EFBIG
    with pytest.raises(OSError):
        os.close(fd)
    small_buffer_mount.settle()
    assert rss(small_buffer_mount.pid) - before < 16 << 20
    assert not (small_buffer_mount.path / "beyond").exists()


def test_the_control_directory_answers_with_the_errnos_of_a_read_only_tree(
    fresh_mount: Mount,
) -> None:
    usage = fresh_mount.path / ".kvfs" / "usage.json"
    for path in (usage, usage.parent):
        assert os.listxattr(path) == []
        with pytest.raises(OSError) as err:
            os.getxattr(path, "user.kvfs.checksum")
        assert err.value.errno == errno.ENODATA
        for change in (
            lambda p: os.setxattr(p, "user.kvfs.pin", b"1"),
            lambda p: os.removexattr(p, "user.kvfs.pin"),
            lambda p: os.chmod(p, 0o600),
            lambda p: os.utime(p),
        ):
            with pytest.raises(OSError) as err:
                change(path)
            assert err.value.errno == errno.EROFS
    listing = subprocess.run(["ls", "-l", str(usage.parent)], capture_output=True, text=True)
    assert listing.returncode == 0 and listing.stderr == ""
    assert "usage.json" in listing.stdout
