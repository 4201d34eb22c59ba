"""Start and stop mount daemons: the checks before mounting, detaching, and unmounting.

This runs in the ``kvfs`` command, not in the daemon, and imports nothing of FUSE: it checks that
the pieces are there and starts ``python -m kvfs.mount``, which does.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import select
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

from kvfs import layout
from kvfs.config import daemon_log

READY = "ready"


class MountError(RuntimeError):
    """A mount or unmount cannot go ahead; the message is one line for the operator."""


def kvfs_mounts() -> dict[str, str]:
    """Mountpoint → major:minor of every kvfs mount on this machine."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "fuse.kvfs":
                mounts[_unescape(fields[4])] = fields[2]
    return mounts


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape")  # mountinfo escapes space as \040


def _is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return True


def preflight(mountpoint: Path, backing: Path) -> None:
    """Everything that can be checked before mounting; raises MountError with the first problem."""
    try:
        fuse_dev = os.stat("/dev/fuse").st_mode
    except OSError:
        fuse_dev = 0
    if not stat.S_ISCHR(fuse_dev):
        raise MountError(
            "no /dev/fuse: load the fuse module (modprobe fuse), or give the "
            "container --device /dev/fuse"
        )
    try:
        ctypes.CDLL("libfuse3.so.3")
    except OSError:
        raise MountError("libfuse3 is missing: apt-get install fuse3 libfuse3-dev") from None
    if shutil.which("fusermount3") is None:
        raise MountError("fusermount3 is missing: apt-get install fuse3")
    if importlib.util.find_spec("pyfuse3") is None or importlib.util.find_spec("trio") is None:
        raise MountError("the mount needs pyfuse3 and trio: pip install 'kvfs[mount]'")
    mnt = str(mountpoint)
    try:
        st = os.stat(mnt)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mnt} does not exist (mkdir -p {mnt})") from None
    except OSError as err:
        if err.errno == errno.ENOTCONN:
            raise MountError(f"{mnt} holds a dead mount: kvfs umount {mnt}") from None
        raise MountError(f"mountpoint {mnt}: {err.strerror}") from None
    if mnt in kvfs_mounts() or _is_mountpoint(mnt):
        raise MountError(f"{mnt} is already mounted")
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mnt} is not a directory")
    if os.listdir(mnt):
        raise MountError(f"mountpoint {mnt} is not empty")
    back = str(backing)
    if back == mnt or back.startswith(mnt + "/") or mnt.startswith(back + "/"):
        raise MountError(
            f"backing directory {back} and mountpoint {mnt} must not contain each other"
        )
    try:
        os.makedirs(os.path.join(back, os.fsdecode(layout.PRIVATE_DIR)), exist_ok=True)
        probe = os.path.join(back, os.fsdecode(layout.PRIVATE_DIR), f"probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"kvfs")
        os.unlink(probe)
    except OSError as err:
        raise MountError(f"backing directory {back} is not writable: {err.strerror}") from None


def daemon_command(mountpoint: Path, backing: Path, options: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvfs.mount",
        str(mountpoint),
        "--backing",
        str(backing),
        *options,
    ]


def mount(mountpoint: Path, backing: Path, options: list[str], foreground: bool) -> int:
    """Mount and return the daemon's pid once the mount answers (or run it, if foreground)."""
    mountpoint, backing = mountpoint.absolute(), backing.absolute()
    preflight(mountpoint, backing)
    command = daemon_command(mountpoint, backing, options)
    if foreground:
        os.execv(sys.executable, command)
    log_path = daemon_log(mountpoint)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*command, "--ready-fd", str(write_end)],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    os.close(write_end)
    message = _read_line(read_end)
    os.close(read_end)
    if message != READY:
        proc.wait()
        if not message:
            message = f"daemon exited with status {proc.returncode}; see {log_path}"
        raise MountError(message.removeprefix("error: "))
    return proc.pid


def _read_line(fd: int) -> str:
    """The daemon's one-line answer; empty if it died first. Scanning a big index takes time,
    so there is no timeout: a dead daemon closes the pipe."""
    data = b""
    while not data.endswith(b"\n"):
        select.select([fd], [], [])
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def unmount(mountpoint: Path, timeout: float = 60.0) -> None:
    """Unmount and wait for the daemon to exit (everything is published before it does)."""
    mnt = os.path.abspath(mountpoint)
    if mnt not in kvfs_mounts():
        raise MountError(f"{mnt} is not a kvfs mount")
    try:
        pid: int | None = int(os.getxattr(mnt, "user.kvfs.pid"))
    except OSError:
        pid = None  # a dead daemon: unmount lazily, nothing to wait for
    command = ["fusermount3", "-u", mnt] if pid else ["fusermount3", "-u", "-z", mnt]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        raise MountError(f"cannot unmount {mnt}: {detail}")
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        if not running(pid):
            return
        time.sleep(0.02)
    if pid:
        raise MountError(f"unmounted {mnt}, but daemon {pid} is still running")


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
