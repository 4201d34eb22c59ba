"""The kernel session's next request from /dev/fuse: read at once where one is there, after a
short spin where the session is idle, else after a sleep in trio's epoll.

With nothing to read and no request task under way, the receiver reads again for SPIN_SECONDS
before it sleeps: a client's next request often follows its answer within tens of
microseconds (the next lookup), and on a VM being woken costs more CPU and time than asking
again (a first-time miss: 87 -> 31-43 us end to end, 64 -> 34-42 us of daemon CPU). While a
task is under way it sleeps at once (the task's I/O completions need the loop), and a spin
that found nothing stops it until a request comes within SPIN_AGAIN (a wake-up included).
Reading again after every request wasted 4.5 spins of 50 us per 2 MiB store (200 stores
counted); with these two rules a store spins not at all, a lookup chain always.

The spin runs in C where the package was built with it (``_dev_read.c``: no exception per
empty read, the GIL let go once; a first-time miss 28-29 -> 26 us); the same loop in Python
otherwise (``_read_calls``: the reference).
"""

from __future__ import annotations

import errno
import os
import time

import trio

SPIN_SECONDS = 50e-6
SPIN_AGAIN = 4 * SPIN_SECONDS
_SPIN_NS = int(SPIN_SECONDS * 1e9)


def _read_calls(fd: int, buf: bytearray, spin_ns: int) -> int:
    """One request read into ``buf``: its size, or -errno (-EAGAIN: none came within
    ``spin_ns``); one the kernel withdrew before it was read (ENOENT) is read past."""
    until = time.perf_counter_ns() + spin_ns
    while True:
        try:
            return os.readv(fd, [buf])
        except BlockingIOError:
            if time.perf_counter_ns() >= until:
                return -errno.EAGAIN
        except OSError as err:
            if err.errno != errno.ENOENT:
                return -(err.errno or errno.EIO)


try:
    from kvfs.mount._dev_read import read_request as _read
except ImportError:  # pragma: no cover
    _read = _read_calls


class Receiver:
    """Requests from one /dev/fuse fd (opened O_NONBLOCK) into one buffer, ``view`` on it.
    ``spins``: False where another receiver does the spinning (mount/ring.py)."""

    def __init__(self, fd: int, size: int, spins: bool = True) -> None:
        self.fd = fd
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.spins = spins
        self.spin = spins  # whether to read again before sleeping

    def now(self, idle: bool) -> int:
        """The next request's size, read without leaving the loop (spinning first where
        ``idle``: no request task under way); -errno where none came (-EAGAIN) or the read
        failed: hand that to ``wait``."""
        return self._read(_SPIN_NS if idle and self.spin else 0)

    async def wait(self, failed: int, idle: bool) -> int | None:
        """The next request's size after ``now`` returned ``failed``; None once the mount is
        gone (unmounted or aborted)."""
        spun = idle and self.spin
        if spun and failed == -errno.EAGAIN:
            self.spin = False
        start = time.perf_counter()
        size = failed
        while size < 0:
            if size == -errno.EAGAIN:
                await self._sleep()
            elif -size in (errno.ENODEV, errno.ECONNABORTED):
                return None
            else:
                raise OSError(-size, os.strerror(-size))
            size = self._read(0)
        if idle and self.spins:  # a wake-up soon after the spin gave up: spin again next time
            waited = time.perf_counter() - start + (SPIN_SECONDS if spun else 0)
            self.spin = waited < SPIN_AGAIN
        return size

    def _read(self, spin_ns: int) -> int:
        return _read(self.fd, self.buf, spin_ns)

    async def _sleep(self) -> None:
        await trio.lowlevel.wait_readable(self.fd)
