"""Whole-file buffers made of page-aligned 1 MiB extents from a pool that is reused.

Why extents, and why a pool:
  * Page-aligned memory lets the daemon move chunk bytes to and from the backing store with
    O_DIRECT: one copy, no second page cache, the same path vLLM takes on a plain directory.
  * Memory that was touched before is ~20x faster to fill than fresh memory (measured here:
    15 GB/s against 0.68 GB/s for 2 MiB), so extents go back to a pool instead of the kernel.
  * A file grows by whole extents, never by reallocating (and copying) what it holds; READ and
    WRITE requests (at most 1 MiB, aligned) touch a single extent, served without a copy.

Thread-safety: the pool is used from the event loop and from I/O threads; list.append and
list.pop are atomic under the GIL, which is all it needs. A ChunkBuffer has one owner at a time.
"""

from __future__ import annotations

import contextlib
import mmap

import xxhash

from kvfs import checksum

EXTENT = 1 << 20
ALIGN = 4096  # O_DIRECT needs sizes and offsets in logical blocks; 4 KiB covers every disk


def on_disk(size: int) -> int:
    """The room a file of ``size`` bytes takes, in whole 4 KiB blocks."""
    return -(-size // ALIGN) * ALIGN


def extents_for(size: int) -> int:
    return -(-size // EXTENT)


class ExtentPool:
    """A free list of 1 MiB anonymous mappings, keeping at most ``keep_bytes`` of them."""

    def __init__(self, keep_bytes: int) -> None:
        self._free: list[mmap.mmap] = []
        self._keep = max(1, keep_bytes // EXTENT)

    def take(self) -> mmap.mmap:
        try:
            return self._free.pop()
        except IndexError:
            return mmap.mmap(-1, EXTENT)

    def give(self, extents: list[mmap.mmap]) -> None:
        for extent in extents:
            if len(self._free) < self._keep:
                self._free.append(extent)
            else:
                with contextlib.suppress(BufferError):  # a reply still holds a view of it
                    extent.close()

    @property
    def free_bytes(self) -> int:
        return len(self._free) * EXTENT


class ChunkBuffer:
    """The bytes of one file, ``size`` long, in extents. Bytes past ``size`` are undefined."""

    def __init__(self, pool: ExtentPool) -> None:
        self._pool = pool
        self.extents: list[mmap.mmap] = []
        self.size = 0

    @property
    def capacity(self) -> int:
        return len(self.extents) * EXTENT

    def extra_extents(self, end: int) -> int:
        """How many extents a write or truncate up to ``end`` would add."""
        return max(0, extents_for(end) - len(self.extents))

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset``, growing the file (a hole reads as zeros)."""
        end = offset + len(data)
        self._ensure(end)
        if offset > self.size:
            self._zero(self.size, offset)
        src = memoryview(data)
        pos = offset
        while src:
            index, start = divmod(pos, EXTENT)
            count = min(len(src), EXTENT - start)
            self.extents[index][start : start + count] = src[:count]
            src, pos = src[count:], pos + count
        self.size = max(self.size, end)

    def truncate(self, size: int) -> None:
        if size > self.size:
            self._ensure(size)
            self._zero(self.size, size)
        else:
            keep = extents_for(size)
            self._pool.give(self.extents[keep:])
            del self.extents[keep:]
        self.size = size

    def read(self, offset: int, size: int) -> memoryview | bytes:
        """Bytes [offset, offset+size) clipped to the file; a view when one extent holds them."""
        end = min(self.size, offset + size)
        if offset >= end:
            return b""
        index, start = divmod(offset, EXTENT)
        if end - offset <= EXTENT - start:
            return memoryview(self.extents[index])[start : start + end - offset]
        return b"".join(self.views(offset, end))

    def views(self, offset: int = 0, end: int | None = None) -> list[memoryview]:
        """The bytes [offset, end) as one view per extent, in order."""
        end = self.size if end is None else end
        out = []
        pos = offset
        while pos < end:
            index, start = divmod(pos, EXTENT)
            count = min(end - pos, EXTENT - start)
            out.append(memoryview(self.extents[index])[start : start + count])
            pos += count
        return out

    def checksum(self) -> str:
        digest = xxhash.xxh3_64()
        for view in self.views():
            digest.update(view)
        return checksum.PREFIX + digest.hexdigest()

    def release(self) -> None:
        """Give every extent back to the pool; the buffer is empty afterwards."""
        self._pool.give(self.extents)
        self.extents = []
        self.size = 0

    def _ensure(self, end: int) -> None:
        while self.capacity < end:
            self.extents.append(self._pool.take())

    def _zero(self, start: int, end: int) -> None:
        for view in self.views(start, end):
            view[:] = bytes(len(view))
