"""What each handle (``fh``) of the mount stands for: an open file, a directory listing, or a
control file's generated content; and how many handles each node has open, passthrough or not
(the kernel's rule for passthrough is per inode)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass

from pyfuse3 import FUSEError

from kvfs.buffers import ChunkBuffer
from kvfs.index import Node
from kvfs.mount.bridge import Future
from kvfs.mount.objects import Reader

Entry = tuple[bytes, Node | int]  # a name in a listing; an int is a control file


@dataclass
class Handle:
    node: Node
    writable: bool
    # The process that opened it, where the session's FLUSH does not name its caller (pyfuse3):
    # a writer killed mid-file is not published.
    opener: int = 0
    passthrough: bool = False  # the kernel reads and writes it itself, not through us
    reader: Reader | None = None  # the version this reader opened
    content: Future[tuple[Reader, ChunkBuffer]] | None = None  # that version, read and verified


class Handles:
    def __init__(self) -> None:
        self._files: dict[int, Handle] = {}
        self._dirs: dict[int, list[Entry]] = {}
        self._control: dict[int, bytes] = {}
        self._next = 1

    def new_fh(self) -> int:
        """A handle number for a table of another module's (the batched lookups')."""
        return self._fh()

    def _fh(self) -> int:
        self._next += 1
        return self._next - 1

    def open_file(self, handle: Handle) -> int:
        fh = self._fh()
        self._files[fh] = handle
        handle.node.open_count += 1
        handle.node.passthrough_opens += handle.passthrough
        return fh

    def file(self, fh: int) -> Handle:
        try:
            return self._files[fh]
        except KeyError:
            raise FUSEError(errno.EBADF) from None

    def get_file(self, fh: int) -> Handle | None:
        """The file handle ``fh``, if it is one."""
        return self._files.get(fh)

    def close_file(self, fh: int) -> Handle:
        handle = self._files.pop(fh)
        handle.node.open_count -= 1
        handle.node.passthrough_opens -= handle.passthrough
        return handle

    def readers(self) -> Iterator[Reader]:
        return (h.reader for h in self._files.values() if h.reader is not None)

    def open_dir(self, entries: list[Entry]) -> int:
        """A snapshot of a directory's names: offsets stay stable while it is read."""
        fh = self._fh()
        self._dirs[fh] = entries
        return fh

    def listing(self, fh: int) -> list[Entry]:
        return self._dirs[fh]

    def close_dir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    def open_control(self, content: bytes) -> int:
        fh = self._fh()
        self._control[fh] = content
        return fh

    def control(self, fh: int) -> bytes | None:
        """A control file's content, if ``fh`` is one."""
        return self._control.get(fh)

    def close_control(self, fh: int) -> bool:
        return self._control.pop(fh, None) is not None
