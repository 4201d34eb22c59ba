"""A dead daemon: writers get an error, never the root disk; the mount comes back in place."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs import mountctl
from kvfs.config import daemon_log
from tests.conftest import Mount, kvfs, make_mount, wait_gone
from tools import vllm_io

CHUNK = 64 << 10
KEYS = range(1, 6)
# What a dead mount answers (mountctl.DEAD); EROFS from the guard once the dead mount is gone.
DEAD = mountctl.DEAD
REFUSED = (*DEAD, errno.EROFS)


@pytest.fixture
def dying_mount(tmp_path: Path) -> Iterator[tuple[Mount, int]]:
    """A mount holding a few chunks, and a descriptor of the directory under its mountpoint.

    The descriptor is opened before mounting, so it names the root disk's directory itself:
    whatever lands there while the mount is down shows up in ``os.listdir(fd)``.
    """
    mount = make_mount(tmp_path)
    under = os.open(mount.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mount.start()
        for key in KEYS:
            vllm_io.store(vllm_io.chunk_path(str(mount.path), key), vllm_io.chunk_bytes(key, CHUNK))
        mount.settle()  # published: a daemon killed before a release drops that chunk
        yield mount, under
    finally:
        os.close(under)
        mount.stop()
        assert not mountctl.mount_stack(str(mount.path)), "a mount was left behind"


def kill_daemon(mount: Mount) -> None:
    """kill -9 the daemon, as the OOM killer would, and nothing else."""
    os.kill(mount.pid, signal.SIGKILL)
    wait_gone(mount.pid)


def engine_store(root: Path, key: int) -> None:
    """What vLLM's fs tier does for a store: mkdir -p, then create and write the file."""
    path = vllm_io.chunk_path(str(root), key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))


def assert_refused(root: Path, under: int) -> None:
    with pytest.raises(OSError) as err:
        engine_store(root, 99)
    assert err.value.errno in REFUSED, err.value
    assert os.listdir(under) == [], "a write reached the disk under the mountpoint"


def assert_chunks_back(mount: Mount) -> None:
    for key in KEYS:
        path = vllm_io.chunk_path(str(mount.path), key)
        assert vllm_io.load(path, CHUNK) == vllm_io.chunk_bytes(key, CHUNK)


def test_a_dead_daemon_gives_enotconn_and_writes_never_reach_the_disk(
    dying_mount: tuple[Mount, int],
) -> None:
    mount, under = dying_mount
    kill_daemon(mount)
    assert mountctl.mount_stack(str(mount.path))[-1][0] == "fuse.kvfs"  # no auto_unmount
    with pytest.raises(OSError) as err:
        os.statvfs(mount.path)  # statfs is never answered from the kernel's cache
    assert err.value.errno in DEAD
    assert_refused(mount.path, under)
    with pytest.raises(OSError) as err:
        vllm_io.load(vllm_io.chunk_path(str(mount.path), KEYS[0]), CHUNK)  # a load job
    assert err.value.errno in DEAD


def test_after_a_lazy_unmount_of_the_dead_mount_the_guard_refuses_writes(
    dying_mount: tuple[Mount, int],
) -> None:
    mount, under = dying_mount
    kill_daemon(mount)
    subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], check=True)
    with pytest.raises(OSError) as err:
        engine_store(mount.path, 99)
    assert err.value.errno == errno.EROFS
    assert os.listdir(under) == []


def test_mount_again_over_a_dead_mount_in_place(dying_mount: tuple[Mount, int]) -> None:
    mount, under = dying_mount
    kill_daemon(mount)
    mount.start()  # `kvfs mount` with the same arguments: no "dead mount", no "not empty"
    assert_chunks_back(mount)
    stack = [fstype for fstype, _ in mountctl.mount_stack(str(mount.path))]
    assert stack == ["tmpfs", "fuse.kvfs"], "one guard under one live mount, nothing stale"
    engine_store(mount.path, 7)
    assert os.listdir(under) == []


def test_mount_again_after_the_dead_mount_was_lazily_unmounted(
    dying_mount: tuple[Mount, int],
) -> None:
    mount, under = dying_mount
    kill_daemon(mount)
    subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], check=True)
    mount.start()  # the guard is reused, not refused as "already mounted"
    assert_chunks_back(mount)
    assert [t for t, _ in mountctl.mount_stack(str(mount.path))] == ["tmpfs", "fuse.kvfs"]
    assert os.listdir(under) == []


def test_umount_of_a_dead_mount_removes_it_and_the_guard(dying_mount: tuple[Mount, int]) -> None:
    mount, under = dying_mount
    kill_daemon(mount)
    kvfs("umount", str(mount.path))
    assert mountctl.mount_stack(str(mount.path)) == []
    assert os.listdir(under) == []


def test_kill_leaves_no_mount_behind(dying_mount: tuple[Mount, int]) -> None:
    mount, _ = dying_mount
    mount.kill()
    assert mountctl.mount_stack(str(mount.path)) == []
    mount.start()
    assert_chunks_back(mount)


def _wait_for_new_daemon(mount: Mount, old: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
        except OSError:
            pid = old
        if pid != old:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"no new daemon at {mount.path} after {timeout}s")


def test_supervise_restarts_a_killed_daemon_in_place(tmp_path: Path) -> None:
    mount = make_mount(tmp_path, "--supervise")
    under = os.open(mount.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mount.start()
        [supervisor] = mountctl.supervisors(str(mount.path))
        again = kvfs("mount", str(mount.path), "--backing", str(mount.backing), check=False)
        assert again.returncode == 2 and f"supervised by kvfs (supervisor pid {supervisor})" in (
            again.stderr
        )
        for key in KEYS:
            vllm_io.store(vllm_io.chunk_path(str(mount.path), key), vllm_io.chunk_bytes(key, CHUNK))
        mount.settle()
        for _ in range(2):  # a second death is handled like the first
            old = mount.pid
            started = time.monotonic()
            kill_daemon(mount)
            mount.pid = _wait_for_new_daemon(mount, old, timeout=10)
            assert time.monotonic() - started < 8  # "within a few seconds", even on a busy CI
            assert_chunks_back(mount)
            assert mountctl.supervisors(str(mount.path)) == [supervisor]
        engine_store(mount.path, 7)
        assert os.listdir(under) == []
        log = daemon_log(mount.path).read_text()
        assert f"daemon pid {old} died (killed by signal 9)" in log
        assert f"restarted: daemon pid {mount.pid} serves {mount.path}" in log
        kvfs("umount", str(mount.path))
        wait_gone(supervisor, timeout=10)
        assert mountctl.mount_stack(str(mount.path)) == []
    finally:
        os.close(under)
        mount.stop()
        for pid in mountctl.supervisors(str(mount.path)):
            os.kill(pid, signal.SIGKILL)


def test_a_clean_umount_is_not_restarted(tmp_path: Path) -> None:
    mount = make_mount(tmp_path, "--supervise")
    try:
        mount.start()
        [supervisor] = mountctl.supervisors(str(mount.path))
        subprocess.run(["fusermount3", "-u", str(mount.path)], check=True)  # not kvfs umount
        wait_gone(mount.pid)
        wait_gone(supervisor, timeout=10)  # the daemon exited cleanly: nothing to restart
        assert [t for t, _ in mountctl.mount_stack(str(mount.path))] == ["tmpfs"]
    finally:
        mount.stop()
        for pid in mountctl.supervisors(str(mount.path)):
            os.kill(pid, signal.SIGKILL)
    assert mountctl.mount_stack(str(mount.path)) == []
