"""The watchdog a daemon starts beside its mount: when the daemon dies without unmounting, it
aborts the mount's FUSE connection, so that every request still waiting on the dead daemon
fails (ENOTCONN) instead of waiting for ever.

The kernel aborts a connection itself once the daemon's last thread has exited and closed
/dev/fuse. A thread that SIGKILL cannot reach keeps it open: a FUSE invalidation (a name
evicted, quarantined or removed around the mount) takes the lock of its directory, which a
client's rename or create there holds while it waits for this very daemon's answer (kernel
fs/fuse/dir.c, fuse_reverse_inval_entry). Killed then, the daemon never finishes exiting, and
its clients (vLLM's I/O threads) and the invalidating thread wait on each other for ever: a
kill -9 fuzz of writers and daemon hung this way in its first minute. A worker stuck in a hung
backing store does the same. Nothing inside the daemon can break that cycle; the connection's
abort (fusectl's ``abort`` file) does.

It never touches the mount (a stat there would wait on the dead daemon too): /proc and fusectl
only. Run as ``python -m kvfs.watchdog MOUNTPOINT PID CONNECTION``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("kvfs.watchdog")  # (run as __main__)

FUSECTL = Path("/sys/fs/fuse/connections")
POLL_SECONDS = 0.2
# How long a killed daemon's other threads may take to exit before one is taken as stuck.
EXIT_SECONDS = 1.0


def start(mountpoint: str, pid: int) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of the daemon ``pid`` (this process), whose mount is on top of
    ``mountpoint``; None, and a log line why, where the connection cannot be aborted from
    here (fusectl not mounted, and not root to mount it)."""
    from kvfs import mountctl  # (here: the watchdog itself starts without it, in 50 ms)

    connection = mountctl.kvfs_connection(mountpoint)
    if connection is None:
        return None  # (not kvfs on top of it: nothing of ours to abort)
    if not _fusectl():
        log.info("no watchdog: fusectl (%s) is not mounted, and only root may mount it", FUSECTL)
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "kvfs.watchdog", mountpoint, str(pid), str(connection)],
        cwd="/",  # nothing of the mount's filesystem held
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,  # never /dev/fuse: the abort is for when the daemon's copy is stuck
        start_new_session=True,  # a signal to the daemon's group is not for it
    )


def watch(mountpoint: str, pid: int, connection: int) -> bool:
    """Wait for the daemon to die; then, if a thread of it is still there after EXIT_SECONDS
    (its /dev/fuse open), abort its connection. True if it aborted it."""
    born = _start_time(pid)
    identity = _identity(connection)
    if born is None or identity is None:
        return False  # gone already, or never had this connection
    while _running(pid, born, main_only=True):
        time.sleep(POLL_SECONDS)
    deadline = time.monotonic() + EXIT_SECONDS
    while _running(pid, born, main_only=False):
        if time.monotonic() >= deadline:
            return _abort(mountpoint, pid, connection, identity)
        time.sleep(POLL_SECONDS / 2)
    return False  # exited whole: the kernel closed /dev/fuse and ended the connection itself


def _abort(mountpoint: str, pid: int, connection: int, identity: int) -> bool:
    # The connection's fusectl directory is made with it: the same inode means the same
    # connection (a new mount may reuse the device number once this one is gone).
    if _identity(connection) != identity:
        return False
    with contextlib.suppress(OSError):
        (FUSECTL / str(connection) / "abort").write_text("1")
        log.warning(
            "daemon %d of %s died, but a thread of it is stuck and holds its FUSE connection"
            " %d open: aborted it (requests waiting on it fail with ENOTCONN)",
            pid,
            mountpoint,
            connection,
        )
        return True
    return False


def _fusectl() -> bool:
    """Whether fusectl is mounted, mounting it where it is not (root only)."""
    if os.path.ismount(FUSECTL):
        return True
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True, check=False
    )
    return done.returncode == 0 or os.path.ismount(FUSECTL)  # (or another mounted it first)


def _identity(connection: int) -> int | None:
    try:
        return (FUSECTL / str(connection)).stat().st_ino
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, which process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _running(pid: int, born: int, main_only: bool) -> bool:
    """Whether the daemon's main thread (``main_only``), or any of its threads, still runs. A
    killed process's main thread is a zombie at once; a thread stuck in the kernel keeps the
    process, and its /dev/fuse, from ending."""
    if _start_time(pid) != born:
        return False
    if main_only:
        return _runs(f"/proc/{pid}/stat")
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_runs(f"/proc/{pid}/task/{tid}/stat") for tid in threads)


def _runs(stat: str) -> bool:
    """Whether the thread of this /proc stat file has not exited (a zombie has)."""
    try:
        return Path(stat).read_bytes().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    mountpoint, pid, connection = argv[0], int(argv[1]), int(argv[2])
    watch(mountpoint, pid, connection)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
