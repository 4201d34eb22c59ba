"""A FUSE session that speaks the kernel protocol on /dev/fuse itself, driven by trio.

Why: the mount's bytes should move kernel to backing file without the daemon (FUSE passthrough,
kernel >= 6.9). libfuse 3.14 and pyfuse3 3.5, which the pyfuse3 session runs on, cannot ask for
it (research/fuse.md §4.1). This session can: it answers INIT with ``FUSE_PASSTHROUGH`` and, when
an ``open``/``create`` handler hands it a backing file, registers that file with the kernel and
answers the open with ``FOPEN_PASSTHROUGH``; reads, writes and mmap of that handle then never
reach the daemon.

It is a drop-in for the pyfuse3 module's session functions: the same ``pyfuse3.Operations``
object runs over either, with pyfuse3's handler signatures, data classes and errno conventions.
A daemon holds one ``FuseSession`` (the ``pyfuse3`` module itself, or a ``KernelSession``) and
calls ``init``, ``main``, ``terminate``, ``close``, ``readdir_reply``, ``invalidate_entry`` and
``invalidate_inode`` on it instead of on ``pyfuse3``::

    session: FuseSession = KernelSession() if passthrough else pyfuse3
    session.init(ops, mountpoint, options)
    trio.run(session.main)  # the operations call session.readdir_reply in readdir
    session.close(unmount=True)

What an operations class sees differently from the pyfuse3 session:

* ``ctx`` is a ``RequestContext`` and ``fields`` a ``SetattrFields`` of this module (pyfuse3's
  own cannot be built from Python); they have the same attribute names.
* ``readdir`` gets a ``ReaddirToken`` of this module: answer it with ``session.readdir_reply``
  (``pyfuse3.readdir_reply`` rejects it).
* A handler that raises anything but ``FUSEError`` fails its request only: an ``OSError`` keeps
  its errno, anything else is logged and answered EIO. The session never stops for it.
* ``init()`` mounts *and* answers the kernel's INIT before it returns, so ``passthrough`` is
  known before ``main()`` runs. ``Operations.init()`` is called there, as pyfuse3 does.
* Requests run concurrently, each in its own trio task (at most ``max_tasks`` at a time), as
  with pyfuse3; INTERRUPT is ignored, as pyfuse3 does; POLL, locks, ioctl, fallocate, lseek,
  copy_file_range, tmpfile and statx are answered ENOSYS, so the kernel does them itself or
  stops asking.
* ``setxattr`` on the root with the name ``fuse_stacktrace`` is an ordinary setxattr.
* It mounts with mount(2) itself, not through fusermount3: it needs CAP_SYS_ADMIN, and has no
  ``auto_unmount``. Unprivileged mounts stay with pyfuse3.

Passthrough, for the operations: return a ``PassthroughFileInfo`` (a ``pyfuse3.FileInfo``, so
the pyfuse3 session accepts it too and ignores the backing file) from ``open`` or ``create``.
The operations must still be able to serve ``read`` and ``write`` for every handle: the session
falls back to them whenever the kernel did not grant passthrough, refuses the backing file
(EPERM without CAP_SYS_ADMIN; ELOOP for a backing file on overlayfs or on a FUSE mount that
passes through itself), or the handle carries no backing file. The kernel's rules that the
operations must keep:

* no writeback cache (``enable_writeback_cache``): the session does not ask for passthrough then;
* the backing file's access mode must allow what the opener asked for (the kernel reads and
  writes through the backing file);
* while an inode is open in passthrough, every other open of it must be passthrough too, on the
  same backing file: the session reuses the inode's registered backing file when a later open
  names the same file (same st_dev and st_ino), and the kernel fails with EIO any open that
  names another file or none (for instance a served open for writing while readers pass through).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import logging
import os
import re
import select
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pyfuse3
import trio

from kvfs.mount import fuse_abi as abi
from kvfs.mount.bridge import NeedsIO
from kvfs.mount.fuse_abi import InitFlag, NotifyCode, Opcode, OpenFlag, SetattrValid
from kvfs.mount.receiver import Receiver
from kvfs.mount.ring import LoopIdle, RingReceiver, open_ring

if TYPE_CHECKING:
    from kvfs.mount._ring import Ring

_answer_miss: Callable[..., int] | None
try:
    from kvfs.mount._dev_read import answer_miss as _answer_miss
except ImportError:  # pragma: no cover (without C, misses are Python's like any lookup)
    _answer_miss = None

log = logging.getLogger(__name__)

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Backing files kept registered after their last handle, for reopens without I/O. Each holds
# one open file in the kernel (well under a KiB, outside the daemon's fd limit): 16Ki cover a
# working set of 32 GiB in 2 MiB chunks, where 1Ki left most reopens of a 24-conversation sweep
# to open the backing file again (a trip to the I/O pool and a wait on the namespace lock).
IDLE_BACKINGS = 16384

# 1 MiB WRITE requests (256 pages, the kernel's fs.fuse.max_pages_limit default).
MAX_WRITE = 1 << 20

Buffer = bytes | bytearray | memoryview

# <sys/mount.h>: the stdlib has no names for these.
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_SYNCHRONOUS = 16
_MS_DIRSYNC = 128
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_MNT_DETACH = 2

# Requests the kernel expects no answer to.
_NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET, Opcode.INTERRUPT, Opcode.NOTIFY_REPLY})
# With allow_root, requests on what an already checked open made (and background requests,
# whose uid is not the caller's) are served for anyone; libfuse draws the same line.
_ON_OPEN_HANDLES = _NO_REPLY | {
    Opcode.READ,
    Opcode.WRITE,
    Opcode.FLUSH,
    Opcode.FSYNC,
    Opcode.RELEASE,
    Opcode.READDIR,
    Opcode.READDIRPLUS,
    Opcode.RELEASEDIR,
    Opcode.FSYNCDIR,
    Opcode.DESTROY,
}


# -- what the operations receive --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Who made a request: what ``pyfuse3.RequestContext`` carries.

    ``umask`` is the caller's umask on create, mkdir and mknod (the kernel has already applied
    it to ``mode``), 0 on every other request.
    """

    uid: int
    gid: int
    pid: int
    umask: int = 0


@dataclass(slots=True)
class SetattrFields:
    """Which attributes a ``setattr`` changes: what ``pyfuse3.SetattrFields`` carries."""

    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False


class PassthroughFileInfo(pyfuse3.FileInfo):
    """A ``FileInfo`` that asks for passthrough on a backing file.

    ``backing_fd``: an open fd of the backing file (a regular file on a filesystem that is not
    itself stacked: ext4, xfs, not overlayfs or FUSE). The session registers it with the kernel
    at the open's reply and drops the registration at the handle's last RELEASE; it neither
    closes nor keeps the fd: the kernel holds its own reference to the file, so the operations
    may close the fd as soon as ``open`` has returned, or keep it to serve reads when the
    session declines passthrough.

    ``backing_id``: instead, an id the operations registered themselves with
    ``KernelSession.open_backing``; they own it and close it with ``close_backing``.

    ``reuse``: instead, the backing file the session still holds for this inode from an
    earlier open (``KernelSession.holds_backing``): the operations open nothing.

    It is a ``pyfuse3.FileInfo``, so the pyfuse3 session takes it too (and serves the handle).
    """

    __slots__ = ("backing_fd", "backing_id", "reuse")

    def __new__(cls, *args: Any, **kwargs: Any) -> PassthroughFileInfo:
        # pyfuse3's FileInfo is a Cython class whose constructor takes only its own fields:
        # build it bare, and set them all in __init__.
        return super().__new__(cls)

    def __init__(
        self,
        fh: int = 0,
        direct_io: bool = False,
        keep_cache: bool = True,
        nonseekable: bool = False,
        backing_fd: int | None = None,
        backing_id: int | None = None,
        reuse: bool = False,
    ) -> None:
        self.fh, self.direct_io, self.keep_cache = fh, direct_io, keep_cache
        self.nonseekable = nonseekable
        self.backing_fd = backing_fd
        self.backing_id = backing_id
        self.reuse = reuse


class ReaddirToken:
    """One READDIR(PLUS) reply being filled by ``readdir_reply``: at most ``size`` bytes."""

    __slots__ = ("buf", "entries", "plus", "size")

    def __init__(self, size: int, plus: bool) -> None:
        self.buf = bytearray()
        self.size = size
        self.plus = plus  # READDIRPLUS: each entry carries its attributes, and is a lookup
        self.entries: list[int] = []  # inodes whose lookup count the reply raises


