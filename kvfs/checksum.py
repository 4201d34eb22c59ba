"""Chunk checksums: xxh3-64 of the whole file, kept in an xattr of the backing file.

The value names its algorithm (``xxh3-64:<16 hex>``) so that a later format can change the
algorithm without misreading old files.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import threading

import xxhash

XATTR = "user.kvfs.checksum"
PREFIX = "xxh3-64:"
_VALUE = re.compile(rb"xxh3-64:[0-9a-f]{16}")


def checksum(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    return PREFIX + xxhash.xxh3_64_hexdigest(data)


def parse(value: bytes) -> str:
    """A checksum as ``checksum`` writes it (the algorithm, then 16 lowercase hex digits), from
    outside (a writer's declaration); ValueError for anything else."""
    if not _VALUE.fullmatch(value):
        raise ValueError(f"not a checksum: {value[:40]!r}")
    return value.decode()


def of_file(fd: int) -> tuple[str, int]:
    """The checksum of an open file's bytes as they are now, and how many there were, hashed
    where they lie in the page cache (mapped, not copied: the file was just written)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return checksum(b""), 0
    try:
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except OSError as err:
        if err.errno != errno.ENODEV:
            raise
        return _of_file_read(fd)  # a filesystem that maps nothing (sshfs -o direct_io)
    with mapped:
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapped) as view:
            return checksum(view), size


def _of_file_read(fd: int, block: int = 1 << 20) -> tuple[str, int]:
    """``of_file`` by reading, to the end of the file."""
    digest = xxhash.xxh3_64()
    size = 0
    while chunk := os.pread(fd, block, size):
        digest.update(chunk)
        size += len(chunk)
    return PREFIX + digest.hexdigest(), size


_buffers = threading.local()  # each I/O thread's aligned read buffer, made once


def of_file_direct(fd: int, block: int = 1 << 20) -> tuple[str, int]:
    """``of_file`` for an fd opened O_DIRECT (past the page cache: what the disk holds), read
    in whole aligned blocks into page-aligned memory."""
    buf = getattr(_buffers, "block", None)
    if buf is None or len(buf) != block:
        buf = _buffers.block = mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE)
    digest = xxhash.xxh3_64()
    size = 0
    with memoryview(buf) as view:
        while True:
            count = os.preadv(fd, [view], size)
            digest.update(view[:count])
            size += count
            if count < block:  # the end (read on there, O_DIRECT would be unaligned)
                break
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
