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


_ZEROS = memoryview(bytes(EXTENT))  # what a hole reads as


class ChunkBuffer:
    """The bytes of one file, ``size`` long, in extents.

    An extent that was never written is a hole (``None``): it reads as zeros and takes no
    memory, so ``truncate -s 1G`` or a write at a 1 GiB offset costs one extent at most. In an
    extent that exists, bytes below ``size`` are the file's; bytes past it are undefined.
    """

    def __init__(self, pool: ExtentPool) -> None:
        self._pool = pool
        self.extents: list[mmap.mmap | None] = []
        self.size = 0

    @property
    def capacity(self) -> int:
        """Memory held: the extents that exist, holes not counted."""
        return sum(EXTENT for extent in self.extents if extent is not None)

    def extents_to_add(self, offset: int, end: int) -> int:
        """How many extents a write of [offset, end) would bring into existence."""
        if end <= offset:
            return 0
        first, last = offset // EXTENT, (end - 1) // EXTENT
        return sum(
            1 for i in range(first, last + 1) if i >= len(self.extents) or self.extents[i] is None
        )

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` in at ``offset``, growing the file (a gap reads as zeros)."""
        end = offset + len(data)
        if not data:
            return
        if offset > self.size:
            self._zero(self.size, offset)
        new_size = max(self.size, end)
        if len(self.extents) < extents_for(end):
            self.extents.extend([None] * (extents_for(end) - len(self.extents)))
        src = memoryview(data)
        pos = offset
        while src:
            index, start = divmod(pos, EXTENT)
            count = min(len(src), EXTENT - start)
            extent = self.extents[index]
            if extent is None:
                extent = self.extents[index] = self._pool.take()
                base = index * EXTENT
                # Fresh (or reused) memory: what the write does not cover and the file does
                # must read as zeros.
                extent[0:start] = _ZEROS[:start]
                tail = min(EXTENT, new_size - base)
                if tail > start + count:
                    extent[start + count : tail] = _ZEROS[: tail - start - count]
            extent[start : start + count] = src[:count]
            src, pos = src[count:], pos + count
        self.size = new_size

    def truncate(self, size: int) -> None:
        """Grow with zeros (a hole, no memory) or shrink."""
        if size > self.size:
            self._zero(self.size, size)
        else:
            keep = extents_for(size)
            self._pool.give([e for e in self.extents[keep:] if e is not None])
            del self.extents[keep:]
        self.size = size

    def allocate(self, size: int) -> list[mmap.mmap]:
        """Make an empty buffer ``size`` long with every extent in memory (to read a file
        into); returns the extents, in order. Their content is undefined until written."""
        assert not self.extents
        extents = [self._pool.take() for _ in range(extents_for(size))]
        self.extents = list(extents)
        self.size = size
        return extents

    def read(self, offset: int, size: int) -> memoryview | bytes:
        """Bytes [offset, offset+size) clipped to the file; a view when one extent holds them."""
        end = min(self.size, offset + size)
        if offset >= end:
            return b""
        index, start = divmod(offset, EXTENT)
        if end - offset <= EXTENT - start:
            extent = self._extent(index)
            return memoryview(extent)[start : start + end - offset]
        return b"".join(self.views(offset, end))

    def views(self, offset: int = 0, end: int | None = None) -> list[memoryview]:
        """The bytes [offset, end) as one view per extent, in order (holes as zeros)."""
        return [view for _, view, _ in self.segments(offset, end)]

    def segments(
        self, offset: int = 0, end: int | None = None
    ) -> list[tuple[int, memoryview, bool]]:
        """(file offset, bytes, is a hole) per extent of [offset, end)."""
        end = self.size if end is None else end
        out = []
        pos = offset
        while pos < end:
            index, start = divmod(pos, EXTENT)
            count = min(end - pos, EXTENT - start)
            extent = self.extents[index] if index < len(self.extents) else None
            view = (_ZEROS if extent is None else memoryview(extent))[start : start + count]
            out.append((pos, view, extent is None))
            pos += count
        return out

    def checksum(self) -> str:
        digest = xxhash.xxh3_64()
        for view in self.views():
            digest.update(view)
        return checksum.PREFIX + digest.hexdigest()

    def release(self) -> None:
        """Give every extent back to the pool; the buffer is empty afterwards."""
        self._pool.give([e for e in self.extents if e is not None])
        self.extents = []
        self.size = 0

    def _extent(self, index: int) -> mmap.mmap | memoryview:
        extent = self.extents[index] if index < len(self.extents) else None
        return _ZEROS if extent is None else extent

    def _zero(self, start: int, end: int) -> None:
        """Zero [start, end) where extents exist (holes already read as zeros)."""
        pos = start
        while pos < end:
            index, offset = divmod(pos, EXTENT)
            count = min(end - pos, EXTENT - offset)
            extent = self.extents[index] if index < len(self.extents) else None
            if extent is not None:
                extent[offset : offset + count] = _ZEROS[:count]
            pos += count
