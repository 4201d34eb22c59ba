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
    where they lie in the page cache (mapped, not copied: the file was just written). Holes
    are hashed as the zeros they read as, never faulted in: a sparse gigabyte would take a
    gigabyte of page cache (and of the daemon's resident set) for a few blocks of data."""
    size = os.fstat(fd).st_size
    digest = xxhash.xxh3_64()
    try:
        for start, end, data in _extents(fd, size):
            if data:
                _hash_mapped(digest, fd, start, end)
            else:
                _hash_zeros(digest, end - start)
    except OSError as err:
        if err.errno != errno.ENODEV:
            raise
        return _of_file_read(fd)  # a filesystem that maps nothing (sshfs -o direct_io)
    return PREFIX + digest.hexdigest(), size


def _extents(fd: int, size: int) -> list[tuple[int, int, bool]]:
    """(start, end, holds data) of the file's ranges, in order; all data where the
    filesystem tells no holes (SEEK_DATA unsupported: one extent, as before)."""
    extents: list[tuple[int, int, bool]] = []
    offset = 0
    while offset < size:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:  # a hole to the end
                data = size
            elif err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return [(0, size, True)]
            else:
                raise
        data = min(data, size)
        if data > offset:
            extents.append((offset, data, False))
        if data >= size:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        extents.append((data, hole, True))
        offset = hole
    return extents


def _hash_mapped(digest: xxhash.xxh3_64, fd: int, start: int, end: int) -> None:
    base = start - start % mmap.ALLOCATIONGRANULARITY  # (blocks may be smaller than pages)
    with mmap.mmap(fd, end - base, prot=mmap.PROT_READ, offset=base) as mapped:
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapped) as view:
            digest.update(view[start - base :])


_ZEROS = bytes(1 << 20)


def _hash_zeros(digest: xxhash.xxh3_64, count: int) -> None:
    with memoryview(_ZEROS) as zeros:
        while count > 0:
            step = min(count, len(zeros))
            digest.update(zeros[:step])
            count -= step


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
