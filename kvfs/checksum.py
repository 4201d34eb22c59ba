"""Chunk checksums: xxh3-64 of the whole file, kept in an xattr of the backing file.

The value names its algorithm (``xxh3-64:<16 hex>``) so that a later format can change the
algorithm without misreading old files.
"""

from __future__ import annotations

import errno
import mmap
import os

import xxhash

XATTR = "user.kvfs.checksum"
PREFIX = "xxh3-64:"


def checksum(data: bytes | bytearray | memoryview) -> str:
    return PREFIX + xxhash.xxh3_64_hexdigest(data)


def of_file(fd: int, block: int = 1 << 20) -> tuple[str, int]:
    """The checksum of an open file's bytes as they are now, and how many there were. Reads
    whole aligned blocks into page-aligned memory, so ``fd`` may be opened O_DIRECT."""
    digest = xxhash.xxh3_64()
    size = 0
    with mmap.mmap(-1, block) as buf:
        view = memoryview(buf)
        try:
            while True:
                count = os.preadv(fd, [view], size)
                digest.update(view[:count])
                size += count
                if count < block:  # the end (read on there, O_DIRECT would be unaligned)
                    break
        finally:
            view.release()
    return PREFIX + digest.hexdigest(), size


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
