"""The daemon's side of the batched lookup (``.kvfs/lookup``; kvfs/control_protocol.py defines
the request): a handle collects a request from WRITEs, and its first READ answers every name
from the index.

Hostile input is bounded before anything is kept: a request may not exceed
``LOOKUP_MAX_REQUEST`` bytes per handle, nor all handles' pending requests together
``PENDING_MAX`` (EAGAIN: try again once others are answered). A request is parsed and resolved
in full before any miss is counted, so one that fails (EINVAL, EACCES) changes nothing. Names
are resolved in the index only: no path leaves the mount (``..`` is refused, symlinks are not
followed, the control directory is not in the index).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from kvfs import control_protocol as proto
from kvfs import layout
from kvfs.index import Index, Node
from kvfs.mount.lookups import LookupCounts

PENDING_MAX = 4 * proto.LOOKUP_MAX_REQUEST  # all handles together: memory a client can pin
SLICE = 8192  # names resolved between two yields to the event loop (other requests go on)


def _fail(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@dataclass(frozen=True)
class Caller:
    """Who opened the handle: search permission is theirs, checked as the kernel would."""

    uid: int
    groups: frozenset[int]

    def may_search(self, node: Node) -> bool:
        if self.uid == 0:
            return True
        if self.uid == node.uid:
            return bool(node.mode & stat.S_IXUSR)
        if node.gid in self.groups:
            return bool(node.mode & stat.S_IXGRP)
        return bool(node.mode & stat.S_IXOTH)


@dataclass
class LookupHandle:
    caller: Caller
    request: bytearray = field(default_factory=bytearray)
    answer: bytes = b""
    busy: bool = False  # being answered: a second request on it meanwhile gets EBUSY
    # A write the request failed (EINVAL, EFBIG, EAGAIN): what every later write and read of
    # it gets, until a new request starts at offset 0. The kernel turns a failure past the
    # first piece of a large write into a short count, so the client's next write or its read
    # must still see why.
    failed: int | None = None


class BatchLookups:
    """Every open handle of ``.kvfs/lookup``, and the bytes their requests hold."""

    def __init__(
        self, index: Index, counts: LookupCounts, fall_through: FallThrough | None = None
    ) -> None:
        self.index, self.counts = index, counts
        # A shared backing directory (--shared): what the index lacks may be another host's.
        self.fall_through = fall_through
        self.handles: dict[int, LookupHandle] = {}
        self.pending = 0

    def open(self, fh: int, caller: Caller) -> None:
        self.handles[fh] = LookupHandle(caller)

    def close(self, fh: int) -> bool:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return False
        self._drop(handle)
        return True

    def _drop(self, handle: LookupHandle) -> None:
        self.pending -= len(handle.request)
        handle.request = bytearray()

    def write(self, fh: int, offset: int, data: bytes) -> int:
        """Offset 0 starts a request (the last answer is dropped); any other offset must
        continue the one being written."""
        handle = self.handles[fh]
        if handle.busy:
            raise _fail(errno.EBUSY)
        if offset == 0:
            self._drop(handle)
            handle.answer, handle.failed = b"", None
        elif handle.failed is not None:
            raise _fail(handle.failed)
        failure = None
        if offset != len(handle.request):
            failure = errno.EINVAL
        elif len(handle.request) + len(data) > proto.LOOKUP_MAX_REQUEST:
            failure = errno.EFBIG
        elif self.pending + len(data) > PENDING_MAX:
            failure = errno.EAGAIN
        if failure is not None:
            self._drop(handle)
            handle.failed = failure
            raise _fail(failure)
        handle.request += data
        self.pending += len(data)
        return len(data)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        """The answer, from ``offset``: the first read after a request resolves it."""
        handle = self.handles[fh]
        if handle.busy:
            raise _fail(errno.EBUSY)
        if handle.failed is not None:
            raise _fail(handle.failed)
        if handle.request:
            request = bytes(handle.request)
            self._drop(handle)
            handle.busy = True
            try:
                handle.answer = await self._resolve(request, handle.caller)
            finally:
                handle.busy = False
        return handle.answer[offset : offset + size]

    async def _resolve(self, request: bytes, caller: Caller) -> bytes:
        base_line, _, body = request.partition(b"\n")
        lines = _names(body)
        base_parts = _components(base_line, allow_empty=True)
        base = self._walk(self.index.root, base_parts, caller)
        answer = bytearray([proto.LOOKUP_MISS]) * len(lines)
        misses: list[tuple[int, Node, bytes]] = []
        unknown: list[int] = []  # lines the index has nothing for (no file, no folder)
        # Each distinct directory walked once, from its parent's entry (vLLM's folders,
        # <hex3>/<hex2>_g<group>, are nearly all distinct, their parents few); only
        # directories the caller may search are kept. The loop is the daemon's cost per name.
        dirs: dict[bytes, Node | None] = {b"": base}
        folder_of = dirs.get
        for start in range(0, len(lines), SLICE):
            if start:
                await trio.lowlevel.checkpoint()
            for i in range(start, min(start + SLICE, len(lines))):
                folder, _, name = lines[i].rpartition(b"/")
                parent = folder_of(folder, _UNKNOWN)
                if parent is _UNKNOWN:
                    parent = self._folder(dirs, folder, caller)
                if parent is None:
                    unknown.append(i)
                    continue
                # a cached folder is a directory: it has children
                node = parent.children.get(name)  # type: ignore[union-attr]
                if node is None:
                    misses.append((i, parent, name))
                    unknown.append(i)
                elif node.is_file:
                    answer[i] = proto.LOOKUP_HIT
        if self.fall_through is not None and unknown:
            found = await self._fall_through(base_parts, lines, unknown, caller)
            for i in found:
                answer[i] = proto.LOOKUP_HIT
            misses = [miss for miss in misses if miss[0] not in found]
        # The whole request was valid: only now count (a LOOKUP's miss, for each).
        for _, parent, name in misses:
            if parent.attached:
                self.counts.miss(parent, name)
        return bytes(answer)

    async def _fall_through(
        self, base_parts: list[bytes], lines: list[bytes], unknown: list[int], caller: Caller
    ) -> set[int]:
        """Of the lines the index lacks, those another host published on the shared backing
        directory (found in one trip, and joined to the index). Each is then walked as any
        other, with the caller's search permission."""
        assert self.fall_through is not None
        base = b"/".join(base_parts)
        rels = {i: os.path.join(base, lines[i]) if base else lines[i] for i in unknown}
        files = await self.fall_through(list(rels.values()))
        found = set()
        for i, rel in rels.items():
            if rel in files:
                folder, _, name = lines[i].rpartition(b"/")
                parts = [*base_parts, *(folder.split(b"/") if folder else [])]
                parent = self._walk(self.index.root, parts, caller)
                node = (
                    None if parent is None or parent.children is None else parent.children.get(name)
                )
                if node is not None and node.is_file:
                    found.add(i)
        return found

    def _folder(self, dirs: dict[bytes, Node | None], folder: bytes, caller: Caller) -> Node | None:
        """A directory below the base, through the cache of its parent (iterative: a hostile
        name may have two thousand components)."""
        above, _, name = folder.rpartition(b"/")
        parent = dirs.get(above, _UNKNOWN)
        if parent is _UNKNOWN:
            start = dirs[b""]
            parent = None if start is None else self._walk(start, above.split(b"/"), caller)
            dirs[above] = parent
        # One step below a cached (so searchable) directory, inline: it runs for most names.
        node = None if parent is None else parent.children.get(name)  # type: ignore[union-attr]
        if node is not None and node.children is None:
            node = None  # not a directory (a symlink included: never followed)
        if node is not None and not caller.may_search(node):
            raise _fail(errno.EACCES)
        dirs[folder] = node
        return node

    @staticmethod
    def _walk(start: Node, parts: list[bytes], caller: Caller) -> Node | None:
        """The directory at ``parts`` below ``start``, or None where a name is missing or not
        a directory (a symlink included: never followed). EACCES where the caller could not
        search a directory on the way, as the kernel's own walk would."""
        node: Node | None = start
        for part in parts:
            if node is None or node.children is None:
                return None
            if not caller.may_search(node):
                raise _fail(errno.EACCES)
            node = node.children.get(part)
        if node is None or node.children is None:
            return None
        if not caller.may_search(node):
            raise _fail(errno.EACCES)
        return node


