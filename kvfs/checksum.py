"""Chunk checksums: xxh3-64 of the whole file, kept in an xattr of the backing file.

The value names its algorithm (``xxh3-64:<16 hex>``) so that a later format can change the
algorithm without misreading old files.
"""

from __future__ import annotations

import errno
import os

import xxhash

XATTR = "user.kvfs.checksum"
PREFIX = "xxh3-64:"


def checksum(data: bytes | bytearray | memoryview) -> str:
    return PREFIX + xxhash.xxh3_64_hexdigest(data)


def read_xattr(path_or_fd: bytes | int) -> str | None:
    """The checksum stored with a backing file, or None if it has none (or xattrs don't work)."""
    try:
        value = os.getxattr(path_or_fd, XATTR).decode("ascii", "replace")
    except OSError:
        return None
    return value if value.startswith(PREFIX) else None


def write_xattr(fd: int, value: str) -> bool:
    """Store a checksum with a backing file; False where the filesystem has no user xattrs."""
    try:
        os.setxattr(fd, XATTR, value.encode("ascii"))
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


class ChecksumMismatch(OSError):
    """A backing file's bytes do not match the checksum stored with it."""
