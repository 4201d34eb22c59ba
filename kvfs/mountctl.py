"""Start, supervise and stop mount daemons: the checks before mounting, the guard, unmounting.

This runs in the ``kvfs`` command (and, with ``--supervise``, in a small supervisor process,
``python -m kvfs.mountctl supervise``), not in the daemon, and imports nothing of FUSE: it
checks that the pieces are there and starts ``python -m kvfs.mount``, which does.

When a daemon dies its mount must never become a directory engines can fill: the daemon mounts
without ``auto_unmount``, so a dead mount stays in place and answers ENOTCONN, and (as root) a
read-only tmpfs, the *guard*, lies under it, so even after someone lazily unmounts the dead mount
writers get EROFS instead of the root disk. ``kvfs mount`` over a dead kvfs mount clears it and
mounts again in place; ``kvfs umount`` removes the mount, the guard and any supervisor.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import importlib.util
import logging
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvfs import control_protocol, layout
from kvfs.config import daemon_log

log = logging.getLogger("kvfs.mountctl")

READY = "ready"
KVFS_TYPE = "fuse.kvfs"
GUARD_SOURCE = "kvfs-guard"  # the guard's name in mountinfo, how we know it is ours
GUARD_DATA = b"size=4k,mode=0555"
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MNT_DETACH = 2
# What a FUSE mount with no daemon answers: ENOTCONN, ECONNABORTED for a request the kernel
# had queued as the daemon died, ECANCELED (over FUSE-over-io_uring) for one its ring had taken.
DEAD = (errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED)
# A daemon restarted by the supervisor waits this long first, doubling after each quick death,
# up to the cap; one that served for STABLE_AFTER seconds resets the wait.
RESTART_DELAY, RESTART_DELAY_MAX, STABLE_AFTER = 0.1, 30.0, 60.0


class MountError(RuntimeError):
    """A mount or unmount cannot go ahead; the message is one line for the operator."""


@dataclass(frozen=True)
class Started:
    """What ``mount`` started: the daemon, and its supervisor if asked for one."""

    pid: int
    supervisor: int | None = None


# -- what is mounted where ------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    id: int
    parent: int
    device: str
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mountinfo() -> list[_Entry]:
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            entries.append(
                _Entry(
                    int(fields[0]),
                    int(fields[1]),
                    fields[2],
                    _unescape(fields[4]),
                    fields[sep + 1],
                    _unescape(fields[sep + 2]),
                )
            )
    return entries


def kvfs_mounts() -> dict[str, str]:
    """Mountpoint → major:minor of every kvfs mount on this machine."""
    return {e.mountpoint: e.device for e in _mountinfo() if e.fstype == KVFS_TYPE}


def kvfs_connection(mountpoint: str) -> int | None:
    """The FUSE connection (its device's minor: its name in fusectl) of the kvfs mount on top
    of ``mountpoint``; None if the top mount is not kvfs."""
    top = _top(os.path.abspath(mountpoint))
    if top is None or top.fstype != KVFS_TYPE:
        return None
    return int(top.device.split(":")[1])


def _stack(mountpoint: str) -> list[_Entry]:
    """The mounts on exactly this path, bottom first (each one is mounted on the one before)."""
    here = [e for e in _mountinfo() if e.mountpoint == mountpoint]
    ids = {e.id for e in here}
    bottom = [e for e in here if e.parent not in ids]
    if len(bottom) != 1:
        return here  # not a simple stack: mountinfo's order is the best guess
    stack = bottom
    while child := [e for e in here if e.parent == stack[-1].id]:
        stack.append(child[0])
    return stack


def mount_stack(mountpoint: str) -> list[tuple[str, str]]:
    """(filesystem type, source) of every mount on this path, bottom first."""
    return [(e.fstype, e.source) for e in _stack(os.path.abspath(mountpoint))]


def _top(mountpoint: str) -> _Entry | None:
    stack = _stack(mountpoint)
    return stack[-1] if stack else None


def _is_guard(entry: _Entry | None) -> bool:
    return entry is not None and entry.fstype == "tmpfs" and entry.source == GUARD_SOURCE


def _is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return True


# -- the guard and dead mounts --------------------------------------------------------------


def _libc_call(name: str, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def ensure_guard(mountpoint: str) -> bool:
    """Put the read-only guard on the mountpoint unless one is there; True if we mounted it.

    Only root may mount it. Without it a dead mount that someone lazily unmounts leaves the
    bare directory (on the root disk) for engines to fill, so its absence is logged.
    """
    if any(_is_guard(e) for e in _stack(mountpoint)):
        return False
    if os.geteuid() != 0:
        log.info("not root: no read-only guard under %s", mountpoint)
        return False
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _libc_call(
            "mount", GUARD_SOURCE.encode(), os.fsencode(mountpoint), b"tmpfs", flags, GUARD_DATA
        )
    except OSError as err:
        log.warning("cannot mount the read-only guard under %s: %s", mountpoint, err.strerror)
        return False
    return True


def remove_guard(mountpoint: str) -> bool:
    """Unmount the guard if it is the top mount on this path; True if it was."""
    if not _is_guard(_top(mountpoint)):
        return False
    try:
        _libc_call("umount2", os.fsencode(mountpoint), 0)
    except OSError as err:
        if err.errno != errno.EBUSY:
            raise MountError(f"cannot remove the guard on {mountpoint}: {err.strerror}") from None
        _libc_call("umount2", os.fsencode(mountpoint), _MNT_DETACH)  # someone's cwd is in it
    return True


def _lazy_unmount(mountpoint: str) -> None:
    done = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True)
    if done.returncode != 0:
        raise MountError(f"cannot unmount {mountpoint}: {_last_line(done.stderr)}")


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else "failed"


def is_dead(mountpoint: str) -> bool:
    """Whether the top mount on this path is a FUSE mount whose daemon is gone.

    Asked with statfs, which the kernel never answers from its cache: a stat of the mount's
    root can still succeed from cached attributes long after the daemon died.
    """
    try:
        os.statvfs(mountpoint)
    except OSError as err:
        return err.errno in DEAD
    return False


def clear_dead_mount(mountpoint: str) -> bool:
    """Lazily unmount dead kvfs mounts on this path (a guard under them stays); True if any.

    Processes that still hold a file or directory of a dead mount keep getting ENOTCONN from
    it; every new path lookup reaches whatever is mounted next.
    """
    cleared = False
    while is_dead(mountpoint):
        top = _top(mountpoint)
        if top is None or top.fstype != KVFS_TYPE:
            kind = top.fstype if top else "unknown"
            raise MountError(f"{mountpoint} holds a dead {kind} mount that is not kvfs's")
        _lazy_unmount(mountpoint)
        log.info("removed the dead kvfs mount on %s", mountpoint)
        cleared = True
    return cleared


def prepare_mountpoint(mountpoint: str) -> bool:
    """Ready the path for the daemon's mount, just before it mounts; True if it added a guard.

    Run in the daemon after its index is built, so the window between clearing a dead mount
    and mounting again is as short as it can be.
    """
    clear_dead_mount(mountpoint)
    top = _top(mountpoint)
    if top is not None and top.fstype == KVFS_TYPE:
        raise MountError(f"{mountpoint} is already mounted")
    if os.listdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is not empty")
    return ensure_guard(mountpoint)


# -- before mounting ------------------------------------------------------------------------


def _check_platform() -> None:
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


def _check_mountpoint(mnt: str) -> None:
    """A free, empty directory (a guard on it is fine), or a dead kvfs mount to replace."""
    top = _top(mnt)
    if top is not None and top.fstype == KVFS_TYPE:
        if is_dead(mnt):
            return  # the daemon replaces it in place, once its index is built
        raise MountError(f"{mnt} is already mounted")
    try:
        st = os.stat(mnt)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mnt} does not exist (mkdir -p {mnt})") from None
    except OSError as err:
        if err.errno in DEAD:
            raise MountError(
                f"{mnt} holds a dead mount that is not kvfs's: umount -l {mnt}"
            ) from None
        raise MountError(f"mountpoint {mnt}: {err.strerror}") from None
    if (top is not None and not _is_guard(top)) or (top is None and _is_mountpoint(mnt)):
        raise MountError(f"{mnt} is already mounted")
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mnt} is not a directory")
    if os.listdir(mnt):
        raise MountError(f"mountpoint {mnt} is not empty")


def _check_backing(back: str, mnt: str) -> None:
    if back == mnt or back.startswith(mnt + "/") or mnt.startswith(back + "/"):
        raise MountError(
            f"backing directory {back} and mountpoint {mnt} must not contain each other"
        )
    # The root of another kvfs: its private area would be that mount's control directory.
    # (Below the root a tier may stack on a tier; the deadline tests stall one that way.)
    if os.path.realpath(back) in kvfs_mounts():
        raise MountError(
            f"backing directory {back} is the root of another kvfs mount: use a directory of "
            "the disk behind it"
        )
    try:
        os.makedirs(os.path.join(back, os.fsdecode(layout.PRIVATE_DIR)), exist_ok=True)
        probe = os.path.join(back, os.fsdecode(layout.PRIVATE_DIR), f"probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"kvfs")
        os.unlink(probe)
    except OSError as err:
        raise MountError(f"backing directory {back} is not writable: {err.strerror}") from None


def preflight(mountpoint: Path, backing: Path) -> None:
    """Everything that can be checked before mounting; raises MountError with the first problem."""
    _check_platform()
    mnt = str(mountpoint)
    running_supervisors = supervisors(mnt)
    if running_supervisors:
        raise MountError(
            f"{mnt} is supervised by kvfs (supervisor pid {running_supervisors[0]}): "
            f"kvfs umount {mnt} first"
        )
    _check_mountpoint(mnt)
    _check_backing(str(backing), mnt)


# -- starting -------------------------------------------------------------------------------


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


def supervisor_command(mountpoint: Path, backing: Path, options: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvfs.mountctl",
        "supervise",
        str(mountpoint),
        "--backing",
        str(backing),
        "--",
        *options,
    ]


def open_log(path: Path) -> int:
    """The daemon's log, for appending: 0640 in a 0750 directory, never through a symlink.

    It names models, paths and addresses, so it is not for every user; an existing log or
    directory left wider open by an older kvfs is tightened. A log past LOG_ROTATE_BYTES is
    moved to ``<log>.1`` first (one old log kept); a long-running daemon's log is rotated by
    logrotate (packaging/logrotate/kvfs: copytruncate, as the daemon appends to its fd).
    """
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    folder = os.lstat(path.parent)
    if not stat.S_ISDIR(folder.st_mode):
        raise MountError(f"log directory {path.parent} is not a directory: refusing to use it")
    if stat.S_IMODE(folder.st_mode) != 0o750:
        os.chmod(path.parent, 0o750)
    _rotate_log(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise MountError(f"daemon log {path} is a symbolic link: refusing to use it") from None
        raise MountError(f"cannot open the daemon log {path}: {err.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise MountError(f"daemon log {path} is not a regular file: refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o640:
        os.fchmod(fd, 0o640)
    os.utime(fd)  # in use from now: prune_logs leaves it alone
    return fd


LOG_ROTATE_BYTES = 16 << 20
# Logs of mountpoints nothing is mounted on: the newest this many stay, the rest are removed at
# the next mount; none written in the last LOG_QUIET seconds (its mount may be starting).
STALE_LOGS_KEPT = 32
LOG_QUIET = 600.0
_LOG_NAME = re.compile(r"(.+\.log)(?:\.\d+)?")


def _rotate_log(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_size > LOG_ROTATE_BYTES:
        os.replace(path, f"{path}.1")


def prune_logs(folder: Path, keep: int = STALE_LOGS_KEPT) -> int:
    """Remove the logs of mountpoints nothing is mounted on, past the newest ``keep``; the
    number removed. Every test or one-off mount leaves a log: without this they pile up."""
    current = {
        daemon_log(Path(e.mountpoint)).name
        for e in _mountinfo()
        if e.fstype == KVFS_TYPE or _is_guard(e)
    }
    quiet_since = time.time() - LOG_QUIET
    stale = []
    with os.scandir(folder) as entries:
        for entry in entries:
            name = _LOG_NAME.fullmatch(entry.name)
            if name is None or name[1] in current:
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < quiet_since:
                stale.append((st.st_mtime, entry.path))
    stale.sort(reverse=True)
    removed = 0
    for _, path in stale[keep:]:
        with contextlib.suppress(FileNotFoundError):  # another mount pruned it first
            os.unlink(path)
            removed += 1
    return removed


def _spawn(command: list[str], **popen: object) -> tuple[subprocess.Popen[bytes], str]:
    """Start a daemon (or supervisor) and wait for its one-line answer on a pipe."""
    read_end, write_end = os.pipe()
    at = command.index("--") if "--" in command else len(command)  # the supervisor's own
    try:
        proc = subprocess.Popen(  # type: ignore[call-overload]
            [*command[:at], "--ready-fd", str(write_end), *command[at:]],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            **popen,
        )
    finally:
        os.close(write_end)
    try:
        message = _read_line(read_end)
    finally:
        os.close(read_end)
    if message != READY:
        proc.wait()
        if not message:
            message = f"daemon exited with {_status(proc.returncode)}"
    return proc, message


def mount(
    mountpoint: Path, backing: Path, options: list[str], foreground: bool, supervise: bool = False
) -> Started:
    """Mount and return once the mount answers (or run the daemon here, if foreground)."""
    mountpoint, backing = mountpoint.absolute(), backing.absolute()
    preflight(mountpoint, backing)
    command = daemon_command(mountpoint, backing, options)
    if foreground:
        os.execv(sys.executable, command)
    if supervise:
        command = supervisor_command(mountpoint, backing, options)
    log_path = daemon_log(mountpoint)
    log_fd = open_log(log_path)
    try:
        prune_logs(log_path.parent)
    except OSError as err:  # housekeeping: never a reason not to mount
        log.warning("cannot prune old logs in %s: %s", log_path.parent, err)
    try:
        proc, message = _spawn(command, stdout=log_fd, stderr=log_fd, start_new_session=True)
    finally:
        os.close(log_fd)
    if message != READY:
        if "exited with" in message:
            message += f"; see {log_path}"
        raise MountError(message.removeprefix("error: "))
    if not supervise:
        return Started(proc.pid)
    return Started(int(os.getxattr(mountpoint, control_protocol.PID)), proc.pid)


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


def _status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode}"
    return f"status {returncode}"


# -- stopping -------------------------------------------------------------------------------


def unmount(mountpoint: Path, timeout: float = 60.0) -> None:
    """Stop the supervisor, unmount, wait for the daemon to exit, remove the guard.

    A dead mount is unmounted lazily. Everything published is on the backing store before the
    daemon exits, so nothing is lost either way.
    """
    mnt = os.path.abspath(mountpoint)
    watching = supervisors(mnt)
    stack = _stack(mnt)
    if not watching and not any(e.fstype == KVFS_TYPE or _is_guard(e) for e in stack):
        raise MountError(f"{mnt} is not a kvfs mount")
    for pid in watching:  # first, or it would restart the daemon we are stopping
        os.kill(pid, signal.SIGTERM)
        if not _wait_exit(pid, timeout):
            raise MountError(f"supervisor {pid} of {mnt} did not stop")
    top = _top(mnt)
    if top is not None and top.fstype == KVFS_TYPE:
        _unmount_fuse(mnt, timeout)
    remove_guard(mnt)


def _unmount_fuse(mnt: str, timeout: float) -> None:
    try:
        pid: int | None = int(os.getxattr(mnt, control_protocol.PID))
    except OSError:
        pid = None  # a dead daemon: unmount lazily, nothing to wait for
    command = ["fusermount3", "-u", mnt] if pid else ["fusermount3", "-u", "-z", mnt]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise MountError(f"cannot unmount {mnt}: {_last_line(done.stderr)}")
    if pid and not _wait_exit(pid, timeout):
        raise MountError(f"unmounted {mnt}, but daemon {pid} is still running")


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: reaped between open and read)
        return False


# -- the supervisor -------------------------------------------------------------------------


def supervisors(mountpoint: str) -> list[int]:
    """Pids of the supervisors of this mountpoint (found by their command line in /proc)."""
    wanted = ["-m", "kvfs.mountctl", "supervise", os.path.abspath(mountpoint)]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [os.fsdecode(a) for a in f.read().split(b"\0")]
        except OSError:
            continue
        if any(argv[i : i + 4] == wanted for i in range(1, 3)) and running(int(entry)):
            found.append(int(entry))
    return sorted(found)


class Supervisor:
    """Restarts the daemon in place when it dies abnormally; exits when it exits cleanly.

    A daemon that exits 0 was unmounted (``kvfs umount``, ``fusermount3 -u``, SIGTERM): that
    is the operator's wish, so the supervisor leaves too. One killed by a signal or exiting
    with an error is started again with the same arguments; it clears its dead mount itself,
    just before mounting. SIGTERM stops the supervisor (``kvfs umount`` sends it), never the
    daemon; a restart in progress is finished first, so no mount appears after it has gone.
    """

    def __init__(self, mountpoint: Path, backing: Path, options: list[str]) -> None:
        self.command = daemon_command(mountpoint, backing, options)
        self.mountpoint = mountpoint
        self.stopping = False
        self.delay = RESTART_DELAY

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self, ready_fd: int) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        proc, message = _spawn(self.command)
        os.write(ready_fd, message.encode() + b"\n")
        os.close(ready_fd)
        if message != READY:
            return 1
        log.info("supervising %s: daemon pid %d", self.mountpoint, proc.pid)
        while True:
            started = time.monotonic()
            returncode = self._wait(proc)
            if returncode is None:
                log.info(
                    "supervisor of %s stopped; daemon pid %d goes on", self.mountpoint, proc.pid
                )
                return 0
            if returncode == 0:
                log.info("daemon pid %d exited cleanly: supervisor done", proc.pid)
                return 0
            if time.monotonic() - started >= STABLE_AFTER:
                self.delay = RESTART_DELAY
            log.warning(
                "daemon pid %d died (%s) after %.1fs; restarting in %.1fs",
                proc.pid,
                _status(returncode),
                time.monotonic() - started,
                self.delay,
            )
            restarted = self._restart()
            if restarted is None:
                return 0
            proc = restarted

    def _restart(self) -> subprocess.Popen[bytes] | None:
        """Start the daemon again, backing off after each failure; None if told to stop."""
        while True:
            if not self._sleep(self.delay):
                return None
            self.delay = min(self.delay * 2, RESTART_DELAY_MAX)
            proc, message = _spawn(self.command)
            if message == READY:
                log.info("restarted: daemon pid %d serves %s", proc.pid, self.mountpoint)
                return proc
            log.warning("restart failed: %s; next try in %.1fs", message, self.delay)

    def _wait(self, proc: subprocess.Popen[bytes]) -> int | None:
        while not self.stopping:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _sleep(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self.stopping


def _supervisor_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfs.mountctl")
    parser.add_argument("action", choices=["supervise"])
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--backing", type=Path, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    at = argv.index("--") if "--" in argv else len(argv)  # the daemon's options follow --
    args = parser.parse_args(argv[:at])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return Supervisor(args.mountpoint, args.backing, argv[at + 1 :]).run(args.ready_fd)


if __name__ == "__main__":
    sys.exit(_supervisor_main(sys.argv[1:]))
