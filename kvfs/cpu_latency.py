"""A CPU latency request: idle CPUs kept in states they wake from within a bound.

Every FUSE request puts its caller to sleep until the daemon answers, and the answer wakes it,
mostly on a CPU that went idle meanwhile. How long an idle CPU takes to wake is the idle
state's exit latency: tens of microseconds from a deep C-state on a server, or from a halted
virtual CPU (the host must schedule it again), against a few microseconds for the whole
round trip otherwise. Linux's CPU latency QoS (/dev/cpu_dma_latency) bounds it for the whole
machine while a request is held: the kernel keeps idle CPUs out of states that wake slower
(0: they poll), and drops the request when its file is closed, a killed process's included.
The cost is power: polling CPUs stay busy for the host or the package.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager

DEVICE = "/dev/cpu_dma_latency"
# The kernel's "no request" value (PM_QOS_CPU_LATENCY_DEFAULT_VALUE), also its largest.
NONE_US = 2_000_000_000


def hold(microseconds: int) -> int:
    """Ask for ``microseconds`` at most; the request lasts while the returned fd is open.
    Raises OSError (EACCES: it takes root; ENOENT: a kernel without the interface; ENODEV:
    something else under its name)."""
    if not 0 <= microseconds <= NONE_US:
        raise ValueError(f"{microseconds} us is not a CPU latency (0 to {NONE_US})")
    fd = os.open(DEVICE, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            raise OSError(errno.ENODEV, "not the kernel's CPU latency device")
        os.write(fd, struct.pack("=i", microseconds))
    except OSError:
        os.close(fd)
        raise
    return fd


def current() -> int:
    """The machine's bound now, in microseconds: the least of all requests held
    (NONE_US without any)."""
    fd = os.open(DEVICE, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return int(struct.unpack("=i", os.read(fd, 4))[0])
    finally:
        os.close(fd)


@contextmanager
def held(microseconds: int | None) -> Iterator[None]:
    """``hold`` for the duration of a block (None: nothing asked)."""
    if microseconds is None:
        yield
        return
    fd = hold(microseconds)
    try:
        yield
    finally:
        os.close(fd)
