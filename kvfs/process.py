"""What the daemon can learn of a client process from /proc (Linux).

A file is published when its writer closes it; but the kernel also closes every file of a
process that is killed, and a FUSE daemon sees both as the same FLUSH. The difference is in
/proc: a process being torn down by a signal has PF_EXITING set and its exit code holds that
signal, from before it closes its files until its parent reaps it, in the thread that closes
them too. So a writer killed mid-file can be told from one that closed (or exited normally)
and its partial file is never published.
"""

from __future__ import annotations

import os

PF_EXITING = 0x4  # include/linux/sched.h


def _read(path: str) -> bytes:
    """A /proc file in one read (no buffered file object: these are read per request)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def thread_group(tid: int) -> int:
    """The process (thread group leader) of a thread; the FUSE request names the thread."""
    try:
        status = _read(f"/proc/{tid}/status")
        start = status.index(b"\nTgid:") + 6
        return int(status[start : status.index(b"\n", start)])
    except (OSError, ValueError):
        return tid


def groups(tid: int) -> frozenset[int]:
    """The supplementary groups of a thread (what the kernel checks permissions with); none
    if /proc does not tell (it is gone)."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def killed_by_signal(pid: int) -> bool:
    """Whether process or thread ``pid`` is exiting, or has exited, because a signal killed it
    (every thread of a killed process exits with that signal).

    False when it is alive and well, exited normally, is gone, or /proc does not tell (the
    exit code is only shown to a reader allowed to ptrace the process, such as root).
    """
    try:
        # The thread's own stat (for a process, its leader's): the state, flags and exit code,
        # without the process's CPU times summed over every thread (a FLUSH asks this of an
        # engine with hundreds of threads: 5.4 -> 2.6 us with 200 here).
        stat = _read(f"/proc/{pid}/task/{pid}/stat")
    except OSError:
        return False
    # Fields after the command name, which is in parentheses and may hold anything.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        state, flags, exit_code = fields[0], int(fields[6]), int(fields[49])
    except (IndexError, ValueError):
        return False
    exiting = bool(flags & PF_EXITING) or state in (b"Z", b"X")
    return exiting and exit_code & 0x7F != 0
