"""Fixtures: real kvfs mounts (through the `kvfs` command), always unmounted afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfs import config, mountctl

KVFS = [sys.executable, "-m", "kvfs.cli"]


def kvfs(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the kvfs command line, as an operator would."""
    done = subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"kvfs {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass
class Mount:
    path: Path
    backing: Path
    options: tuple[str, ...] = ()
    pid: int = 0

    def start(self) -> Mount:
        kvfs("mount", str(self.path), "--backing", str(self.backing), *self.options)
        self.pid = int(os.getxattr(self.path, "user.kvfs.pid"))
        return self

    def stop(self) -> None:
        """Unmount, however the daemon is doing (alive, dead, supervised); never leaves a mount
        behind, the read-only guard included. Then fail if the daemon logged a traceback: a
        bug it answered with EIO, which a test may not see otherwise."""
        path = str(self.path)
        busy = mountctl.mount_stack(path) or mountctl.supervisors(path)
        if busy and kvfs("umount", path, check=False).returncode != 0:
            force_unmount(self.path)
        if self.pid:
            wait_gone(self.pid)
        log = config.daemon_log(self.path)
        text = log.read_text(errors="replace") if log.exists() else ""
        if "Traceback" in text:
            first = text.index("Traceback")
            raise AssertionError(f"the daemon logged a traceback ({log}):\n{text[first:][:3000]}")

    def settle(self, timeout: float = 10, sealed: bool = True) -> None:
        """Wait until every file written through the mount is published (each is, at its
        last release, which the kernel sends after close() has returned), and, ``sealed``,
        has its checksum (taken after the publish for files written O_DIRECT in passthrough)."""
        deadline = time.monotonic() + timeout
        counts = ("user.kvfs.unpublished", "user.kvfs.unsealed")
        for waiting in counts if sealed else counts[:1]:
            while os.getxattr(self.path, waiting) != b"0":
                assert time.monotonic() < deadline, f"{waiting} stays above 0"
                time.sleep(0.005)

    def on_backing(self, path: str | Path) -> Path:
        """Where ``path`` (under the mount) lies in the backing directory, once every file
        written through the mount is published there."""
        self.settle()
        return self.backing / Path(path).relative_to(self.path)

    def usage(self) -> dict[str, Any]:
        """The mount's ``.kvfs/usage.json``, read now."""
        return dict(json.loads((self.path / ".kvfs" / "usage.json").read_bytes()))

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """kill -9 the daemon, then clear what it leaves: a dead mount (ENOTCONN, no longer
        dropped by the kernel) and the guard under it."""
        os.kill(self.pid, 9)
        wait_gone(self.pid)
        if kvfs("umount", str(self.path), check=False).returncode != 0:
            force_unmount(self.path)
        assert not mountctl.mount_stack(str(self.path)), "kill left a mount behind"


def flip_byte(path: str | Path, offset: int = 1000) -> None:
    """Change one byte of a file behind the mount's back (a disk's corruption)."""
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0xFF]), offset)
    finally:
        os.close(fd)


def force_unmount(path: Path) -> None:
    """The last resort: stop supervisors, detach every mount on ``path``, top first."""
    for pid in mountctl.supervisors(str(path)):
        os.kill(pid, 9)
        wait_gone(pid)
    for _ in mountctl.mount_stack(str(path)):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


NOBODY = 65534  # an unprivileged user every Debian has


def as_nobody(*command: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as user and group nobody, no supplementary groups."""
    return subprocess.run(
        command,
        cwd=cwd,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not mountctl.running(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still running after {timeout}s")


# The mount tests run once per FUSE session: the default run over pyfuse3 (libfuse), then
# `make test` runs them again with KVFS_TEST_SESSION=kernel (kvfs's own session, on /dev/fuse,
# which `--session auto` picks for root), and a third time with KVFS_TEST_IO_URING=auto as well
# (the same session over FUSE-over-io_uring, with the kernel's fuse.enable_uring set for that
# run).
SESSION_OPTIONS: tuple[str, ...] = ("--session", os.environ.get("KVFS_TEST_SESSION", "pyfuse3"))
if SESSION_OPTIONS[1] == "kernel":
    SESSION_OPTIONS += ("--io-uring", os.environ.get("KVFS_TEST_IO_URING", "off"))
if os.environ.get("KVFS_TEST_IO_URING") == "auto":  # a run over io_uring must not test /dev/fuse
    with open("/sys/module/fuse/parameters/enable_uring") as _f:
        assert _f.read().strip() == "Y", "KVFS_TEST_IO_URING=auto needs fuse.enable_uring=Y"


def make_mount(tmp: Path, *options: str) -> Mount:
    (tmp / "mnt").mkdir()
    (tmp / "backing").mkdir()
    return Mount(tmp / "mnt", tmp / "backing", (*SESSION_OPTIONS, *options))


@pytest.fixture(scope="module")
def kv_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """A fresh kvfs mount for the test module."""
    mount = make_mount(tmp_path_factory.mktemp("kvfs"))
    try:
        yield mount.start()
    finally:
        mount.stop()


@pytest.fixture
def fresh_mount(tmp_path: Path) -> Iterator[Mount]:
    """A kvfs mount of the test's own, for tests that restart or kill the daemon."""
    mount = make_mount(tmp_path)
    try:
        yield mount.start()
    finally:
        mount.stop()


@pytest.fixture
def unscrubbed_mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount of the test's own without the background scrub, for tests that flip a byte and
    then check that their next step finds it: the scrub (a pass about every second over a
    small tree) may find it first on a loaded machine and quarantine the file (a `kvfs verify`
    subprocess then found nothing to report). test_passthrough.py tests the scrub."""
    mount = make_mount(tmp_path, "--scrub-rate", "0")
    try:
        yield mount.start()
    finally:
        mount.stop()


@contextmanager
def buffered_mount(tmp: Path, *options: str) -> Iterator[Mount]:
    """A mount whose writes go through the daemon's write buffer: the pyfuse3 session, in both
    test runs (the kernel session passes writes through to the backing file: no buffer)."""
    mount = make_mount(tmp, *options, "--session", "pyfuse3")
    try:
        yield mount.start()
    finally:
        mount.stop()


@contextmanager
def small_filesystem(where: Path, fstype: str, options: str = "") -> Iterator[Path]:
    """A filesystem of its own (tmpfs of a set size, ramfs without O_DIRECT), always unmounted."""
    where.mkdir(parents=True, exist_ok=True)
    args = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    subprocess.run(args, check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def drop_dentries(path: Path) -> bool:
    """Make the kernel forget the dentries and inodes it can (every filesystem's); whether
    ``path``'s are among them (a tmpfs keeps its own: they are its files)."""
    fstype = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    return fstype.stdout.strip() != "tmpfs"


def mappings(path: Path) -> list[list[str]]:
    """The lines of each of this process's mappings of the file at ``path``, found by device
    and inode (an O_TMPFILE's mapping keeps its first name, /dev/shm/#INO)."""
    st = os.stat(path)
    dev, ino = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino)
    found: list[list[str]] = []
    current: list[str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            current = [] if fields[3:5] == [dev, ino] else None
            if current is not None:
                found.append(current)
        elif current is not None:
            current.append(line)
    return found
