"""Open a file only where the kernel resolves its path from its caches alone: no disk or
network I/O on the way, so an event loop may open it itself rather than send the open to a
thread (a trip that costs a loop two wake-ups, far more than the open).

``openat2`` with ``RESOLVE_CACHED`` (Linux 5.12+) fails with EAGAIN where any part of the
path is not in the dentry cache, or the filesystem would revalidate it (NFS, FUSE): io_uring's
own test before it opens a file inline. None for any failure, and from then on where the
kernel lacks the call: the caller opens the file where blocking is allowed.
"""

from __future__ import annotations

import ctypes
import errno
import os

_SYS_OPENAT2 = 437  # the same on every architecture (asm-generic's table)
_RESOLVE_CACHED = 0x20
_AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long
_offered = True  # until the kernel says it lacks openat2 or RESOLVE_CACHED


def open_cached(path: bytes, flags: int) -> int | None:
    """``os.open(path, flags | O_CLOEXEC)`` (no O_CREAT) if the path is in the kernel's
    caches, else None."""
    global _offered
    if not _offered:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_CACHED)
    fd = _syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(path),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd >= 0:
        return int(fd)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):
        _offered = False  # an older kernel (or a seccomp filter): never offered here
    return None
