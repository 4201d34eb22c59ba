"""The sweep lease of a shared backing directory: one evictor for the share at a time.

``.kvfs/sweep.lease`` holds ``kvfs-lease 1 <host> <expiry, wall clock ns> <nonce>``. It is
taken by writing a file of one's own and ``link()``ing it to that name (atomic everywhere, NFS
included: EEXIST means someone holds it), renewed every TTL/3 by renaming a fresh file over it
(only while the content is still one's own and one's own clock says it has not expired), and
broken when expired by ``rename()``ing it away: of several hosts that try, exactly one moves
the expired file; another that moved a fresh lease instead (it was retaken meanwhile) puts it
back with ``link()``.

Safety rests on clocks: a holder stops sweeping 2/3 TTL after the start of its last successful
renew (its own monotonic clock); the others break the lease only once its wall-clock expiry
(TTL after that start) has passed by their clocks. So two hosts never sweep at once while the
hosts' clocks differ by less than TTL/3 (minus the time a renew's I/O takes): NTP-synced hosts
and a TTL well above their skew. A holder killed with kill -9 is replaced within TTL + one poll
period (TTL/3).

Every function blocks on the filesystem: the daemon runs them in its I/O pool.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from kvfs import journal, layout

LEASE_FILE = layout.PRIVATE_DIR + b"/sweep.lease"
MAGIC = b"kvfs-lease"
VERSION = 1
MAX_BYTES = 256


@dataclass(frozen=True)
class Holder:
    host: str
    expiry_ns: int
    nonce: str


def encode(holder: Holder) -> bytes:
    return b"%s %d %s %d %s\n" % (
        MAGIC,
        VERSION,
        holder.host.encode(),
        holder.expiry_ns,
        holder.nonce.encode(),
    )


def decode(data: bytes | None) -> Holder | None:
    """The lease's content, or None for anything that is not a valid lease."""
    if data is None or len(data) > MAX_BYTES or not data.endswith(b"\n"):
        return None
    fields = data[:-1].split(b" ")
    if len(fields) != 5 or fields[0] != MAGIC or fields[1] != b"%d" % VERSION:
        return None
    try:
        host, nonce = fields[2].decode("ascii"), fields[4].decode("ascii")
        if not fields[3].isdigit() or not host or not nonce.isalnum():
            return None
        return Holder(host, int(fields[3]), nonce)
    except UnicodeDecodeError:
        return None


class Lease:
    """This host's side of the lease: ``step`` takes it, renews it, or sees who has it."""

    def __init__(self, root: bytes, host: str, private: bytes, ttl: float) -> None:
        self.root, self.host, self.ttl = root, host, ttl
        self.private = private  # this host's own directory for the files it links and moves
        self.nonce: str | None = None  # set while this host holds the lease
        self.valid_until = 0.0  # monotonic: sweep no later than this without a renew
        self.holder: str | None = None  # who held it at the last look
        self.taken = 0  # times this host took the lease
        self.broken = 0  # expired leases this host broke
        self.lost = 0  # times this host found its lease taken away

    @property
    def path(self) -> bytes:
        return os.path.join(self.root, LEASE_FILE)

    def holding(self) -> bool:
        return self.nonce is not None and time.monotonic() < self.valid_until

    def step(self) -> bool:
        """Renew the lease if held, else take it if free or expired; whether held now."""
        if self.nonce is not None:
            if self.holding() and self._renew():
                return True
            self.nonce = None
        return self._take(retry=True)

    def release(self) -> None:
        """Give the lease up (a clean shutdown): the next host need not wait for the TTL."""
        if self.nonce is not None:
            current = decode(self._read(self.path))
            if current is not None and current.nonce == self.nonce:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self.nonce = None

    def _mine(self, nonce: str) -> tuple[bytes, float]:
        """A new lease file of ours (in the private directory), and when its renew started."""
        started = time.monotonic()
        content = encode(Holder(self.host, time.time_ns() + int(self.ttl * 1e9), nonce))
        tmp = os.path.join(self.root, self.private, b"lease." + os.urandom(8).hex().encode())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        return tmp, started

    def _take(self, retry: bool) -> bool:
        nonce = os.urandom(8).hex()
        tmp, started = self._mine(nonce)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            pass
        else:
            self.nonce, self.holder = nonce, self.host
            self.valid_until = started + self.ttl * 2 / 3
            self.taken += 1
            return True
        finally:
            os.unlink(tmp)
        data = self._read(self.path)
        if data is None:  # released meanwhile: try again at once
            return self._take(False) if retry else False
        current = decode(data)
        self.holder = current.host if current is not None else None
        if current is not None and time.time_ns() <= current.expiry_ns:
            if current.host != self.host:
                return False
            # Our own lease from before a restart (the host lock says no other daemon is this
            # host now): break it at once.
        elif current is None and not self._old(data):
            return False  # unreadable (hostile?): wait until it is old enough to break
        if not self._break(data):
            return False
        return self._take(False) if retry else False

    def _old(self, data: bytes) -> bool:
        """An unreadable lease: breakable once its mtime is older than the TTL."""
        try:
            return time.time() - os.stat(self.path).st_mtime > self.ttl
        except FileNotFoundError:
            return True

    def _break(self, expired: bytes) -> bool:
        """Move an expired lease away; True if this host moved it (exactly one does)."""
        stale = os.path.join(self.root, self.private, b"stale." + os.urandom(8).hex().encode())
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return False  # another host broke it first
        moved = self._read(stale)
        if moved != expired:  # another host broke it and took it meanwhile: put theirs back
            with contextlib.suppress(FileExistsError):
                os.link(stale, self.path)
            os.unlink(stale)
            return False
        os.unlink(stale)
        self.broken += 1
        return True

    def _renew(self) -> bool:
        current = decode(self._read(self.path))
        if current is None or current.nonce != self.nonce:
            self.lost += 1
            self.holder = current.host if current is not None else None
            return False
        tmp, started = self._mine(self.nonce)
        try:
            os.rename(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        self.valid_until = started + self.ttl * 2 / 3
        return True

    @staticmethod
    def _read(path: bytes) -> bytes | None:
        """The lease's bytes; a symlink, fifo or device under its name reads as garbage
        (b""), never followed, never waited on."""
        fd = journal.open_regular(path)
        if fd is None:
            return None if not os.path.lexists(path) else b""
        try:
            return os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