def readdir_reply(
    token: ReaddirToken, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int
) -> bool:
    """Add one directory entry to a ``readdir`` reply; False when it no longer fits.

    As with pyfuse3: call it from ``Operations.readdir`` until it returns False; ``next_id`` is
    the ``start_id`` a later ``readdir`` gets to continue after this entry. Every accepted entry
    with a nonzero ``st_ino`` is a lookup (the kernel answers READDIRPLUS with it), except ``.``
    and ``..``, which the kernel does not count.
    """
    record = abi.DIRENT.pack(attr.st_ino, next_id, len(name), stat.S_IFMT(attr.st_mode) >> 12)
    if token.plus:
        record = _entry_out(attr) + record
    size = abi.align8(len(record) + len(name))
    if len(token.buf) + size > token.size:
        return False
    token.buf += record
    token.buf += name
    token.buf += bytes(size - len(record) - len(name))
    if token.plus and attr.st_ino and name not in (b".", b".."):
        token.entries.append(attr.st_ino)
    return True


class FastMisses(Protocol):
    """What an operations object offers for the first-time misses this session answers in C
    (``_dev_read.answer_miss``; kvfs's: ``mount/lookups.py``)."""

    dirs: dict[int, dict[bytes, Any]]  # directory inode -> its children, by name
    noted: list[tuple[int, bytes]]  # (directory, name) appended for each miss answered
    timeout: float  # the negative entry's

    def answered(self, seconds: float) -> None: ...


class FuseSession(Protocol):
    """What the daemon uses of a FUSE session: the ``pyfuse3`` module and ``KernelSession``."""

    def init(self, ops: Any, mountpoint: str, options: Any = ...) -> None: ...

    async def main(self, min_tasks: int = ..., max_tasks: int = ...) -> None: ...

    def terminate(self) -> None: ...

    def close(self, unmount: bool = ...) -> None: ...

    def readdir_reply(self, token: Any, name: bytes, attr: Any, next_id: int) -> bool: ...

    def invalidate_entry(self, inode_p: int, name: bytes, deleted: int = ...) -> None: ...

    def invalidate_inode(self, inode: int, attr_only: bool = ...) -> None: ...


# -- mount options ----------------------------------------------------------------------------

# option: (MS_* flag, whether the option sets it)
_FLAG_OPTIONS: dict[str, tuple[int, bool]] = {
    "ro": (_MS_RDONLY, True),
    "rw": (_MS_RDONLY, False),
    "nosuid": (_MS_NOSUID, True),
    "suid": (_MS_NOSUID, False),
    "nodev": (_MS_NODEV, True),
    "dev": (_MS_NODEV, False),
    "noexec": (_MS_NOEXEC, True),
    "exec": (_MS_NOEXEC, False),
    "sync": (_MS_SYNCHRONOUS, True),
    "async": (_MS_SYNCHRONOUS, False),
    "dirsync": (_MS_DIRSYNC, True),
    "noatime": (_MS_NOATIME, True),
    "atime": (_MS_NOATIME, False),
    "nodiratime": (_MS_NODIRATIME, True),
    "diratime": (_MS_NODIRATIME, False),
    "relatime": (_MS_RELATIME, True),
    "norelatime": (_MS_RELATIME, False),
    "strictatime": (_MS_STRICTATIME, True),
}


@dataclass
class MountOptions:
    """The options ``init`` takes, as pyfuse3 takes them (libfuse's names), split into what
    mount(2) gets: the source (``fsname``), the type (``fuse.<subtype>``), MS_* flags and the
    FUSE data string. Like libfuse, nosuid and nodev unless ``suid``/``dev`` say otherwise."""

    fsname: str = "kvfs"
    subtype: str = "kvfs"
    flags: int = _MS_NOSUID | _MS_NODEV
    default_permissions: bool = False
    allow_other: bool = False
    allow_root: bool = False
    max_read: int | None = None

    @classmethod
    def parse(cls, options: Iterable[str]) -> MountOptions:
        """Raises RuntimeError (as pyfuse3.init does) on an option it does not know."""
        out = cls()
        for option in options:
            key, has_value, value = option.partition("=")
            if option in _FLAG_OPTIONS:
                flag, on = _FLAG_OPTIONS[option]
                out.flags = out.flags | flag if on else out.flags & ~flag
            elif option in ("default_permissions", "allow_other", "allow_root"):
                setattr(out, option, True)
            elif has_value and key in ("fsname", "subtype") and value and "," not in value:
                setattr(out, key, value)
            elif has_value and key == "max_read" and value.isdigit():
                out.max_read = int(value)
            elif option == "auto_unmount":
                # libfuse implements it with a fusermount3 watchdog process, not the kernel.
                raise RuntimeError("auto_unmount needs fusermount3: not available here")
            else:
                raise RuntimeError(f"unknown FUSE mount option {option!r}")
        if out.allow_other and out.allow_root:
            raise RuntimeError("allow_other and allow_root exclude each other")
        return out

    def data(self, fd: int, rootmode: int) -> str:
        """The FUSE-specific part of mount(2)'s data."""
        parts = [f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={os.getuid()}"]
        parts.append(f"group_id={os.getgid()}")
        if self.default_permissions:
            parts.append("default_permissions")
        if self.allow_other or self.allow_root:  # allow_root: the session turns others away
            parts.append("allow_other")
        if self.max_read is not None:
            parts.append(f"max_read={self.max_read}")
        return ",".join(parts)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    args = (os.fsencode(source), os.fsencode(target), fstype.encode(), flags, data.encode())
    if _libc.mount(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _umount_lazy(target: str) -> None:
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


_ESCAPE = re.compile(rb"\\([0-7]{3})")


def _mount_devices(path: str) -> list[tuple[int, int]]:
    """major:minor of each mount on ``path``, the top one last, from /proc/self/mountinfo
    (never stat the mount: stat'ing it while nobody serves it would hang)."""
    found = []
    target = os.fsencode(path)
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            if _ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4]) == target:
                major, minor = fields[2].split(b":")
                found.append((int(major), int(minor)))
    return found


# -- wire encoding ----------------------------------------------------------------------------

_NS = 1_000_000_000
# The receive loop lets other tasks run at least every this many requests answered inline
# (and at each wait for the next one, and after each task it starts): a pass through trio's
# scheduler per request was a sixth of an inline lookup's cost.
YIELD_EVERY = 8
# Seconds between timings of the misses the io_uring queues' threads answered.
RING_MISSES_TIMED_EVERY = 0.1
# A reply this small is sent as one joined buffer (an entry, an attribute, a small read).
_JOINED = 4096
_MAX_TIMEOUT = 1 << 40  # seconds; the kernel turns a timeout into jiffies, saturating


def _timeout(seconds: float) -> tuple[int, int]:
    if not seconds > 0:  # also NaN
        return 0, 0
    seconds = min(seconds, _MAX_TIMEOUT)
    whole = int(seconds)
    return whole, min(int((seconds - whole) * _NS), _NS - 1)


def _encode_dev(dev: int) -> int:
    """A glibc dev_t as fuse_attr.rdev carries it: the kernel's 32-bit new_encode_dev form."""
    major, minor = os.major(dev), os.minor(dev)
    return ((minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)) & 0xFFFFFFFF


def _decode_dev(rdev: int) -> int:
    """fuse_mknod_in.rdev (new_encode_dev form) as a glibc dev_t."""
    return os.makedev((rdev & 0xFFF00) >> 8, (rdev & 0xFF) | ((rdev >> 12) & 0xFFF00))


def _attr(attr: pyfuse3.EntryAttributes) -> tuple[int, ...]:
    atime, atime_ns = divmod(attr.st_atime_ns, _NS)
    mtime, mtime_ns = divmod(attr.st_mtime_ns, _NS)
    ctime, ctime_ns = divmod(attr.st_ctime_ns, _NS)
    return (
        attr.st_ino,
        attr.st_size,
        attr.st_blocks,
        atime,
        mtime,
        ctime,
        atime_ns,
        mtime_ns,
        ctime_ns,
        attr.st_mode,
        attr.st_nlink,
        attr.st_uid,
        attr.st_gid,
        _encode_dev(attr.st_rdev),
        attr.st_blksize,
        0,  # flags: no submounts, no DAX
    )


def _entry_out(attr: pyfuse3.EntryAttributes) -> bytes:
    """fuse_entry_out. ``st_ino`` 0 is a negative entry: the kernel caches the miss for
    ``entry_timeout``, which raising ENOENT would not (as libfuse answers it)."""
    if not attr.st_ino:
        return _negative_entry(attr.entry_timeout)
    entry_valid, entry_ns = _timeout(attr.entry_timeout)
    attr_valid, attr_ns = _timeout(attr.attr_timeout)
    fields = _attr(attr)
    return abi.ENTRY_OUT.pack(
        attr.st_ino, attr.generation, entry_valid, attr_valid, entry_ns, attr_ns, *fields
    )


@functools.lru_cache(maxsize=8)
def _negative_entry(timeout: float) -> bytes:
    """A miss's reply, the same bytes every time (misses are most of a cold cache's lookups)."""
    valid, valid_ns = _timeout(timeout)
    return abi.ENTRY_OUT.pack(0, 0, valid, 0, valid_ns, 0, *[0] * 16)