FallThrough = Callable[[list[bytes]], Awaitable[set[bytes]]]
_UNKNOWN = Node(0, b"", stat.S_IFDIR)  # not in the cache yet (None: known to be missing)


def _names(body: bytes) -> list[bytes]:
    """The request's names, each checked as `_components` would; EINVAL for any bad one. The
    usual request (vLLM's names: no dot first, short) is proven valid by a few scans in C."""
    if body.endswith(b"\n"):
        body = body[:-1]  # the optional final newline
    if not body:
        raise _fail(errno.EINVAL)
    lines = body.split(b"\n")
    # With every newline made a slash, two scans find an empty component ("//", "\n/",
    # "/\n", "\n\n") or one starting with a dot (among them "." and ".."): each scan of a
    # two-byte pattern is a pass over the body, so two instead of six.
    joined = body.translate(_NEWLINE_AS_SLASH)
    suspect = (
        body[:1] in (b"/", b".", b"\n")
        or body[-1:] in (b"/", b"\n")
        or b"//" in joined
        or b"/." in joined
        or b"\0" in body
        or max(map(len, lines)) > layout.NAME_MAX
    )
    if suspect:
        for line in lines:
            _components(line, allow_empty=False)
    return lines


_NEWLINE_AS_SLASH = bytes.maketrans(b"\n", b"/")


def _components(path: bytes, allow_empty: bool) -> list[bytes]:
    if not path:
        if allow_empty:
            return []
        raise _fail(errno.EINVAL)
    if len(path) >= layout.PATH_MAX:
        raise _fail(errno.EINVAL)
    parts = path.split(b"/")
    for part in parts:
        _check_name(part)
    return parts


def _check_name(name: bytes) -> None:
    if not name or name in (b".", b"..") or len(name) > layout.NAME_MAX or b"\0" in name:
        raise _fail(errno.EINVAL)
