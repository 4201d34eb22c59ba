"""The FUSE operations of kvfs.

Files are whole objects. A file open for writing lives in a memory buffer (bounded by
``write_buffer_bytes``; writers wait for room, they never fail for it). On close (``flush``) the
buffer is checksummed, written to the backing store under a temp name and renamed to its visible
name: the publish. A file open for reading is read whole from the backing store on its first
READ, verified against its checksum, and served from that buffer: a reader gets every byte or
EIO, never a short count and never bytes that fail their checksum.

Every backing-store call runs on the dual-queue worker pool, inside an operation task of its
own, and no request waits for one longer than ``io_timeout``: past it the request fails with EIO
while the operation completes in the background and keeps the index and backing store in step.

Errno choices:
  ENOENT        a name that is not in the index (misses are also cached by the kernel)
  EEXIST        create/mkdir of an existing name, RENAME_NOREPLACE onto one
  ENAMETOOLONG  a name longer than 255 bytes
  EPERM         hard links, symlinks, device files, FIFOs and sockets; the reserved name
                ``.kvfs`` at the root (the backing directory's private area)
  EINVAL        RENAME_EXCHANGE (not supported), moving a directory into itself, a pin value
                other than 0 or 1
  EIO           a checksum mismatch (the file is quarantined), an expired deadline
  ENOSPC        a publish that does not fit even after evicting all that may go
  ENOTSUP       xattrs other than user.kvfs.pin (the rest are read-only)
  anything else comes from the backing filesystem (EDQUOT, EROFS...)

Capacity and eviction live in mount/eviction.py; this module only decides what may not go
(``_busy``) and how a file goes (``_evict``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from kvfs import layout, namespaces
from kvfs.buffers import ALIGN, EXTENT, ChunkBuffer, ExtentPool, extents_for
from kvfs.checksum import ChecksumMismatch
from kvfs.config import MountConfig
from kvfs.index import ROOT_INO, Index, Node
from kvfs.io_queues import DualQueuePool, Queue
from kvfs.mount import control
from kvfs.mount.bridge import IO, ByteBudget, Detached, Future
from kvfs.mount.events import MountEvents, block_of
from kvfs.mount.eviction import Evictor
from kvfs.mount.invalidator import Invalidator
from kvfs.mount.metrics import TIMED_OPERATIONS, Metrics
from kvfs.store import BackingStore, Published, fill_times

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class WriteState:
    """The buffer of a file that is open for writing (or was, and failed to publish).

    Its extents are taken from the write budget; ``lock`` keeps writes out while it publishes.
    """

    buffer: ChunkBuffer
    dirty: bool = False
    writers: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)


@dataclass
class Handle:
    node: Node
    writable: bool
    fd: int | None = None  # backing file of the version this reader opened
    content: Future[ChunkBuffer] | None = None  # that version, read whole and verified


class KvfsOperations(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, cfg: MountConfig, store: BackingStore, index: Index, capacity: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.store = store
        self.index = index
        self.evictor = Evictor(index, capacity, self._busy, self._evict)
        self.pool = DualQueuePool(cfg.read_threads, cfg.write_threads)
        self.budget = ByteBudget(cfg.write_buffer_bytes)  # extents held by write buffers
        self.extents = ExtentPool(keep_bytes=cfg.write_buffer_bytes)
        self.invalidator = Invalidator()
        self._writes: dict[int, WriteState] = {}
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, list[tuple[bytes, Node | int]]] = {}  # int: a control file
        self._control: dict[int, bytes] = {}  # open control files: their generated content
        self.lookups: defaultdict[int, Counter[str]] = defaultdict(Counter)  # per namespace
        self.counters: Counter[str] = Counter()  # reads, bytes_read, publishes, bytes_written
        self.metrics = Metrics()
        for name in TIMED_OPERATIONS:  # pyfuse3 calls the instance's attributes
            setattr(self, name, self.metrics.timed(name, getattr(self, name)))
        self.events = MountEvents(cfg.events) if cfg.events else None
        self._next_fh = 1
        index.on_release = self._released
        self.deadline_expiries = 0
        self.checksum_failures = 0
        # Created in run(), once trio is running.
        self._ns: trio.Lock
        self.io: IO
        self._detached: Detached

    async def run(self) -> None:
        """Serve requests until the mount goes away or a signal asks us to stop."""
        self._ns = trio.Lock()  # held across a namespace change: index and backing together
        self.io = IO(self.pool)
        async with trio.open_nursery() as nursery:
            self._detached = Detached(nursery)
            nursery.start_soon(self._stop_on_signal)
            nursery.start_soon(self.evictor.sweep_forever)
            nursery.start_soon(self._snapshot_forever)
            if self.events is not None:
                nursery.start_soon(self.events.flush_forever)
            if self.cfg.metrics_port is not None:
                self.metrics.snapshot = self.report(walk=False)
                self.metrics.serve(self.cfg.metrics_port)
            await pyfuse3.main(min_tasks=4, max_tasks=128)
            nursery.cancel_scope.cancel()

    async def _snapshot_forever(self) -> None:
        """Refresh what /metrics serves (its HTTP thread must not walk the live index)."""
        while True:
            if self.cfg.metrics_port is not None:
                self.metrics.snapshot = self.report(walk=False)
            await trio.sleep(1)

    def _chunk_event(self, node: Node, stored: bool) -> None:
        """Tell routers a chunk appeared or went (only names that are chunk files)."""
        if self.events is None or node.parent is None:
            return
        block = block_of(node.name, node.parent.name)
        if block is None:
            return
        if stored:
            top = namespaces.top_level(node)
            config = namespaces.config_for(self.index, top) if top is not None else None
            self.events.chunk_stored(*block, namespaces.tokens_per_chunk(config) or 0)
        else:
            self.events.chunk_removed(*block)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.invalidator.close()
        self.pool.shutdown()
        for handle in self._handles.values():
            if handle.fd is not None:
                os.close(handle.fd)

    @staticmethod
    async def _stop_on_signal() -> None:
        import signal

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                pyfuse3.terminate()
                return

    # -- helpers ----------------------------------------------------------------------------

    async def _bounded(
        self, fn: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None = None
    ) -> T:
        """Run an operation to completion in its own task; wait for it at most io_timeout.

        ``undo`` releases what the operation acquired if it completes after its caller gave up
        (an fd, a writer count): nobody will use it then.
        """
        future = self._detached.start(fn)
        try:
            return await self._wait(future)
        except FUSEError:
            if undo is not None and not future.done:
                self._detached.start(partial(self._undo_late, future, undo))
            raise

    @staticmethod
    async def _undo_late(future: Future[T], undo: Callable[[T], None]) -> None:
        with contextlib.suppress(Exception):  # it failed after all: nothing to undo
            undo(await future.wait())

    async def _wait(self, future: Future[T]) -> T:
        try:
            if self.cfg.io_timeout is None:
                return await future.wait()
            with trio.move_on_after(self.cfg.io_timeout):
                return await future.wait()
        except FUSEError:
            raise
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        self.deadline_expiries += 1
        log.warning("request waited %.1fs on the backing store: EIO", self.cfg.io_timeout)
        raise FUSEError(errno.EIO)

    def _node(self, ino: int) -> Node:
        node = self.index.get(ino)
        if node is None:
            raise FUSEError(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> Node:
        if control.is_control(ino):
            raise FUSEError(errno.EROFS)  # the control directory is read-only
        node = self._node(ino)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        return node

    def _child(self, parent: Node, name: bytes) -> Node:
        node = self.index.child(parent, name)
        if node is None:
            raise FUSEError(errno.ENOENT)
        return node

    @staticmethod
    def _check_name(parent: Node, name: bytes) -> None:
        if len(name) > layout.NAME_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        if layout.is_reserved(parent.ino == ROOT_INO, name):
            raise FUSEError(errno.EPERM)

    def _attached(self, node: Node) -> bytes:
        """The node's relative path; ENOENT if it left the tree meanwhile."""
        if not node.attached:
            raise FUSEError(errno.ENOENT)
        return self.index.path(node)

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.ino
        attr.entry_timeout = attr.attr_timeout = self.cfg.cache_timeout
        attr.st_mode = node.mode
        attr.st_nlink = 2 if node.is_dir else 1
        attr.st_uid, attr.st_gid = node.uid, node.gid
        ws = self._writes.get(node.ino)
        if ws is not None and (ws.dirty or not node.on_backing):
            attr.st_size = ws.buffer.size
            attr.st_blocks = math.ceil(ws.buffer.size / 512)
        else:
            attr.st_size, attr.st_blocks = node.size, node.blocks
        attr.st_blksize = 4096
        attr.st_atime_ns, attr.st_mtime_ns = node.atime_ns, node.mtime_ns
        attr.st_ctime_ns = node.ctime_ns
        return attr

    def _new_fh(self, handle: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        handle.node.open_count += 1
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise FUSEError(errno.EBADF) from None

    # -- names ------------------------------------------------------------------------------

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode == control.DIR_INO or (parent_inode == ROOT_INO and name == control.NAME):
            return self._control_lookup(parent_inode, name)
        parent = self._dir(parent_inode)
        if len(name) > layout.NAME_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            node: Node | None = parent
        elif name == b"..":
            node = parent.parent or parent
        else:
            node = self.index.child(parent, name)
        if node is None:
            self._count_lookup(parent, "miss")
            # A negative entry: the kernel caches the miss, so repeated exists() on a cold
            # cache never reach the daemon. Every create goes through us and replaces it.
            miss = pyfuse3.EntryAttributes()
            miss.st_ino = 0
            miss.entry_timeout = self.cfg.cache_timeout
            return miss
        node.lookups += 1
        return self._attrs(node)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.index.forget(ino, count)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if control.is_control(inode):
            return control.attrs(inode, self.cfg.cache_timeout)
        return self._attrs(self._node(inode))

    def _count_lookup(self, parent: Node, result: str) -> None:
        """Per namespace: a hit is a chunk opened for reading; a miss, a name the daemon was
        asked for and does not have (the kernel answers repeated misses itself, uncounted)."""
        top = namespaces.top_level(parent) if parent.ino != ROOT_INO else None
        if top is not None:
            self.lookups[top.ino][result] += 1

    def _control_lookup(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes:
        ino = control.DIR_INO if parent_inode == ROOT_INO else control.FILES.get(name)
        if ino is None:
            raise FUSEError(errno.ENOENT)
        return control.attrs(ino, self.cfg.cache_timeout)

    def report(self, walk: bool) -> dict[str, Any]:
        """The daemon's state for `kvfs ls`/`du`/`top` (through .kvfs/ in the mount)."""
        return {
            "time": time.time(),
            "pid": os.getpid(),
            "backing": os.fsdecode(self.store.root),
            "capacity": self.evictor.capacity,
            "used": self.evictor.used,
            "reserved": self.evictor.reserved,
            "files": self.index.files,
            "bytes": self.index.bytes,
            "evictions": dict(self.evictor.evictions),
            "counters": dict(self.counters),
            "lookups": {
                "hit": sum(c["hit"] for c in self.lookups.values()),
                "miss": sum(c["miss"] for c in self.lookups.values()),
            },
            "checksum_failures": self.checksum_failures,
            "deadline_expiries": self.deadline_expiries,
            "queues": {
                q.value: {"waiting": self.pool.depth(q), "running": self.pool.busy[q]}
                for q in Queue
            },
            "write_buffer": {"used": self.budget.used, "capacity": self.budget.capacity},
            "namespaces": list(namespaces.namespaces(self.index, self.lookups, walk)),
        }

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self._node(inode)
        return True  # permissions are checked by the kernel (default_permissions)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        self._check_name(parent, name)

        async def op() -> Node:
            async with self._ns:
                if self.index.child(parent, name) is not None:
                    raise FUSEError(errno.EEXIST)
                rel = os.path.join(self._attached(parent), name)
                st = await self.io.read(self.store.mkdir, rel, mode, ctx.uid, ctx.gid)
                node = self.index.new_node(name, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid)
                fill_times(node, st)
                node.on_backing = True
                self.index.attach(parent, name, node)
                return node

        node = await self._bounded(op)
        node.lookups += 1
        return self._attrs(node)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self._dir(parent_inode)

        async def op() -> None:
            async with self._ns:
                node = self._child(parent, name)
                if not node.is_dir:
                    raise FUSEError(errno.ENOTDIR)
                if node.children:
                    raise FUSEError(errno.ENOTEMPTY)
                await self.io.read(self.store.rmdir, self._attached(node))
                self.index.detach(node)

        await self._bounded(op)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self._dir(parent_inode)

        async def op() -> None:
            async with self._ns:
                node = self._child(parent, name)
                if node.is_dir:
                    raise FUSEError(errno.EISDIR)
                if node.on_backing:
                    await self._retire(node, self._attached(node), replaced=False)
                    self._chunk_event(node, stored=False)
                self.index.detach(node)

        await self._bounded(op)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise FUSEError(errno.EINVAL)
        old_parent = self._dir(parent_inode_old)
        new_parent = self._dir(parent_inode_new)
        self._check_name(new_parent, name_new)

        async def op() -> None:
            async with self._ns:
                node = self._child(old_parent, name_old)
                target = self.index.child(new_parent, name_new)
                if target is node:
                    return
                if target is not None:
                    if flags & pyfuse3.RENAME_NOREPLACE:
                        raise FUSEError(errno.EEXIST)
                    if node.is_dir and not target.is_dir:
                        raise FUSEError(errno.ENOTDIR)
                    if target.is_dir and not node.is_dir:
                        raise FUSEError(errno.EISDIR)
                    if target.children:
                        raise FUSEError(errno.ENOTEMPTY)
                if node.is_dir and Index.is_ancestor(node, new_parent):
                    raise FUSEError(errno.EINVAL)
                new_rel = os.path.join(self._attached(new_parent), name_new)
                if target is not None and not target.is_dir and target.on_backing:
                    # If the node is not published yet, the old bytes must go all the same:
                    # the name now means the new file.
                    await self._retire(target, new_rel, replaced=node.on_backing)
                if node.on_backing:
                    await self.io.read(self.store.rename, self._attached(node), new_rel)
                    self._chunk_event(node, stored=False)
                if target is not None:
                    if target.on_backing:
                        self._chunk_event(target, stored=False)
                    self.index.detach(target)
                self.index.move(node, new_parent, name_new)
                if node.on_backing:
                    self._chunk_event(node, stored=True)

        await self._bounded(op)

    async def _retire(self, node: Node, rel: bytes, replaced: bool) -> None:
        """Take a published file's bytes out of the visible tree (the caller holds the lock).

        While the kernel may still open the node (it resolved the name before the unlink or
        rename: lookup count) or a handle may still read it, the bytes move to .kvfs/unlinked
        and go when the kernel forgets the node. Otherwise they are removed now, or, when
        ``replaced``, by the rename that puts another file over them.
        """
        if node.lookups or node.open_count:
            await self.io.read(self.store.rename, rel, layout.unlinked_path(node.ino))
            return
        if not replaced:
            await self.io.read(self.store.unlink, rel)
        node.on_backing = False

    def _released(self, node: Node) -> None:
        """The kernel and every handle let go of a node that left the tree: free its bytes."""
        if node.on_backing and not node.is_dir:
            self.io.submit(Queue.WRITE, self.store.discard, layout.unlinked_path(node.ino))

    def _backing_rel(self, node: Node) -> bytes:
        """Where the backing store holds a node's published bytes."""
        if node.attached:
            return self.index.path(node)
        if node.on_backing:
            return layout.unlinked_path(node.ino)
        raise FUSEError(errno.ENOENT)

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)  # a chunk has one name; hard links are not supported

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise FUSEError(errno.EPERM)  # device files, FIFOs and sockets are not supported

    # -- directories ------------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        fh = self._next_fh
        self._next_fh += 1
        if inode == control.DIR_INO:
            self._dirs[fh] = [(name, ino) for name, ino in control.FILES.items()]
            return fh
        node = self._dir(inode)
        assert node.children is not None
        self._dirs[fh] = sorted(node.children.items())  # a snapshot: offsets stay stable
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs[fh]
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            if isinstance(node, int):  # a control file
                if not pyfuse3.readdir_reply(token, name, control.attrs(node, 1), i + 1):
                    break
                continue
            if not node.attached:
                continue
            if not pyfuse3.readdir_reply(token, name, self._attrs(node), i + 1):
                break
            node.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files ------------------------------------------------------------------------------

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dir(parent_inode)
        self._check_name(parent, name)

        async def op() -> tuple[Node, bool]:
            # Under the lock: mkdir/rename/rmdir check a name, await the disk, then change the
            # index, and a create must not slip in between.
            async with self._ns:
                existing = self.index.child(parent, name)
                if existing is not None:
                    if flags & os.O_EXCL:
                        raise FUSEError(errno.EEXIST)
                    return existing, False
                if not parent.attached:
                    raise FUSEError(errno.ENOENT)
                node = self.index.new_node(name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid)
                node.atime_ns = node.mtime_ns = node.ctime_ns = time.time_ns()
                self.index.attach(parent, name, node)
                # Visible at once, published on close: until then the name holds an empty buffer.
                self._writes[node.ino] = WriteState(
                    ChunkBuffer(self.extents), dirty=True, writers=1
                )
                return node, True

        node, created = await self._bounded(
            op, undo=lambda result: self._drop_writer(result[0]) if result[1] else None
        )
        if not created:
            node.lookups += 1
            return await self.open(node.ino, flags, ctx), self._attrs(node)
        fh = self._new_fh(Handle(node, writable=True))
        node.lookups += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), self._attrs(node)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if control.is_control(inode):
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise FUSEError(errno.EROFS)
            fh = self._next_fh
            self._next_fh += 1
            self._control[fh] = control.render(inode, self.report)
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        node = self._node(inode)
        if node.is_dir:
            raise FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            await self._bounded(
                partial(self._open_for_write, node, bool(flags & os.O_TRUNC)),
                undo=lambda _: self._drop_writer(node),
            )
            return pyfuse3.FileInfo(fh=self._new_fh(Handle(node, writable=True)), keep_cache=False)
        handle = Handle(node, writable=False)
        if node.ino not in self._writes and node.on_backing:
            handle.fd = await self._bounded(partial(self._open_backing, node), undo=os.close)
            # A read, for eviction: counted at open, since the kernel's page cache may answer
            # the reads themselves. Persisted so that the order survives a restart.
            self.index.read(node, time.time_ns())
            self.counters["reads"] += 1
            if node.parent is not None:
                self._count_lookup(node.parent, "hit")
            self.io.submit(
                Queue.WRITE,
                self.store.save_recency,
                os.dup(handle.fd),
                node.last_read_ns,
                node.hits,
            )
        # O_DIRECT needs nothing special: the kernel bypasses its cache for that file descriptor
        # and sends READs of up to 1 MiB, each answered in full from the verified buffer.
        return pyfuse3.FileInfo(fh=self._new_fh(handle), keep_cache=True)

    async def _open_backing(self, node: Node) -> int:
        """Open the backing file of a published node (the exact version the index describes)."""
        async with self._ns:  # no rename may move the name between path and open
            return await self.io.read(self.store.open_reader, self._backing_rel(node))

    async def _open_for_write(self, node: Node, truncate: bool) -> None:
        ws = self._writes.get(node.ino)
        if ws is None:
            ws = self._writes[node.ino] = WriteState(ChunkBuffer(self.extents))
            if node.on_backing and node.size and not truncate:
                held = extents_for(node.size) * EXTENT
                try:
                    async with ws.lock:  # writes wait until the current bytes are loaded
                        await self.budget.acquire(held)
                        try:
                            ws.buffer = await self._read_backing(node)
                        except BaseException:
                            self.budget.release(held)
                            raise
                except BaseException:
                    if ws.writers == 0:  # nobody else joined while it loaded
                        self._drop_write_state(node)
                    raise
        ws.writers += 1
        if truncate:
            async with ws.lock:
                self._resize(ws, 0)
                ws.dirty = True

    async def _read_backing(self, node: Node) -> ChunkBuffer:
        fd = await self._open_backing(node)
        try:
            return await self._read_verified(node, fd)
        finally:
            os.close(fd)

    async def _read_verified(self, node: Node, fd: int) -> ChunkBuffer:
        try:
            data = await self.io.read(self.store.read_verified, fd, node.checksum, self.extents)
        except ChecksumMismatch as err:
            await self._quarantine(node, str(err))
            raise
        if node.checksum is None:  # written around the mount: adopt it with this checksum
            node.checksum = data.checksum()
            if node.attached:
                self.io.submit(
                    Queue.WRITE, self.store.store_checksum, self.index.path(node), node.checksum
                )
        return data

    async def _quarantine(self, node: Node, why: str) -> None:
        self.checksum_failures += 1
        async with self._ns:
            if not node.attached:
                return
            rel = self.index.path(node)
            parent = node.parent
            assert parent is not None
            dest = await self.io.read(self.store.quarantine, rel)
            node.on_backing = False
            self._chunk_event(node, stored=False)
            self.index.detach(node)
        log.error(
            "quarantined %s to %s: %s",
            rel.decode(errors="replace"),
            dest.decode(errors="replace"),
            why,
        )
        self.invalidator.entry(parent.ino, node.name, node.ino)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        if fh in self._control:
            return self._control[fh][off : off + size]
        handle = self._handle(fh)
        ws = self._writes.get(handle.node.ino)
        if ws is not None and (handle.writable or handle.fd is None):
            return bytes(ws.buffer.read(off, size))  # a copy: the buffer may still change
        if handle.content is None:
            handle.content = self._detached.start(partial(self._load, handle))
        content = await self._wait(handle.content)
        return content.read(off, size)

    async def _load(self, handle: Handle) -> ChunkBuffer:
        node = handle.node
        if handle.fd is None:  # opened while the file was being written, published since
            if not node.on_backing:
                return ChunkBuffer(self.extents)
            handle.fd = await self._open_backing(node)
        data = await self._read_verified(node, handle.fd)
        self.counters["bytes_read"] += data.size
        return data

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FUSEError(errno.EBADF)
        ws = self._writes[handle.node.ino]
        async with ws.lock:
            await self._reserve(ws, off + len(buf))
            ws.buffer.write(off, buf)
            ws.dirty = True
        handle.node.mtime_ns = handle.node.ctime_ns = time.time_ns()
        return len(buf)

    async def _reserve(self, ws: WriteState, end: int) -> None:
        """Take budget for the extents a write up to ``end`` adds (waiting, never failing)."""
        extra = ws.buffer.extra_extents(end)
        if not extra:
            return
        if self.cfg.io_timeout is None:
            await self.budget.acquire(extra * EXTENT)
            return
        # Writers wait for memory; but if every holder waits for more (the budget is split
        # among many half-written files), nobody could ever go on: past the deadline, EIO.
        with trio.move_on_after(self.cfg.io_timeout):
            await self.budget.acquire(extra * EXTENT)
            return
        self.deadline_expiries += 1
        log.warning("a write waited %.1fs for buffer memory: EIO", self.cfg.io_timeout)
        raise FUSEError(errno.EIO)

    def _resize(self, ws: WriteState, size: int) -> None:
        """Truncate a buffer (budget reserved beforehand if it grows; returned if it shrinks)."""
        before = ws.buffer.capacity
        ws.buffer.truncate(size)
        if ws.buffer.capacity < before:
            self.budget.release(before - ws.buffer.capacity)

    async def flush(self, fh: int) -> None:
        # close() of a written file is where its errors (ENOSPC, EIO) can still reach the writer.
        if fh in self._control:
            return
        handle = self._handle(fh)
        ws = self._writes.get(handle.node.ino)
        if handle.writable and ws is not None and ws.dirty:
            await self._bounded(partial(self._publish, handle.node, durable=False))

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handle(fh)
        ws = self._writes.get(handle.node.ino)
        if ws is not None and ws.dirty:
            await self._bounded(partial(self._publish, handle.node, durable=True))
        elif handle.node.on_backing:
            node = handle.node

            async def op() -> None:
                async with self._ns:
                    rel = self._backing_rel(node)
                await self.io.write(self.store.fsync, rel)

            await self._bounded(op)

    async def release(self, fh: int) -> None:
        if self._control.pop(fh, None) is not None:
            return
        handle = self._handles.pop(fh)
        node = handle.node
        node.open_count -= 1
        if handle.content is not None and not handle.content.done:
            # A load that outlived its READ's deadline still uses the fd: let it finish first.
            self._detached.start(partial(self._close_reader, handle))
        else:
            await self._close_reader(handle)
        ws = self._writes.get(node.ino)
        if handle.writable and ws is not None:
            if ws.writers == 1 and ws.dirty:  # not flushed (or flush failed): last chance
                try:
                    await self._bounded(partial(self._publish, node))
                except FUSEError as err:
                    log.warning("publish of inode %d failed at release: %s", node.ino, err)
            async with ws.lock:  # a publish that outlived its deadline still reads the buffer
                self._drop_writer(node)
        self.index.release_if_unused(node)

    async def _close_reader(self, handle: Handle) -> None:
        if handle.content is not None:
            with contextlib.suppress(Exception):  # a failed load holds nothing
                (await handle.content.wait()).release()
        if handle.fd is not None:
            os.close(handle.fd)
            handle.fd = None

    def _drop_writer(self, node: Node) -> None:
        """One writer less; the last one takes the write state (and its memory) away."""
        ws = self._writes.get(node.ino)
        if ws is not None:
            ws.writers -= 1
            if ws.writers == 0:
                self._drop_write_state(node)

    async def _publish(self, node: Node, durable: bool = False) -> None:
        ws = self._writes[node.ino]
        async with ws.lock:  # writes to this file wait until it is published
            if not ws.dirty:
                return
            held = await self.evictor.reserve(ws.buffer.size)
            try:
                await self._publish_reserved(node, ws, durable)
            finally:  # after set_published: the bytes are counted in one place at all times
                self.evictor.release(held)

    async def _publish_reserved(self, node: Node, ws: WriteState, durable: bool) -> None:
        pub = await self._write_tmp(node, ws.buffer, durable)
        async with self._ns:
            if not node.attached:  # unlinked while open: the bytes have no name to take
                await self.io.read(self.store.discard, pub.tmp)
                ws.dirty = False
                return
            try:
                await self.io.read(self.store.rename, pub.tmp, self.index.path(node))
            except BaseException:
                await self.io.read(self.store.discard, pub.tmp)
                raise
            node.on_backing = True
            node.checksum = pub.checksum
            if not node.hits:  # never read: as recent as its write (what a restart sees)
                node.last_read_ns = node.mtime_ns
            if namespaces.is_namespace_config(node) and node.parent is not None:
                node.parent.meta = namespaces.parse_config(b"".join(ws.buffer.views()))
            self.index.set_published(node, pub.size, pub.blocks)
            ws.dirty = False
            self.counters["publishes"] += 1
            self.counters["bytes_written"] += pub.size
            self._chunk_event(node, stored=True)
        if pub.blocks != math.ceil(pub.size / 512):
            # The kernel may hold the st_blocks we gave while the file was dirty; `du` must see
            # the real ones. (Usually equal for chunk files: then the kernel keeps its cache and
            # the engine's next access() of the chunk costs no round trip.)
            self.invalidator.attributes(node.ino)

    async def _write_tmp(self, node: Node, data: ChunkBuffer, durable: bool) -> Published:
        args = (data, node.mode, node.uid, node.gid, (node.atime_ns, node.mtime_ns), durable)
        try:
            return await self.io.write(self.store.write_tmp, *args)
        except OSError as err:
            # The backing filesystem filled up before the capacity did (other data shares it):
            # make room the same way, once.
            if err.errno != errno.ENOSPC or not await self.evictor.free_up(data.size, "disk full"):
                raise
        return await self.io.write(self.store.write_tmp, *args)

    def _busy(self, node: Node) -> bool:
        """Files that eviction must leave alone: pinned, being written, not on disk yet, or a
        namespace's config.json (tiny, and what names the model in every report)."""
        return (
            node.ino in self._writes
            or not node.on_backing
            or self.index.pinned(node)
            or namespaces.is_namespace_config(node)
        )

    async def _evict(self, node: Node, reason: str) -> bool:
        """Remove a file to make room. Its readers keep their bytes (see _retire)."""
        async with self._ns:
            if not node.attached or self._busy(node):
                return False
            parent = node.parent
            assert parent is not None
            try:
                await self._retire(node, self.index.path(node), replaced=False)
            except FileNotFoundError:  # deleted around the mount: nothing left to delete
                node.on_backing = False
            self._chunk_event(node, stored=False)
            self.index.detach(node)
        log.debug("evicted inode %d (%s)", node.ino, reason)
        self.invalidator.entry(parent.ino, node.name, node.ino)  # access() must tell the truth
        return True

    def _drop_write_state(self, node: Node) -> None:
        ws = self._writes.pop(node.ino)
        self.budget.release(ws.buffer.capacity)
        ws.buffer.release()
        if ws.dirty and not node.on_backing and node.attached:
            # Never published: the name must not outlive the bytes it stood for.
            parent = node.parent
            assert parent is not None
            self.index.detach(node)
            self.invalidator.entry(parent.ino, node.name, node.ino)
        self.invalidator.attributes(node.ino)

    # -- attributes -------------------------------------------------------------------------

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        if fields.update_size:
            if node.is_dir:
                raise FUSEError(errno.EISDIR)
            await self._bounded(partial(self._truncate, node, attr.st_size))
        mode = (node.mode & ~0o7777) | (attr.st_mode & 0o7777) if fields.update_mode else None
        owner = None
        if fields.update_uid or fields.update_gid:
            owner = (
                attr.st_uid if fields.update_uid else node.uid,
                attr.st_gid if fields.update_gid else node.gid,
            )
        times = None
        if fields.update_atime or fields.update_mtime:
            times = (
                attr.st_atime_ns if fields.update_atime else node.atime_ns,
                attr.st_mtime_ns if fields.update_mtime else node.mtime_ns,
            )
        if mode is None and owner is None and times is None:
            return self._attrs(node)

        async def op() -> None:
            async with self._ns:
                if node.on_backing and node.attached:
                    st = await self.io.read(
                        self.store.set_attrs, self.index.path(node), mode, owner, times
                    )
                    node.ctime_ns = st.st_ctime_ns
                else:
                    node.ctime_ns = time.time_ns()
                if mode is not None:
                    node.mode = mode
                if owner is not None:
                    node.uid, node.gid = owner
                if times is not None:
                    node.atime_ns, node.mtime_ns = times

        await self._bounded(op)
        return self._attrs(node)

    async def _truncate(self, node: Node, size: int) -> None:
        ws = self._writes.get(node.ino)
        standalone = ws is None  # truncate(2) by path: no writer will publish it for us
        if standalone:
            await self._open_for_write(node, truncate=size == 0)
            ws = self._writes[node.ino]
        assert ws is not None
        try:
            async with ws.lock:
                await self._reserve(ws, size)
                self._resize(ws, size)
                ws.dirty = True
            node.mtime_ns = node.ctime_ns = time.time_ns()
            if standalone:
                await self._publish(node)
        finally:
            if standalone:
                self._drop_writer(node)

    # -- filesystem -------------------------------------------------------------------------

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The capacity and what is free within it (never more than the disk has left)."""
        st = await self._bounded(partial(self.io.read, self.store.statvfs))
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = ALIGN
        # df's Used is blocks - bfree: kvfs's own usage. Avail is what a writer can still get,
        # which the disk may cap below the capacity (other data on it).
        out.f_blocks = self.evictor.capacity // ALIGN
        out.f_bfree = self.evictor.free // ALIGN
        out.f_bavail = min(self.evictor.free, st.f_bavail * st.f_frsize) // ALIGN
        out.f_files, out.f_ffree, out.f_favail = st.f_files, st.f_ffree, st.f_favail
        out.f_namemax = layout.NAME_MAX
        return out

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        value = self._xattrs(self._node(inode)).get(name)
        if value is None:  # security.* lands here at once: the kernel asks on every first write
            raise FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return list(self._xattrs(self._node(inode)))

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        """``user.kvfs.pin`` = 1 exempts a file, or everything under a directory, from eviction;
        0 undoes it. The flag is kept with the backing file, so it survives a restart."""
        node = self._node(inode)
        if name == b"user.kvfs.evict" and inode == ROOT_INO:
            await self._bounded(partial(self._evict_by_request, value.decode(errors="replace")))
            return
        if name not in (b"user.kvfs.pin", b"user.kvfs.pinned"):
            raise FUSEError(errno.ENOTSUP)
        if value.strip() not in (b"0", b"1"):
            raise FUSEError(errno.EINVAL)
        pinned = value.strip() == b"1"

        async def op() -> None:
            async with self._ns:
                await self.io.read(self.store.save_pinned, self._attached(node), pinned)
                node.pinned = pinned

        await self._bounded(op)

    async def _evict_by_request(self, request: str) -> None:
        """``namespace=NAME`` or ``older-than=SECONDS`` (from `kvfs evict`): evict those files,
        except what may not go (pinned, being written)."""
        key, _, value = request.partition("=")
        if key == "namespace":
            top = self.index.child(self.index.root, value.encode())
            if top is None or not top.is_dir:
                raise FUSEError(errno.ENOENT)
            files = list(self.index.walk_files(top))
        elif key == "older-than":
            try:
                cutoff = time.time_ns() - int(float(value) * 1e9)
            except (ValueError, OverflowError):
                raise FUSEError(errno.EINVAL) from None
            files = [f for f in self.index.walk_files() if f.last_read_ns < cutoff]
        else:
            raise FUSEError(errno.EINVAL)
        for node in files:
            if await self._evict(node, "request"):
                self.evictor.evictions["request"] += 1

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if name in (b"user.kvfs.pin", b"user.kvfs.pinned"):
            await self.setxattr(inode, name, b"0", ctx)
            return
        raise FUSEError(errno.ENOTSUP)

    def _xattrs(self, node: Node) -> dict[bytes, bytes]:
        """Attributes the daemon answers from memory (the kernel never caches xattrs)."""
        values = {b"user.kvfs.pinned": b"1" if node.pinned else b"0"}
        if node.is_dir and node.parent is not None and node.parent.ino == ROOT_INO:
            ns = namespaces.summary(self.index, node)
            values[b"user.kvfs.model"] = str(ns["model"] or ns["namespace"]).encode()
            values[b"user.kvfs.chunks"] = b"%d" % ns["chunks"]
            values[b"user.kvfs.bytes"] = b"%d" % ns["bytes"]
            if ns["tokens"] is not None:
                values[b"user.kvfs.tokens"] = b"%d" % ns["tokens"]
        if not node.is_dir:
            if node.checksum is not None:
                values[b"user.kvfs.checksum"] = node.checksum.encode()
            values[b"user.kvfs.hits"] = b"%d" % node.hits
            if node.last_read_ns:
                stamp = datetime.fromtimestamp(node.last_read_ns / 1e9, UTC)
                values[b"user.kvfs.last_read"] = stamp.isoformat(timespec="milliseconds").encode()
        if node.ino == ROOT_INO:
            report = self.report(walk=False)
            values[b"user.kvfs.backing"] = self.store.root
            for key in ("pid", "capacity", "used", "checksum_failures", "deadline_expiries"):
                values[b"user.kvfs." + key.encode()] = b"%d" % report[key]
            values[b"user.kvfs.evictions"] = b"%d" % sum(report["evictions"].values())
        return values