def _attr_out(attr: pyfuse3.EntryAttributes) -> bytes:
    attr_valid, attr_ns = _timeout(attr.attr_timeout)
    return abi.ATTR_OUT.pack(attr_valid, attr_ns, 0, *_attr(attr))


def _name(body: bytes, start: int = 0) -> bytes:
    """The NUL-terminated name at ``start``."""
    end = body.find(b"\0", start)
    return body[start:end] if end >= 0 else body[start:]


def _two_names(body: bytes, start: int) -> tuple[bytes, bytes]:
    first, _, rest = body[start:].partition(b"\0")
    return first, rest.partition(b"\0")[0]


def _as_bytes(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.itemsize == 1 and view.ndim == 1 else view.cast("B")


def _nothing() -> None:
    pass


def _not_sent(opcode: int, err: int) -> None:
    """A reply the kernel refused: logged unless its request or the connection is gone."""
    if err == errno.ENOENT:  # interrupted, or the connection was aborted
        log.debug("%s: the request is gone", _opname(opcode))
    elif err not in (errno.ENODEV, errno.ECONNABORTED, errno.ENOTCONN):
        log.error("the kernel refused the reply to %s: %s", _opname(opcode), os.strerror(err))


def _opname(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode}"


class _Request:
    __slots__ = ("body", "data", "gid", "nodeid", "opcode", "pid", "uid", "unique")

    def __init__(self, header: tuple[int, ...], body: bytes, data: bytes = b"") -> None:
        _, self.opcode, self.unique, self.nodeid, self.uid, self.gid, self.pid, _, _ = header
        self.body = body  # the opcode's in struct and names
        self.data = data  # WRITE's bytes


@dataclass
class _Backing:
    """A backing file registered with the kernel, and the open handles that use it."""

    backing_id: int
    file: tuple[int, int]  # st_dev, st_ino
    refs: int = 0
    stale: bool = False  # its inode's bytes changed: no new open may use it


@dataclass
class _Stats:
    passthrough_opens: int = 0
    served_opens: int = 0
    backing_refused: int = 0
    backing_reused: int = 0  # passthrough opens on a backing file kept from an earlier open
    ring_misses: int = 0  # first-time misses answered on the io_uring queues' threads
    errors: dict[int, int] = field(default_factory=dict)


# -- the session ------------------------------------------------------------------------------


class KernelSession:
    """One FUSE mount served over /dev/fuse; see the module docstring.

    Threads: ``init``, ``main`` and ``close`` belong to the daemon's main thread (``main`` in its
    trio run, ``close`` after ``main`` has returned). ``terminate`` may be called from any
    thread; ``invalidate_entry`` and ``invalidate_inode`` too, and should be called from a
    thread other than the trio one, since the kernel may make them wait for requests that this
    session has yet to answer. ``open_backing`` and ``close_backing`` from any thread while the
    session is open.
    """

    def __init__(
        self,
        *,
        passthrough: bool = True,
        io_uring: bool = True,
        max_write: int = MAX_WRITE,
        max_background: int = 64,
        congestion_threshold: int = 48,
        init_timeout: float = 10.0,
        drain_timeout: float = 30.0,
    ) -> None:
        """``passthrough``: ask the kernel for it. ``io_uring``: take requests over
        FUSE-over-io_uring where the kernel offers it (mount/ring.py). ``max_background``
        bounds the kernel's asynchronous requests in flight (readahead, RELEASE): 64 rather than
        the kernel's default 12 lets readahead of several readers overlap; past
        ``congestion_threshold`` of them the kernel slows readahead down. ``drain_timeout``: how
        long ``main()``, once it stops reading, waits for the requests in hand before it cancels
        their handlers."""
        self.want_passthrough = passthrough
        self.want_io_uring = io_uring
        self.max_write = max_write
        self.max_background = max_background
        self.congestion_threshold = congestion_threshold
        self.init_timeout = init_timeout
        self.drain_timeout = drain_timeout
        self.passthrough = False  # the kernel granted it (known once init() has returned)
        self.proto_minor = 0  # the protocol minor both sides speak
        self.kernel_flags = InitFlag(0)  # what the kernel offered
        self.flags = InitFlag(0)  # what was agreed
        self.max_readahead = 0
        self.mountpoint: str | None = None
        self.options = MountOptions()
        self.stats = _Stats()
        self._ring: Ring | None = None  # the io_uring queues (mount/ring.py), once INIT agreed them
        self._ops: Any = None
        self._fd: int | None = None
        self._dev: tuple[int, int] | None = None
        self._bufsize = max(abi.MIN_READ_BUFFER, max_write + PAGE_SIZE)
        # Guards the fd's lifetime against notifying threads, and terminate() against main().
        self._lock = threading.Lock()
        self._notifying = 0
        self._orphan_fd: int | None = None  # closed by the last notification out
        self._stopping = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_thread: int | None = None
        self._reader: trio.CancelScope | None = None
        self._tasks: trio.Nursery | None = None  # where main() serves requests in tasks
        # The backing files registered for each inode's open handles, by file; the handles.
        self._inode_backing: dict[int, dict[tuple[int, int], _Backing]] = {}
        self._handle_backing: dict[tuple[int, int], list[_Backing]] = {}
        # Backing files no handle uses now, kept registered (least recently used first) so
        # that the next open of a hot chunk costs the daemon no I/O and the kernel no ioctl.
        self._idle: OrderedDict[int, _Backing] = OrderedDict()
        # Requests answered in the receive loop, without a task: see init().
        self._inline: dict[int, Callable[[_Request], None]] = {}
        self._idle_now: Callable[[], None] = _nothing
        self._fast_misses: FastMisses | None = None
        self._handlers: dict[int, Callable[[_Request], Awaitable[None]]] = {
            Opcode.LOOKUP: self._lookup,
            Opcode.GETATTR: self._getattr,
            Opcode.FORGET: self._forget,
            Opcode.BATCH_FORGET: self._batch_forget,
            Opcode.SETATTR: self._setattr,
            Opcode.READLINK: self._readlink,
            Opcode.SYMLINK: self._symlink,
            Opcode.MKNOD: self._mknod,
            Opcode.MKDIR: self._mkdir,
            Opcode.UNLINK: self._unlink,
            Opcode.RMDIR: self._rmdir,
            Opcode.RENAME: self._rename,
            Opcode.RENAME2: self._rename,
            Opcode.LINK: self._link,
            Opcode.OPEN: self._open,
            Opcode.READ: self._read,
            Opcode.WRITE: self._write_data,
            Opcode.STATFS: self._statfs,
            Opcode.RELEASE: self._release,
            Opcode.FSYNC: self._fsync,
            Opcode.SETXATTR: self._setxattr,
            Opcode.GETXATTR: self._getxattr,
            Opcode.LISTXATTR: self._listxattr,
            Opcode.REMOVEXATTR: self._removexattr,
            Opcode.FLUSH: self._flush,
            Opcode.OPENDIR: self._opendir,
            Opcode.READDIR: self._readdir,
            Opcode.READDIRPLUS: self._readdir,
            Opcode.RELEASEDIR: self._releasedir,
            Opcode.FSYNCDIR: self._fsyncdir,
            Opcode.ACCESS: self._access,
            Opcode.CREATE: self._create,
            Opcode.INTERRUPT: self._interrupt,
            Opcode.DESTROY: self._destroy,
        }

    # -- pyfuse3's session functions ----------------------------------------------------------

    def init(
        self,
        ops: Any,
        mountpoint: str | os.PathLike[str],
        options: Iterable[str] = pyfuse3.default_options,
    ) -> None:
        """Mount ``ops`` on ``mountpoint`` and agree on the protocol with the kernel.

        Opens /dev/fuse, calls mount(2) (so needs CAP_SYS_ADMIN), then reads the kernel's INIT
        and answers it before returning. Raises RuntimeError, as pyfuse3.init does, when any of
        that fails; nothing stays mounted then.
        """
        if self._fd is not None:
            raise RuntimeError("this session is already mounted")
        path = os.path.abspath(os.fspath(mountpoint))
        opts = MountOptions.parse(options)
        try:
            rootmode = stat.S_IFMT(os.stat(path).st_mode)
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            raise RuntimeError(f"cannot mount {path}: {err}") from None
        try:
            _mount(opts.fsname, path, f"fuse.{opts.subtype}", opts.flags, opts.data(fd, rootmode))
        except OSError as err:
            os.close(fd)
            raise RuntimeError(f"cannot mount {path}: {err.strerror}") from None
        self._fd, self._ops, self.mountpoint, self.options = fd, ops, path, opts
        # Operations that answer from memory, never waiting (``lookup_now``, ``getattr_now``,
        # ``getxattr_now``, ``forget_now``; ``open_now`` and ``release_now`` for readers of
        # chunks whose backing file the session holds), are called in the receive loop: no
        # task per request, a third to a half less latency and CPU. Where one needs I/O after
        # all it raises NeedsIO, and the request is served in a task.
        # ``create_now``, ``flush_now``, ``release_now``, ``rename_now`` and ``mkdir_now``
        # answer the common steps of a store (a new passthrough file, its close, its last
        # release, its rename to the final name, the directories above it) the same way (the
        # rename's publish follows in the background).
        # ``idle_now()``, where there is one, is called whenever the loop has answered all it
        # holds, before it reads again: bookkeeping that need not delay an answer.
        inline = [
            "lookup",
            "getattr",
            "getxattr",
            "forget",
            "open",
            "release",
            "create",
            "flush",
            "rename",
            "mkdir",
        ]
        if all(hasattr(ops, f"{op}_now") for op in inline):
            self._inline = {
                Opcode.LOOKUP: self._lookup_now,
                Opcode.GETATTR: self._getattr_now,
                Opcode.GETXATTR: self._getxattr_now,
                Opcode.OPEN: self._open_now,
                Opcode.RELEASE: self._release_now,
                Opcode.CREATE: self._create_now,
                Opcode.FLUSH: self._flush_now,
                Opcode.RENAME: self._rename_now,
                Opcode.RENAME2: self._rename_now,
                Opcode.MKDIR: self._mkdir_now,
            }
        self._idle_now = getattr(ops, "idle_now", None) or _nothing
        # First-time misses answered in C (``FastMisses``): not with allow_root, whose
        # requests are checked for their caller first.
        fast = getattr(ops, "fast_misses", None)
        self._fast_misses = fast if _answer_miss is not None and not opts.allow_root else None
        self._stopping = False
        devices = _mount_devices(path)
        self._dev = devices[-1] if devices else None
        try:
            self._handshake()
        except BaseException:
            self.close(unmount=True)
            raise

    async def main(self, min_tasks: int = 1, max_tasks: int = 99) -> None:
        """Serve requests until the mount goes away or ``terminate()`` is called.

        Each request runs in its own task, at most ``max_tasks`` at once (past that the session
        reads no more requests until one finishes); ``min_tasks`` is accepted for pyfuse3's
        signature and has no use here. On return, the requests already in hand have been
        answered, or given up after ``drain_timeout``; those the kernel still holds end at
        ``close()``.
        """
        fd = self._fd
        if fd is None:
            raise RuntimeError("Need to call init() before main()")
        reader = trio.CancelScope()
        with self._lock:
            if self._stopping:
                return
            self._token = trio.lowlevel.current_trio_token()
            self._loop_thread = threading.get_ident()
            self._reader = reader
        slots = trio.Semaphore(max(1, max_tasks))
        ring = self._ring
        # Over io_uring, requests come from the ring's queues; forgets and interrupts still
        # come on /dev/fuse, where the requests before the ring was ready came too.
        receivers: list[Receiver] = [Receiver(fd, self._bufsize, spins=ring is None)]
        if ring is not None:
            receivers.append(RingReceiver(ring, self._bufsize))
        # slots free while no request task runs (each receiver holds one for its next request)
        idle = slots.value - len(receivers)
        instrument = LoopIdle(ring) if ring is not None else None
        try:
            async with trio.open_nursery() as nursery:
                self._tasks = nursery
                with reader:
                    if instrument is not None:
                        trio.lowlevel.add_instrument(instrument)
                    async with trio.open_nursery() as receiving:
                        for receiver in receivers[1:]:
                            receiving.start_soon(self._receive_ring, receiver, slots, idle)
                            receiving.start_soon(self._time_ring_misses)
                        await self._receive(receivers[0], slots, idle, dev=True)
                        receiving.cancel_scope.cancel()
                # A handler that never returns must not keep the daemon from stopping: past
                # the deadline its request stays unanswered until close() ends it.
                nursery.cancel_scope.deadline = trio.current_time() + self.drain_timeout
        finally:
            if instrument is not None:
                with contextlib.suppress(KeyError):
                    trio.lowlevel.remove_instrument(instrument)
            with self._lock:
                self._token = self._loop_thread = self._reader = None
            self._tasks = None

    async def _receive(
        self, receiver: Receiver, slots: trio.Semaphore, idle: int, dev: bool = False
    ) -> None:
        """Serve what ``receiver`` delivers until it ends (the mount went away). ``dev``: it
        reads /dev/fuse, where first-time misses may be answered in C (``answer_miss``)."""
        nursery = self._tasks
        assert nursery is not None
        fast, answer_miss = (self._fast_misses, _answer_miss) if dev else (None, None)
        miss = _negative_entry(fast.timeout) if fast is not None else b""
        fd = receiver.fd
        unyielded = 0  # requests read since the loop last let other tasks run
        while True:
            if unyielded >= YIELD_EVERY:
                # (and after every task started: it runs up to its first wait before the
                # next request is read, so requests start in the kernel's order; a RELEASE
                # before the OPEN after it)
                unyielded = 0
                await trio.lowlevel.checkpoint()
            try:  # a free slot without a pass through the scheduler
                slots.acquire_nowait()
            except trio.WouldBlock:
                unyielded = 0
                await slots.acquire()
            unyielded += 1
            is_idle = slots.value == idle
            if is_idle:
                self._answered_all()
            size = receiver.now(is_idle)
            if size < 0:  # none yet: wait in trio (or the read failed)
                try:
                    waited = await receiver.wait(size, is_idle)
                except BaseException:
                    slots.release()
                    raise
                if waited is None:
                    slots.release()
                    return
                size = waited
            if fast is not None and answer_miss is not None:  # a miss, in C
                took = answer_miss(fd, receiver.buf, size, fast.dirs, fast.noted, miss)
                if took:
                    if took > 0:
                        fast.answered(took * 1e-9)
                    else:
                        _not_sent(Opcode.LOOKUP, -took)
                    slots.release()
                    continue
            req = self._parse(receiver.view, size)
            inline = self._inline.get(req.opcode)
            if (
                inline is not None
                and not self._turned_away(req)
                and self._serve_now(inline, req)  # no task: a third less latency
            ):
                slots.release()
                continue
            nursery.start_soon(self._serve, req, slots)
            unyielded = YIELD_EVERY

    async def _receive_ring(self, receiver: Receiver, slots: trio.Semaphore, idle: int) -> None:
        """``_receive`` over the io_uring queues; their end ends the session's reading (they
        end with the connection; one that failed would leave its CPU's callers waiting)."""
        try:
            await self._receive(receiver, slots, idle)
        finally:
            errors = [err for err in self._ring.errors() if err] if self._ring else []
            if errors:
                log.error("the io_uring queues stopped: %s", os.strerror(errors[0]))
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.cancel()

    def terminate(self) -> None:
        """Make ``main()`` stop reading requests and return once those in hand are answered
        (or given up after ``drain_timeout``). Safe from any thread, and before ``main()`` has
        started (it then returns at once)."""
        with self._lock:
            self._stopping = True
            token, thread, reader = self._token, self._loop_thread, self._reader
        if reader is None or token is None:
            return
        if thread == threading.get_ident():
            reader.cancel()
        else:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(reader.cancel)

    def close(self, unmount: bool = True) -> None:
        """Close the connection, and with ``unmount`` detach the mount (lazily, as libfuse does
        for root) if it is still this session's. Call after ``main()`` has returned.

        Closing the device ends every request the kernel still holds (its callers get ENOTCONN,
        later ones too while the mount exists). A notification that is still inside the kernel
        (it may wait there for a request nobody will answer now) is freed by aborting the
        connection through fusectl, which is what closing the device does.
        """
        ring, self._ring = self._ring, None
        if ring is not None:  # first: its pending commands hold the device open
            ring.close()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            deadline = time.monotonic() + 1.0
            while self._notifying and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._notifying:
                self.abort()
            with self._lock:
                if self._notifying:  # its fd number must stay ours until it returns
                    self._orphan_fd, fd = fd, None
            if fd is not None:
                os.close(fd)
        self._inode_backing.clear()  # the kernel dropped every backing id with the connection
        self._handle_backing.clear()
        self._idle.clear()
        path, self.mountpoint = self.mountpoint, None
        devices = _mount_devices(path) if unmount and path is not None else []
        if path is not None and self._dev in devices:
            if devices[-1] != self._dev:  # unmounting would take the other mount away
                log.warning("%s: another mount covers this session's; left mounted", path)
            else:
                try:
                    _umount_lazy(path)
                except OSError as err:
                    log.warning("could not unmount %s: %s", path, err.strerror)
        self._dev = None

    def readdir_reply(
        self, token: ReaddirToken, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int
    ) -> bool:
        """``readdir_reply`` of this module (what ``pyfuse3.readdir_reply`` is to pyfuse3)."""
        return readdir_reply(token, name, attr, next_id)

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        """Make the kernel forget the inode's attributes and, unless ``attr_only``, its cached
        data. Raises OSError: ENOENT when the kernel does not know the inode."""
        out = abi.NOTIFY_INVAL_INODE_OUT.pack(inode, -1 if attr_only else 0, 0)
        self._notify(NotifyCode.INVAL_INODE, [out])

    def invalidate_entry(self, inode_p: int, name: bytes, deleted: int = 0) -> None:
        """Make the kernel forget the name (positive or negative) in directory ``inode_p``;
        with ``deleted`` (the inode the name was), also tell inotify watchers it was deleted.

        May block until requests on that directory or inode are answered: never call it from a
        request handler, nor while holding what a handler waits for. Raises OSError: ENOENT
        when the kernel does not know the directory.
        """
        if len(name) > abi.NAME_MAX:
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        if deleted:
            head = abi.NOTIFY_DELETE_OUT.pack(inode_p, deleted, len(name), 0)
            self._notify(NotifyCode.DELETE, [head, name, b"\0"])
        else:
            head = abi.NOTIFY_INVAL_ENTRY_OUT.pack(inode_p, len(name), 0)
            self._notify(NotifyCode.INVAL_ENTRY, [head, name, b"\0"])

    # -- passthrough --------------------------------------------------------------------------

    def open_backing(self, fd: int) -> int:
        """Register the open file ``fd`` as a passthrough backing file; returns its backing id.

        The kernel takes its own reference to the file: ``fd`` may be closed afterwards.
        Raises OSError: EPERM without CAP_SYS_ADMIN or when passthrough was not agreed, ELOOP
        when the file's filesystem is itself stacked (overlayfs, FUSE), EINVAL (EISDIR) when it
        is not a regular file.
        """
        dev = self._fd
        if dev is None:
            raise OSError(errno.ENOTCONN, "the FUSE session is closed")
        backing_map = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        return int(fcntl.ioctl(dev, abi.DEV_IOC_BACKING_OPEN, backing_map, True))

    def close_backing(self, backing_id: int) -> None:
        """Drop a backing id. Files opened with it keep their backing file until closed."""
        dev = self._fd
        if dev is None:  # the kernel dropped every id with the connection
            return
        fcntl.ioctl(dev, abi.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("=I", backing_id)), True)

    @property
    def io_uring(self) -> bool:
        """Whether requests come over FUSE-over-io_uring (known once init() has returned)."""
        return self._ring is not None

    @property
    def backings(self) -> int:
        """How many backing ids this session holds for open handles."""
        return len({id(b) for held in self._handle_backing.values() for b in held})

    def _attach_backing(self, ino: int, fi: pyfuse3.FileInfo) -> int:
        """The backing id to answer an open of ``ino`` with, or 0 to serve it."""
        backing_id: int | None = getattr(fi, "backing_id", None)
        backing_fd: int | None = getattr(fi, "backing_fd", None)
        reuse: bool = getattr(fi, "reuse", False)
        if not self.passthrough or (backing_id is None and backing_fd is None and not reuse):
            return 0
        if backing_id is not None:  # registered (and owned) by the operations
            return backing_id
        if reuse:
            backing = self._held(ino)
            if backing is None:  # dropped since the operations asked: served
                return 0
            self.stats.backing_reused += 1
            return self._use(ino, fi.fh, backing)
        assert backing_fd is not None
        try:
            st = os.fstat(backing_fd)
            key = (st.st_dev, st.st_ino)
            backing = self._inode_backing.get(ino, {}).get(key)
            if backing is None:  # the kernel takes one backing object per inode at a time
                backing = _Backing(self.open_backing(backing_fd), key)
                self._inode_backing.setdefault(ino, {})[key] = backing
        except OSError as err:  # the open goes on, served: its handle exists by now
            self._backing_refused(err)
            return 0
        return self._use(ino, fi.fh, backing)

    def _use(self, ino: int, fh: int, backing: _Backing) -> int:
        if backing.refs == 0 and self._idle.get(ino) is backing:
            del self._idle[ino]
        backing.refs += 1
        self._handle_backing.setdefault((ino, fh), []).append(backing)
        return backing.backing_id

    def _held(self, ino: int) -> _Backing | None:
        """The one current backing file the session holds for ``ino``, if it holds one."""
        registered = [b for b in self._inode_backing.get(ino, {}).values() if not b.stale]
        return registered[0] if len(registered) == 1 else None

    def holds_backing(self, ino: int) -> bool:
        """Whether an open of ``ino`` may pass through without a backing fd (``reuse``)."""
        return self.passthrough and self._held(ino) is not None

    def forget_backing(self, ino: int) -> None:
        """The bytes of ``ino`` changed or went (a new version, an eviction, a quarantine):
        no later open may reuse what the session holds for it, and what no handle uses is
        dropped now (the kernel's reference would keep an evicted file's space)."""
        for backing in list(self._inode_backing.get(ino, {}).values()):
            backing.stale = True
            if backing.refs == 0:
                self._idle.pop(ino, None)
                self._drop(ino, backing)

    def _backing_refused(self, err: OSError) -> None:
        self.stats.backing_refused += 1
        if err.errno == errno.EPERM:
            log.warning(
                "the kernel refuses passthrough backing files (EPERM: CAP_SYS_ADMIN needed);"
                " serving every read and write from now on"
            )
            self.passthrough = False
        elif err.errno == errno.ELOOP:  # overlayfs, FUSE: the kernel allows no deeper stack
            log.debug("backing file on a stacked filesystem: served")
        else:
            log.warning("passthrough backing file refused: %s; served", err)

    def _detach_backing(self, ino: int, fh: int) -> None:
        """A handle of ``ino`` was released: drop its backing id if no other handle uses it."""
        held = self._handle_backing.get((ino, fh))
        if not held:
            return
        backing = held.pop()
        if not held:
            del self._handle_backing[(ino, fh)]
        backing.refs -= 1
        if backing.refs:
            return
        if backing.stale:
            self._drop(ino, backing)
            return
        previous = self._idle.pop(ino, None)  # one idle backing per inode: the newest
        if previous is not None and previous is not backing:
            self._drop(ino, previous)
        self._idle[ino] = backing
        while len(self._idle) > IDLE_BACKINGS:
            old_ino, old = self._idle.popitem(last=False)
            self._drop(old_ino, old)

    def _drop(self, ino: int, backing: _Backing) -> None:
        registered = self._inode_backing.get(ino, {})
        if registered.get(backing.file) is backing:
            del registered[backing.file]
            if not registered:
                del self._inode_backing[ino]
        try:
            self.close_backing(backing.backing_id)
        except OSError as err:
            log.warning("could not drop backing id %d: %s", backing.backing_id, err)

    # -- the connection -----------------------------------------------------------------------

    def _handshake(self) -> None:
        """Read the kernel's INIT (queued by mount(2)) and answer it."""
        fd = self._fd
        assert fd is not None
        buf = bytearray(self._bufsize)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.init_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"no FUSE INIT from the kernel in {self.init_timeout:.0f}s")
            if not poller.poll(remaining * 1000):
                continue
            try:
                size = os.readv(fd, [buf])
            except (BlockingIOError, FileNotFoundError):
                continue
            except OSError as err:
                raise RuntimeError(f"reading /dev/fuse: {err.strerror}") from None
            req = self._parse(memoryview(buf), size)
            if req.opcode != Opcode.INIT:
                raise RuntimeError(f"the kernel sent {_opname(req.opcode)} before INIT")
            if self._init(req):
                return

    def _init(self, req: _Request) -> bool:
        """Answer INIT; False when the kernel must send another (it speaks a newer major)."""
        major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(req.body)
        if major > abi.KERNEL_VERSION:
            # fuse.h: answer with our major; the kernel sends INIT again in it.
            out = abi.INIT_OUT.pack(abi.KERNEL_VERSION, abi.KERNEL_MINOR_VERSION, *[0] * 16)
            self._reply(req, [out])
            return False
        if major < abi.KERNEL_VERSION or minor < abi.MIN_KERNEL_MINOR:
            self._reply_error(req, errno.EPROTO)  # a protocol this session does not speak
            raise RuntimeError(f"kernel FUSE protocol {major}.{minor} is too old")
        offered = InitFlag(flags)
        if offered & InitFlag.INIT_EXT and len(req.body) >= abi.INIT_IN_EXT.size:
            offered |= InitFlag(abi.INIT_IN_EXT.unpack_from(req.body)[4] << 32)
        ops = self._ops
        want = (
            InitFlag.ASYNC_READ
            | InitFlag.BIG_WRITES
            | InitFlag.MAX_PAGES
            | InitFlag.ATOMIC_O_TRUNC  # open() gets O_TRUNC, as with pyfuse3 (libfuse's default)
            | InitFlag.AUTO_INVAL_DATA  # cached pages go when mtime or size change
            | InitFlag.ASYNC_DIO
            | InitFlag.PARALLEL_DIROPS  # lookups and readdir in one directory run concurrently
            | InitFlag.DO_READDIRPLUS  # always, not READDIRPLUS_AUTO: as pyfuse3 promises
            | InitFlag.INIT_EXT
        )
        # Not HANDLE_KILLPRIV(_V2): the kernel then clears setuid/setgid bits on write, chown
        # and truncate itself; the operations would otherwise have to.
        if getattr(ops, "supports_dot_lookup", True):
            want |= InitFlag.EXPORT_SUPPORT
        if getattr(ops, "enable_acl", False):
            want |= InitFlag.POSIX_ACL
        if getattr(ops, "enable_writeback_cache", False):
            want |= InitFlag.WRITEBACK_CACHE  # excludes passthrough (kernel rule)
        elif self.want_passthrough:
            want |= InitFlag.PASSTHROUGH
        if self.want_io_uring:
            want |= InitFlag.OVER_IO_URING
        granted = want & offered
        if not granted & InitFlag.DO_READDIRPLUS:
            # Operations count every readdir entry as a lookup, which only READDIRPLUS makes
            # true (pyfuse3 refuses such kernels too).
            self._reply_error(req, errno.EPROTO)
            raise RuntimeError("the kernel offers no READDIRPLUS")
        self.kernel_flags, self.flags = offered, granted
        self.passthrough = bool(granted & InitFlag.PASSTHROUGH)
        self.proto_minor = min(minor, abi.KERNEL_MINOR_VERSION)
        self.max_readahead = max_readahead  # the kernel's offer: its bdi read-ahead decides
        max_pages = self.max_write // PAGE_SIZE if granted & InitFlag.MAX_PAGES else 0
        init = getattr(ops, "init", None)
        if init is not None:
            try:
                init()
            except Exception:
                self._reply_error(req, errno.EIO)  # the kernel fails every access then
                raise
        out = abi.INIT_OUT.pack(
            abi.KERNEL_VERSION,
            self.proto_minor,
            max_readahead,
            int(granted) & 0xFFFFFFFF,
            self.max_background,
            self.congestion_threshold,
            self.max_write,
            1,  # time_gran: nanoseconds
            max_pages,
            0,  # map_alignment (DAX only)
            int(granted) >> 32,
            1 if self.passthrough else 0,  # max_stack_depth: backing files on unstacked fs
            *[0] * 6,
        )
        if not self._reply(req, [out]):
            raise RuntimeError("the kernel refused the INIT reply")
        if granted & InitFlag.OVER_IO_URING:  # (the queues register once the kernel is set up)
            assert self._fd is not None
            self._ring = open_ring(self._fd, max(self.max_write, max_pages * PAGE_SIZE))
            fast = self._fast_misses
            if self._ring is not None and fast is not None:
                self._ring.fast_misses(fast.dirs, fast.noted, _negative_entry(fast.timeout))
        log.info(
            "FUSE %d.%d with the kernel (it speaks 7.%d); passthrough %s; io_uring %s",
            abi.KERNEL_VERSION,
            self.proto_minor,
            minor,
            "on" if self.passthrough else "off",
            "on" if self._ring is not None else "off",
        )
        return True

    def _parse(self, view: memoryview, size: int) -> _Request:
        header = abi.IN_HEADER.unpack_from(view)
        start = abi.IN_HEADER.size
        end = size - header[7] * 8  # request extensions follow the arguments
        if header[1] == Opcode.WRITE:  # the bytes apart, copied once
            split = start + abi.WRITE_IN.size
            return _Request(header, view[start:split].tobytes(), view[split:end].tobytes())
        return _Request(header, view[start:end].tobytes())

    def _answered_all(self) -> None:
        self.time_ring_misses()
        try:
            self._idle_now()
        except Exception:
            log.exception("idle_now failed")

    def time_ring_misses(self) -> None:
        """Time the misses the ring's threads answered since (into the lookup latencies). On
        the loop's thread only."""
        ring, fast = self._ring, self._fast_misses
        if ring is not None and fast is not None:
            for took in ring.answered():
                self.stats.ring_misses += 1
                fast.answered(took * 1e-9)

    async def _time_ring_misses(self) -> None:
        """Misses answered on the ring's threads never wake the loop: time them now and then
        too, not only when a request comes (a scrape of /metrics would miss them)."""
        while True:
            await trio.sleep(RING_MISSES_TIMED_EVERY)
            self.time_ring_misses()

    def _serve_now(self, handler: Callable[[_Request], None], req: _Request) -> bool:
        """Answer a request inline; False if it needs I/O after all (``NeedsIO``): it is then
        served in a task, like any other."""
        try:
            handler(req)
        except NeedsIO:
            return False
        except Exception as err:
            self._fail_with(req, err)
        return True

    async def _serve(self, req: _Request, slots: trio.Semaphore) -> None:
        try:
            handler = self._handlers.get(req.opcode)
            if handler is None:
                # The kernel remembers ENOSYS for most opcodes and does without them.
                self._fail(req, errno.ENOSYS)
            elif self._turned_away(req):
                self._fail(req, errno.EACCES)  # allow_root: only root and the mounter
            else:
                try:
                    await handler(req)
                except Exception as err:
                    self._fail_with(req, err)
        finally:
            slots.release()

    def _fail_with(self, req: _Request, err: Exception) -> None:
        """Answer what a handler raised: a FUSEError's or OSError's errno; anything else is a
        bug, logged with its traceback (called in the except block), and EIO."""
        if isinstance(err, pyfuse3.FUSEError):
            self._fail(req, err.errno)
        elif isinstance(err, OSError):
            self._fail(req, err.errno or errno.EIO)
        else:
            log.exception("%s failed: EIO for this request", _opname(req.opcode))
            self._fail(req, errno.EIO)

    def _turned_away(self, req: _Request) -> bool:
        return (
            self.options.allow_root
            and req.uid not in (0, os.getuid())
            and req.opcode not in _ON_OPEN_HANDLES
        )

    def _reply(self, req: _Request, parts: Sequence[Buffer]) -> bool:
        """Answer a request with success and ``parts``; False when the answer reached nobody."""
        size = abi.OUT_HEADER.size + sum(map(len, parts))
        header = abi.OUT_HEADER.pack(size, 0, req.unique)
        if len(parts) == 1 and size <= _JOINED:  # one write(2): cheaper than writev's list
            return self._send(req, [header + parts[0]])
        return self._send(req, [header, *parts])

    def _reply_error(self, req: _Request, err: int) -> None:
        if not 0 < err < 512:  # the kernel takes nothing else (and EIO says "daemon bug")
            log.error("%s: errno %d is not an errno; EIO instead", _opname(req.opcode), err)
            err = errno.EIO
        self.stats.errors[err] = self.stats.errors.get(err, 0) + 1
        self._send(req, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -err, req.unique)])

    def _fail(self, req: _Request, err: int) -> None:
        if req.opcode in _NO_REPLY:
            log.warning("%s failed: %s", _opname(req.opcode), os.strerror(err))
        else:
            self._reply_error(req, err)

    def _send(self, req: _Request, parts: Sequence[Buffer]) -> bool:
        fd = self._fd
        if fd is None:
            return False
        # A request that came over io_uring is answered there: its CPU's thread commits the
        # answer. (Its caller waits for it whatever happens, as on /dev/fuse once a request is
        # read; only the connection's end takes it away, and then nothing is left to undo.)
        if self._ring is not None and self._ring.reply(parts):
            return True
        try:
            os.write(fd, parts[0]) if len(parts) == 1 else os.writev(fd, parts)
        except OSError as err:
            _not_sent(req.opcode, err.errno or errno.EIO)
            return False
        return True

    def _notify(self, code: NotifyCode, parts: list[bytes]) -> None:
        size = abi.OUT_HEADER.size + sum(map(len, parts))
        with self._lock:
            fd = self._fd
            if fd is None:
                raise OSError(errno.ENOTCONN, "the FUSE session is closed")
            self._notifying += 1
        try:
            os.writev(fd, [abi.OUT_HEADER.pack(size, code, 0), *parts])
        finally:
            with self._lock:
                self._notifying -= 1
                if not self._notifying and self._orphan_fd is not None:
                    os.close(self._orphan_fd)
                    self._orphan_fd = None

    def abort(self) -> None:
        """Abort the connection, as fusectl's ``abort`` does (mounting fusectl for the moment
        if it is not): every request the kernel holds ends with ENOTCONN, and so does every
        later one; ``main()`` returns. The last resort against a request that never ends."""
        if self._dev is None:
            return
        major, minor = self._dev
        name = str(minor if major == 0 else (major << 20) | minor)  # the kernel's dev_t
        connections = "/sys/fs/fuse/connections"
        mounted = None
        try:
            if not os.path.exists(os.path.join(connections, name)):
                mounted = tempfile.mkdtemp(prefix="kvfs-fusectl-")
                _mount("fusectl", mounted, "fusectl", 0, "")
                connections = mounted
            with open(os.path.join(connections, name, "abort"), "w") as f:
                f.write("1")
            log.warning("aborted the FUSE connection of %s", self.mountpoint)
        except OSError as err:
            log.error("could not abort the FUSE connection %s: %s", name, err)
        finally:
            if mounted is not None:
                with contextlib.suppress(OSError):
                    _umount_lazy(mounted)
                with contextlib.suppress(OSError):
                    os.rmdir(mounted)

    # -- requests -----------------------------------------------------------------------------

    def _ctx(self, req: _Request, umask: int = 0) -> RequestContext:
        return RequestContext(req.uid, req.gid, req.pid, umask)

    async def _reply_entry(self, req: _Request, entry: pyfuse3.EntryAttributes) -> None:
        if not self._reply(req, [_entry_out(entry)]) and entry.st_ino:
            await self._forget_lost([(entry.st_ino, 1)])  # the kernel never counted it

    async def _forget_lost(self, lost: list[tuple[int, int]]) -> None:
        try:
            await self._ops.forget(lost)
        except Exception:
            log.exception("forget of entries the kernel never received failed")

    async def _lookup(self, req: _Request) -> None:
        entry = await self._ops.lookup(req.nodeid, _name(req.body), self._ctx(req))
        await self._reply_entry(req, entry)

    def _lookup_now(self, req: _Request) -> None:
        entry = self._ops.lookup_now(req.nodeid, _name(req.body))
        if not self._reply(req, [_entry_out(entry)]) and entry.st_ino:
            self._ops.forget_now([(entry.st_ino, 1)])  # the kernel never counted it

    async def _forget(self, req: _Request) -> None:
        (nlookup,) = abi.FORGET_IN.unpack_from(req.body)
        await self._ops.forget([(req.nodeid, nlookup)])

    async def _batch_forget(self, req: _Request) -> None:
        count, _ = abi.BATCH_FORGET_IN.unpack_from(req.body)
        start = abi.BATCH_FORGET_IN.size
        forgets = [
            abi.FORGET_ONE.unpack_from(req.body, start + i * abi.FORGET_ONE.size)
            for i in range(count)
        ]
        await self._ops.forget(forgets)

    async def _getattr(self, req: _Request) -> None:
        self._reply(req, [_attr_out(await self._ops.getattr(req.nodeid, self._ctx(req)))])

    def _getattr_now(self, req: _Request) -> None:
        self._reply(req, [_attr_out(self._ops.getattr_now(req.nodeid))])

    async def _setattr(self, req: _Request) -> None:
        (valid, _, fh, size, _, atime, mtime, ctime, atime_ns, mtime_ns, ctime_ns, mode, _, uid,
         gid, _) = abi.SETATTR_IN.unpack_from(req.body)  # fmt: skip
        attr = pyfuse3.EntryAttributes()
        attr.st_mode, attr.st_uid, attr.st_gid, attr.st_size = mode, uid, gid, size
        now = time.time_ns()
        attr.st_atime_ns = now if valid & SetattrValid.ATIME_NOW else atime * _NS + atime_ns
        attr.st_mtime_ns = now if valid & SetattrValid.MTIME_NOW else mtime * _NS + mtime_ns
        attr.st_ctime_ns = ctime * _NS + ctime_ns
        fields = SetattrFields(
            update_atime=bool(valid & (SetattrValid.ATIME | SetattrValid.ATIME_NOW)),
            update_mtime=bool(valid & (SetattrValid.MTIME | SetattrValid.MTIME_NOW)),
            update_ctime=bool(valid & SetattrValid.CTIME),
            update_mode=bool(valid & SetattrValid.MODE),
            update_uid=bool(valid & SetattrValid.UID),
            update_gid=bool(valid & SetattrValid.GID),
            update_size=bool(valid & SetattrValid.SIZE),
        )
        handle = fh if valid & SetattrValid.FH else None
        attr = await self._ops.setattr(req.nodeid, attr, fields, handle, self._ctx(req))
        self._reply(req, [_attr_out(attr)])

    async def _readlink(self, req: _Request) -> None:
        target = await self._ops.readlink(req.nodeid, self._ctx(req))
        self._reply(req, [target])

    async def _symlink(self, req: _Request) -> None:
        name, target = _two_names(req.body, 0)
        entry = await self._ops.symlink(req.nodeid, name, target, self._ctx(req))
        await self._reply_entry(req, entry)

    async def _mknod(self, req: _Request) -> None:
        mode, rdev, umask, _ = abi.MKNOD_IN.unpack_from(req.body)
        name = _name(req.body, abi.MKNOD_IN.size)
        ctx = self._ctx(req, umask)
        entry = await self._ops.mknod(req.nodeid, name, mode, _decode_dev(rdev), ctx)
        await self._reply_entry(req, entry)

    async def _mkdir(self, req: _Request) -> None:
        entry = await self._ops.mkdir(req.nodeid, *self._mkdir_in(req))
        await self._reply_entry(req, entry)

    def _mkdir_now(self, req: _Request) -> None:
        entry = self._ops.mkdir_now(req.nodeid, *self._mkdir_in(req))
        if not self._reply(req, [_entry_out(entry)]):
            self._ops.forget_now([(entry.st_ino, 1)])  # the kernel never counted it

    def _mkdir_in(self, req: _Request) -> tuple[bytes, int, RequestContext]:
        mode, umask = abi.MKDIR_IN.unpack_from(req.body)
        mode = (mode & ~stat.S_IFMT(mode)) | stat.S_IFDIR  # the kernel leaves the type out
        return _name(req.body, abi.MKDIR_IN.size), mode, self._ctx(req, umask)

    async def _unlink(self, req: _Request) -> None:
        await self._ops.unlink(req.nodeid, _name(req.body), self._ctx(req))
        self._reply(req, [])

    async def _rmdir(self, req: _Request) -> None:
        await self._ops.rmdir(req.nodeid, _name(req.body), self._ctx(req))
        self._reply(req, [])

    async def _rename(self, req: _Request) -> None:
        old, newdir, new, flags = self._rename_in(req)
        await self._ops.rename(req.nodeid, old, newdir, new, flags, self._ctx(req))
        self._reply(req, [])

    def _rename_now(self, req: _Request) -> None:
        old, newdir, new, flags = self._rename_in(req)
        self._ops.rename_now(req.nodeid, old, newdir, new, flags)
        self._reply(req, [])

    @staticmethod
    def _rename_in(req: _Request) -> tuple[bytes, int, bytes, int]:
        if req.opcode == Opcode.RENAME2:
            newdir, flags, _ = abi.RENAME2_IN.unpack_from(req.body)
            old, new = _two_names(req.body, abi.RENAME2_IN.size)
        else:
            (newdir,), flags = abi.RENAME_IN.unpack_from(req.body), 0
            old, new = _two_names(req.body, abi.RENAME_IN.size)
        return old, newdir, new, flags

    async def _link(self, req: _Request) -> None:
        (inode,) = abi.LINK_IN.unpack_from(req.body)
        name = _name(req.body, abi.LINK_IN.size)
        entry = await self._ops.link(inode, req.nodeid, name, self._ctx(req))
        await self._reply_entry(req, entry)

    async def _open(self, req: _Request) -> None:
        flags, _ = abi.OPEN_IN.unpack_from(req.body)
        fi = await self._ops.open(req.nodeid, flags, self._ctx(req))
        read_only = flags & os.O_ACCMODE == os.O_RDONLY
        await self._reply_open(req, req.nodeid, fi, None, read_only)

    async def _create(self, req: _Request) -> None:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(req.body)
        name = _name(req.body, abi.CREATE_IN.size)
        ctx = self._ctx(req, umask)
        fi, entry = await self._ops.create(req.nodeid, name, mode, flags, ctx)
        await self._reply_open(req, entry.st_ino, fi, entry)

    def _create_now(self, req: _Request) -> None:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(req.body)
        name = _name(req.body, abi.CREATE_IN.size)
        fi, entry = self._ops.create_now(req.nodeid, name, mode, flags, self._ctx(req, umask))
        if not self._reply(req, self._open_out(entry.st_ino, fi, entry, read_only=False)):
            assert self._tasks is not None  # (inline requests are answered in main() only)
            self._tasks.start_soon(self._opener_gone, entry.st_ino, fi, entry)

    def _open_now(self, req: _Request) -> None:
        flags, _ = abi.OPEN_IN.unpack_from(req.body)
        fi = self._ops.open_now(req.nodeid, flags)  # a reader's: NeedsIO for any other
        if not self._reply(req, self._open_out(req.nodeid, fi, None, read_only=True)):
            # The opener is gone (see _reply_open); its handle may be reading its chunk already.
            assert self._tasks is not None  # (inline requests are answered in main() only)
            self._tasks.start_soon(self._opener_gone, req.nodeid, fi, None)

    async def _reply_open(
        self,
        req: _Request,
        ino: int,
        fi: pyfuse3.FileInfo,
        entry: pyfuse3.EntryAttributes | None,
        read_only: bool = False,
    ) -> None:
        if not self._reply(req, self._open_out(ino, fi, entry, read_only)):
            await self._opener_gone(ino, fi, entry)

    async def _opener_gone(
        self, ino: int, fi: pyfuse3.FileInfo, entry: pyfuse3.EntryAttributes | None
    ) -> None:
        """The kernel will send no RELEASE for a handle whose open reply reached nobody, nor
        FORGET for the entry it never received: both are undone here, as the kernel would."""
        try:
            await self._ops.release(fi.fh)
        except Exception:
            log.exception("release of a handle the kernel never received failed")
        finally:
            self._detach_backing(ino, fi.fh)
        if entry is not None and entry.st_ino:
            await self._forget_lost([(entry.st_ino, 1)])

    def _open_out(
        self,
        ino: int,
        fi: pyfuse3.FileInfo,
        entry: pyfuse3.EntryAttributes | None,
        read_only: bool,
    ) -> list[Buffer]:
        """The reply to an open: the handle, how the kernel is to use it, and its backing id
        where it passes through (registered here)."""
        # A reader's close() has nothing to flush: no FLUSH round trip for it.
        flags = OpenFlag.NOFLUSH if read_only else OpenFlag(0)
        if fi.direct_io:
            flags |= OpenFlag.DIRECT_IO
        if fi.keep_cache:
            flags |= OpenFlag.KEEP_CACHE
        if fi.nonseekable:
            flags |= OpenFlag.NONSEEKABLE
        backing_id = self._attach_backing(ino, fi)
        if backing_id:
            # The kernel caches nothing of its own for the handle: the backing file's page
            # cache serves it, so DIRECT_IO and KEEP_CACHE have no meaning here.
            flags = OpenFlag.PASSTHROUGH | (flags & (OpenFlag.NONSEEKABLE | OpenFlag.NOFLUSH))
            self.stats.passthrough_opens += 1
        else:
            self.stats.served_opens += 1
        parts: list[Buffer] = [] if entry is None else [_entry_out(entry)]
        parts.append(abi.OPEN_OUT.pack(fi.fh, flags, backing_id))
        return parts

    async def _read(self, req: _Request) -> None:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(req.body)
        data = await self._ops.read(fh, offset, size)
        self._reply(req, [_as_bytes(data)[:size]])  # the kernel takes no more than it asked

    async def _write_data(self, req: _Request) -> None:
        fh, offset, *_ = abi.WRITE_IN.unpack_from(req.body)
        written = await self._ops.write(fh, offset, req.data)
        self._reply(req, [abi.WRITE_OUT.pack(written, 0)])

    async def _flush(self, req: _Request) -> None:
        (fh, *_) = abi.FLUSH_IN.unpack_from(req.body)
        await self._ops.flush(fh, req.pid)
        self._reply(req, [])

    def _flush_now(self, req: _Request) -> None:
        (fh, *_) = abi.FLUSH_IN.unpack_from(req.body)
        self._ops.flush_now(fh, req.pid)
        self._reply(req, [])

    async def _release(self, req: _Request) -> None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(req.body)
        try:
            await self._ops.release(fh)
        finally:
            self._detach_backing(req.nodeid, fh)
        self._reply(req, [])

    def _release_now(self, req: _Request) -> None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(req.body)
        try:
            self._ops.release_now(fh)  # a reader's or a store's: NeedsIO for any other
        except NeedsIO:
            raise  # served in a task, which detaches after its release
        except BaseException:
            self._detach_backing(req.nodeid, fh)
            raise
        self._detach_backing(req.nodeid, fh)
        self._reply(req, [])

    async def _fsync(self, req: _Request) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        await self._ops.fsync(fh, bool(flags & abi.FSYNC_FDATASYNC))
        self._reply(req, [])

    async def _opendir(self, req: _Request) -> None:
        fh = await self._ops.opendir(req.nodeid, self._ctx(req))
        if not self._reply(req, [abi.OPEN_OUT.pack(fh, 0, 0)]):
            await self._ops.releasedir(fh)  # the kernel will send no RELEASEDIR for it

    async def _readdir(self, req: _Request) -> None:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(req.body)
        token = ReaddirToken(size, plus=req.opcode == Opcode.READDIRPLUS)
        await self._ops.readdir(fh, offset, token)
        if not self._reply(req, [token.buf]) and token.entries:
            await self._forget_lost([(ino, 1) for ino in token.entries])

    async def _releasedir(self, req: _Request) -> None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(req.body)
        await self._ops.releasedir(fh)
        self._reply(req, [])

    async def _fsyncdir(self, req: _Request) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        await self._ops.fsyncdir(fh, bool(flags & abi.FSYNC_FDATASYNC))
        self._reply(req, [])

    async def _statfs(self, req: _Request) -> None:
        st = await self._ops.statfs(self._ctx(req))
        out = abi.STATFS_OUT.pack(
            st.f_blocks,
            st.f_bfree,
            st.f_bavail,
            st.f_files,
            st.f_ffree,
            st.f_bsize,
            st.f_namemax,
            st.f_frsize,
            *[0] * 7,
        )
        self._reply(req, [out])

    async def _setxattr(self, req: _Request) -> None:
        size, flags = abi.SETXATTR_IN.unpack_from(req.body)
        name, _, rest = req.body[abi.SETXATTR_IN.size :].partition(b"\0")
        value = rest[:size]
        ctx = self._ctx(req)
        # XATTR_CREATE and XATTR_REPLACE are checked here, as pyfuse3 does: the operations'
        # setxattr has no flags argument.
        if flags & ~(os.XATTR_CREATE | os.XATTR_REPLACE):
            raise pyfuse3.FUSEError(errno.EINVAL)  # setxattr(2) knows no other flag
        if flags & os.XATTR_CREATE:
            try:
                await self._ops.getxattr(req.nodeid, name, ctx)
            except pyfuse3.FUSEError as err:
                if err.errno != pyfuse3.ENOATTR:
                    raise
            else:
                raise pyfuse3.FUSEError(errno.EEXIST)  # setxattr(2): it exists already
        elif flags & os.XATTR_REPLACE:
            await self._ops.getxattr(req.nodeid, name, ctx)  # ENOATTR when it does not exist
        await self._ops.setxattr(req.nodeid, name, value, ctx)
        self._reply(req, [])

    async def _getxattr(self, req: _Request) -> None:
        size, _ = abi.GETXATTR_IN.unpack_from(req.body)
        name = _name(req.body, abi.GETXATTR_IN.size)
        value = await self._ops.getxattr(req.nodeid, name, self._ctx(req))
        self._reply_sized(req, size, bytes(value))

    def _getxattr_now(self, req: _Request) -> None:
        size, _ = abi.GETXATTR_IN.unpack_from(req.body)
        name = _name(req.body, abi.GETXATTR_IN.size)
        self._reply_sized(req, size, bytes(self._ops.getxattr_now(req.nodeid, name)))

    async def _listxattr(self, req: _Request) -> None:
        size, _ = abi.GETXATTR_IN.unpack_from(req.body)
        names = await self._ops.listxattr(req.nodeid, self._ctx(req))
        self._reply_sized(req, size, b"".join(bytes(name) + b"\0" for name in names))

    def _reply_sized(self, req: _Request, size: int, value: bytes) -> None:
        """The xattr size protocol: asked with size 0, the size the value needs; else the
        value if it fits, and ERANGE (as getxattr(2) and listxattr(2) say) if not."""
        if size == 0:
            self._reply(req, [abi.GETXATTR_OUT.pack(len(value), 0)])
        elif len(value) <= size:
            self._reply(req, [value])
        else:
            self._reply_error(req, errno.ERANGE)

    async def _removexattr(self, req: _Request) -> None:
        await self._ops.removexattr(req.nodeid, _name(req.body), self._ctx(req))
        self._reply(req, [])

    async def _access(self, req: _Request) -> None:
        mask, _ = abi.ACCESS_IN.unpack_from(req.body)
        if not await self._ops.access(req.nodeid, mask, self._ctx(req)):
            raise pyfuse3.FUSEError(errno.EACCES)  # pyfuse3's answer to a False
        self._reply(req, [])

    async def _interrupt(self, req: _Request) -> None:
        """Ignored, as pyfuse3 does: the interrupted request runs to its end and is answered;
        the handlers' own deadlines bound how long that takes."""

    async def _destroy(self, req: _Request) -> None:
        log.debug("the kernel is destroying the connection")
        self._reply(req, [])
