"""The kernel session's requests over FUSE-over-io_uring, where the kernel offers it (Linux
6.14+ with the module parameter ``fuse.enable_uring=Y``; root may set it at run time).

Why: on /dev/fuse a request wakes the daemon's thread on whatever CPU it sleeps on, and the
answer wakes the caller back on its own: on a VM two hand-overs between CPUs cost more than all
the rest of a first-time miss (docs/benchmarks.md, session 21: 18.8-21.4 us a miss, 8.0-8.6
with caller and daemon on one CPU). Over io_uring the kernel queues each request on its
caller's CPU, where a thread of this session (``_ring.c``, one per CPU, pinned) takes it:

* a first-time miss is answered there, in C, from the index's dicts (``FastMisses``) while the
  trio loop waits (it holds the ring's index lock whenever it runs Python, so a miss never sees
  the index half way through a change; ``LoopIdle`` lets go of it around trio's I/O wait, and
  ``take`` around its spin). The caller's CPU never hands over: no interpreter, no wake-up
  elsewhere;
* every other request is handed to the loop (``RingReceiver``: the same contract as
  ``Receiver``, the request laid out as /dev/fuse delivers it), and its answer goes back
  through ``Ring.reply`` to the CPU's thread, which commits it and fetches the next.

Forgets and interrupts never come over the ring; the session keeps reading /dev/fuse for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from kvfs.mount import fuse_abi as abi
from kvfs.mount.fuse_abi import Opcode
from kvfs.mount.receiver import Receiver

if TYPE_CHECKING:
    from kvfs.mount._ring import Ring

log = logging.getLogger(__name__)

_Ring: type[Ring] | None
try:
    from kvfs.mount._ring import Ring as _Ring
except ImportError:  # pragma: no cover (without C the session stays on /dev/fuse)
    _Ring = None

# Ring entries per CPU: requests a CPU's callers may have with the daemon at once (more wait in
# the kernel's queue). Each holds a payload buffer of max_write (1 MiB, touched as used).
ENTRIES_PER_CPU = 16

# The size of each request's own header, which the ring delivers apart from the rest (its
# payload): what /dev/fuse puts right after the fuse_in_header. 0 for those without one.
_OWN_HEADER: dict[int, int] = {
    Opcode.GETATTR: abi.GETATTR_IN.size,
    Opcode.SETATTR: abi.SETATTR_IN.size,
    Opcode.MKNOD: abi.MKNOD_IN.size,
    Opcode.MKDIR: abi.MKDIR_IN.size,
    Opcode.RENAME: abi.RENAME_IN.size,
    Opcode.RENAME2: abi.RENAME2_IN.size,
    Opcode.LINK: abi.LINK_IN.size,
    Opcode.OPEN: abi.OPEN_IN.size,
    Opcode.OPENDIR: abi.OPEN_IN.size,
    Opcode.CREATE: abi.CREATE_IN.size,
    Opcode.READ: abi.READ_IN.size,
    Opcode.READDIR: abi.READ_IN.size,
    Opcode.READDIRPLUS: abi.READ_IN.size,
    Opcode.WRITE: abi.WRITE_IN.size,
    Opcode.RELEASE: abi.RELEASE_IN.size,
    Opcode.RELEASEDIR: abi.RELEASE_IN.size,
    Opcode.FLUSH: abi.FLUSH_IN.size,
    Opcode.FSYNC: abi.FSYNC_IN.size,
    Opcode.FSYNCDIR: abi.FSYNC_IN.size,
    Opcode.SETXATTR: abi.SETXATTR_IN.size,
    Opcode.GETXATTR: abi.GETXATTR_IN.size,
    Opcode.LISTXATTR: abi.GETXATTR_IN.size,
    Opcode.ACCESS: abi.ACCESS_IN.size,
}
OWN_HEADER_SIZES = bytes(_OWN_HEADER.get(op, 0) for op in range(64))


# Whether the kernel offers FUSE-over-io_uring to a mount's INIT (off by default; root may set it).
ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")


@contextlib.contextmanager
def io_uring_offered() -> Iterator[None]:
    """The kernel offers io_uring to the mounts made meanwhile (it asks at their INIT), then
    its parameter is put back as it was. For tests and benchmarks; an operator sets it once."""
    was = ENABLE_URING.read_text().strip()
    ENABLE_URING.write_text("Y")
    try:
        yield
    finally:
        ENABLE_URING.write_text(was)


def possible_cpus() -> int:
    """The kernel keeps a queue for every possible CPU and uses the ring once each has an
    entry (fs/fuse/dev_uring.c)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            return int(f.read().strip().split(",")[-1].split("-")[-1]) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def open_ring(dev_fd: int, payload_size: int) -> Ring | None:
    """A ``Ring`` on the connection of ``dev_fd`` (INIT agreed io_uring), its threads started;
    None (logged) where it cannot be built: requests then stay on /dev/fuse."""
    if _Ring is None:
        log.warning("io_uring agreed, but kvfs was built without mount/_ring.c: /dev/fuse")
        return None
    try:
        return _Ring(dev_fd, possible_cpus(), ENTRIES_PER_CPU, payload_size, OWN_HEADER_SIZES)
    except OSError as err:
        log.warning("could not set up the io_uring queues (%s): requests stay on /dev/fuse", err)
        return None


class RingReceiver(Receiver):
    """``Receiver`` over a ``Ring``: the next request handed over from a CPU's queue, laid out
    as /dev/fuse delivers it (-ENODEV once the queues are gone)."""

    def __init__(self, ring: Ring, size: int) -> None:
        super().__init__(ring.fileno(), size)
        self.ring = ring

    def _read(self, spin_ns: int) -> int:
        return int(self.ring.take(self.buf, spin_ns))

    async def _sleep(self) -> None:
        await trio.lowlevel.wait_readable(self.fd)
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)  # (level-triggered: read it, or it wakes trio forever)


class LoopIdle(trio.abc.Instrument):
    """Lets the ring's threads answer misses while trio waits for I/O, and only then."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.waiting = False

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.ring.idle()
            self.waiting = True

    def after_io_wait(self, timeout: float) -> None:
        if self.waiting:
            self.waiting = False
            self.ring.busy()
