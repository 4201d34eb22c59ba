"""The FUSE operations of kvfs.

Files are whole objects. A file open for writing lives in a memory buffer (bounded by
``write_buffer_bytes``, holes taking none; no file may be larger than it). Its close (FLUSH)
checksums the buffer and writes it to the backing store under a temp name, where errors still
reach the writer's close(); its last release renames it to its visible name: the publish. A
file is published once, as a successful close left it: never after a failed write, never by a
writer killed with it open. A file open for reading is read whole from the backing store on its
first READ, verified against the checksum of the version it opened, and served from that
buffer: a reader gets every byte or EIO, never a short count and never bytes that fail their
checksum.

Every backing-store call (closes included) runs on the dual-queue worker pool, inside an
operation task of its own, and no request waits for one longer than ``io_timeout``: past it the
request fails with EIO while the operation completes in the background and keeps the index and
backing store in step. Whatever else a handler raises fails that request with EIO, logged: no
input ends the daemon.

A name the daemon takes away (eviction, quarantine) is dropped from the kernel's cache before
the request that caused it is answered; an open through a name resolved before gets ESTALE,
and the VFS then looks it up afresh and misses.

Errno choices:
  ENOENT        a name that is not in the index (misses are also cached by the kernel)
  ESTALE        an open of a node evicted or quarantined after the kernel resolved its name
  EEXIST        create/mkdir/link/symlink/mknod of an existing name, RENAME_NOREPLACE onto one
  ENAMETOOLONG  a name longer than 255 bytes, a symlink target of PATH_MAX or more
  EFBIG         a file larger than the write buffer (it must fit whole)
  EPERM         the reserved name ``.kvfs`` at the root (the backing directory's private area);
                a hard link to a directory
  EROFS         any change to the read-only control directory ``.kvfs/``
  EINVAL        RENAME_EXCHANGE (not supported), moving a directory into itself, a pin value
                other than 0 or 1
  EIO           a checksum mismatch (the file is quarantined), an expired deadline, a bug
  ENOSPC        a publish that does not fit even after evicting all that may go
  ENOTSUP       xattrs other than user.kvfs.pin (the rest are read-only)
  anything else comes from the backing filesystem (EDQUOT, EROFS...)

Symlinks, hard links, fifos, sockets and device nodes live in the backing directory as on any
filesystem; they are not chunks (no checksum, never evicted). Capacity and eviction live in
mount/eviction.py; this module only decides what may not go (``_busy``) and how a file goes
(``_evict``).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import math
import os
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from kvfs import layout, namespaces, process
from kvfs.buffers import ALIGN, EXTENT, ChunkBuffer, ExtentPool, extents_for
from kvfs.checksum import ChecksumMismatch
from kvfs.config import MountConfig
from kvfs.index import ROOT_INO, Index, Node
from kvfs.io_queues import DualQueuePool, Queue
from kvfs.mount import control
from kvfs.mount.bridge import IO, ByteBudget, Detached, Future, contained
from kvfs.mount.events import MountEvents, block_of
from kvfs.mount.eviction import Evictor
from kvfs.mount.invalidator import Invalidator
from kvfs.mount.metrics import TIMED_OPERATIONS, Metrics
from kvfs.store import BackingStore, Published, fill_times

log = logging.getLogger(__name__)
T = TypeVar("T")

PATH_MAX = 4096  # the longest symlink target Linux takes

# A publish that meets a full backing disk evicts and tries again, this many times at most.
DISK_FULL_RETRIES = 8

# Every request pyfuse3 may hand to the operations.
FUSE_HANDLERS = tuple(
    name
    for name, member in vars(pyfuse3.Operations).items()
    if not name.startswith("_") and inspect.iscoroutinefunction(member)
)


@dataclass(frozen=True)
class Prepared:
    """A file's bytes written to ``.kvfs/tmp`` at close, waiting for the last release."""

    published: Published
    generation: int  # of the buffer these bytes are
    attrs: tuple[int, int, int, tuple[int, int]]  # mode, owner and times they were written with
    held: int  # capacity reserved for them
    durable: bool


@dataclass
class WriteState:
    """The buffer of a file that is open for writing.

    Its extents are taken from the write budget; ``lock`` keeps writes out while it is written
    to the backing store. A file is published in two steps: each close (FLUSH) writes the bytes
    to a temp file, where errors such as ENOSPC still reach the writer's close(); the last
    release renames the temp file into place. So a file is published once, and only as a
    successful close left it: never after a failed write, never by a killed writer.
    """

    buffer: ChunkBuffer
    dirty: bool = False  # differs from the published version
    writers: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)
    generation: int = 0  # bumped by every change of the buffer
    prepared: Prepared | None = None
    failed: int | None = None  # errno of a failed write or close: it is never published
    abandoned: bool = False  # its writer was killed with the file open: never published

    def changed(self) -> None:
        self.dirty = True
        self.generation += 1


@dataclass
class Handle:
    node: Node
    writable: bool
    opener: int = 0  # the process that opened it (a writer killed mid-file is not published)
    fd: int | None = None  # backing file of the version this reader opened
    checksum: str | None = None  # of that version
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
        self._releasing = 0  # last releases of written files under way (user.kvfs.unpublished)
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, list[tuple[bytes, Node | int]]] = {}  # int: a control file
        self._control: dict[int, bytes] = {}  # open control files: their generated content
        self.lookups: defaultdict[int, Counter[str]] = defaultdict(Counter)  # per namespace
        self.counters: Counter[str] = Counter()  # reads, bytes_read, publishes, bytes_written
        self.metrics = Metrics()
        for name in FUSE_HANDLERS:  # pyfuse3 calls the instance's attributes
            handler = contained(name, getattr(self, name))
            if name in TIMED_OPERATIONS:
                handler = self.metrics.timed(name, handler)
            setattr(self, name, handler)
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
                self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_address)
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
            with self._deadline("request waited on the backing store"):
                return await future.wait()
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None

    @contextlib.contextmanager
    def _deadline(self, what: str) -> Iterator[None]:
        """The one deadline of the mount: no request waits longer than ``io_timeout`` on the
        backing store (or on memory, or on the kernel); past it, EIO for that request."""
        with trio.move_on_after(self.cfg.io_timeout) as scope:
            yield
        if scope.cancelled_caught:
            self.deadline_expiries += 1
            log.warning("%s %.1fs: EIO", what, self.cfg.io_timeout)
            raise FUSEError(errno.EIO)

    def _close_later(self, fd: int) -> None:
        """Close a backing fd off the event loop: a close can block on a stalled store."""
        self.io.submit(Queue.READ, os.close, fd)

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
    def _owner(parent: Node, ctx: pyfuse3.RequestContext) -> tuple[int, int]:
        """Who owns a new name: its creator, in the group of a set-group-ID directory."""
        gid = parent.gid if parent.mode & stat.S_ISGID else ctx.gid
        return ctx.uid, gid

    def _masked(self, mode: int) -> int:
        """A new file's or directory's permission bits, less the mount's umask."""
        return mode & 0o7777 & ~self.cfg.file_umask

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
        attr.st_nlink = node.nlink
        attr.st_uid, attr.st_gid = node.uid, node.gid
        attr.st_rdev = node.rdev
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
        mode = stat.S_IFDIR | self._masked(mode) | (parent.mode & stat.S_ISGID)  # as ext4 does

        def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
            return self.store.mkdir(rel, mode, uid, gid)

        return self._attrs(await self._make_node(parent_inode, name, make, ctx))

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
                    await self._retire(node, os.path.join(self._attached(parent), name))
                self.index.unlink(parent, name)

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
                if target is node:  # two names of one file: POSIX says do nothing
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
                old_rel = os.path.join(self._attached(old_parent), name_old)
                new_rel = os.path.join(self._attached(new_parent), name_new)
                if target is not None and not target.is_dir and target.on_backing:
                    # If the node is not published yet, the old bytes must go all the same:
                    # the name now means the new file.
                    await self._retire(target, new_rel, replaced=node.on_backing)
                if node.on_backing:
                    await self.io.read(self.store.rename, old_rel, new_rel)
                    self._chunk_event(node, stored=False)
                if target is not None:
                    self.index.unlink(new_parent, name_new)
                self.index.move(old_parent, name_old, new_parent, name_new)
                if node.on_backing:
                    self._chunk_event(node, stored=True)

        await self._bounded(op)

    async def _retire(self, node: Node, rel: bytes, replaced: bool = False) -> None:
        """Take the name ``rel`` of a published node off the backing store (the caller holds the
        lock and changes the index after).

        A file's last name takes its bytes along; while the kernel may still open the node (it
        resolved the name before the unlink or rename: lookup count) or a handle may still read
        it, the bytes move to .kvfs/unlinked and go when the kernel forgets the node. Otherwise
        they are removed now, or, when ``replaced``, by the rename that puts another file over
        them. Other names (hard links), symlinks and special files just lose the name.
        """
        last = not node.links
        if last and node.is_file:
            self._chunk_event(node, stored=False)
            if node.lookups or node.open_count:
                await self.io.read(self.store.rename, rel, layout.unlinked_path(node.ino))
                return
        if not replaced:
            await self.io.read(self.store.unlink, rel)
        if last:
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
        """A hard link: one more name for a file. A file with several names is never evicted;
        each publish of it puts the new bytes under every name."""
        node = self._node(inode)
        new_parent = self._dir(new_parent_inode)
        self._check_name(new_parent, new_name)
        if node.is_dir:
            raise FUSEError(errno.EPERM)

        async def op() -> None:
            async with self._ns:
                if self.index.child(new_parent, new_name) is not None:
                    raise FUSEError(errno.EEXIST)
                rel = os.path.join(self._attached(new_parent), new_name)
                if node.on_backing:  # else its publish makes every name
                    await self.io.read(self.store.link, self._attached(node), rel)
                self.index.link(node, new_parent, new_name)
                node.ctime_ns = time.time_ns()

        await self._bounded(op)
        node.lookups += 1
        return self._attrs(node)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Symlinks are kept in the backing directory like anything else (the kernel follows
        them, and gives ELOOP); they are not chunks: no checksum, never evicted."""
        if len(target) >= PATH_MAX:
            raise FUSEError(errno.ENAMETOOLONG)

        def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
            return self.store.symlink(target, rel, uid, gid)

        node = await self._make_node(parent_inode, name, make, ctx, target)
        return self._attrs(node)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if not stat.S_ISLNK(node.mode):
            raise FUSEError(errno.EINVAL)
        return node.target

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Fifos, sockets and device nodes (the kernel has checked CAP_MKNOD), and empty
        regular files; in the backing directory, as mknod(2) makes them."""
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFREG):
            raise FUSEError(errno.EINVAL)
        mode = kind | self._masked(mode)

        def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
            return self.store.mknod(rel, mode, rdev, uid, gid)

        node = await self._make_node(parent_inode, name, make, ctx)
        return self._attrs(node)

    async def _make_node(
        self,
        parent_inode: int,
        name: bytes,
        make: Callable[[bytes, int, int], os.stat_result],
        ctx: pyfuse3.RequestContext,
        target: bytes = b"",
    ) -> Node:
        """Create a name on the backing store with ``make(rel, uid, gid)``, then in the index."""
        parent = self._dir(parent_inode)
        self._check_name(parent, name)
        uid, gid = self._owner(parent, ctx)

        async def op() -> Node:
            async with self._ns:
                if self.index.child(parent, name) is not None:
                    raise FUSEError(errno.EEXIST)
                rel = os.path.join(self._attached(parent), name)
                st = await self.io.read(make, rel, uid, gid)
                node = self.index.new_node(name, st.st_mode, uid, gid)
                fill_times(node, st)
                node.on_backing = True
                node.rdev, node.target = st.st_rdev, target
                if node.is_file:  # mknod of a regular file: an empty one, published
                    node.checksum = ChunkBuffer(self.extents).checksum()
                self.index.attach(parent, name, node)
                if not node.is_dir:  # a directory's size is 0 here: du -b counts files only
                    self.index.set_published(node, st.st_size, st.st_blocks)
                return node

        node = await self._bounded(op)
        node.lookups += 1
        return node

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
        mode = self._masked(mode)

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
                node = self.index.new_node(name, stat.S_IFREG | mode, *self._owner(parent, ctx))
                node.atime_ns = node.mtime_ns = node.ctime_ns = time.time_ns()
                self.index.attach(parent, name, node)
                # Visible at once, an empty buffer until it is published at the last release.
                ws = self._writes[node.ino] = WriteState(ChunkBuffer(self.extents), writers=1)
                ws.changed()
                return node, True

        node, created = await self._bounded(
            op, undo=lambda result: self._drop_writer(result[0]) if result[1] else None
        )
        if not created:
            node.lookups += 1
            return await self.open(node.ino, flags, ctx), self._attrs(node)
        handle = Handle(node, writable=True, opener=process.thread_group(ctx.pid))
        node.lookups += 1
        return pyfuse3.FileInfo(fh=self._new_fh(handle), keep_cache=False), self._attrs(node)

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
        if node.ino not in self._writes and not node.on_backing:
            # Evicted or quarantined after the kernel resolved the name: the VFS looks the
            # name up afresh on ESTALE, and finds it gone.
            raise FUSEError(errno.ESTALE)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            await self._bounded(
                partial(self._open_for_write, node, bool(flags & os.O_TRUNC)),
                undo=lambda _: self._drop_writer(node),
            )
            handle = Handle(node, writable=True, opener=process.thread_group(ctx.pid))
            return pyfuse3.FileInfo(fh=self._new_fh(handle), keep_cache=False)
        handle = Handle(node, writable=False)
        if node.ino not in self._writes:
            handle.fd, handle.checksum = await self._bounded(
                partial(self._open_backing, node), undo=lambda opened: self._close_later(opened[0])
            )
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
        return pyfuse3.FileInfo(
            fh=self._new_fh(handle), keep_cache=not node.rewritten, direct_io=node.rewritten
        )

    async def _open_backing(self, node: Node) -> tuple[int, str | None]:
        """Open the backing file of a published node: the exact version the index describes,
        and the checksum of that version."""
        async with self._ns:  # no rename or publish may change the version meanwhile
            fd = await self.io.read(self.store.open_reader, self._backing_rel(node))
            return fd, node.checksum

    async def _open_for_write(self, node: Node, truncate: bool) -> None:
        ws = self._writes.get(node.ino)
        if ws is None:
            ws = self._writes[node.ino] = WriteState(ChunkBuffer(self.extents))
            if node.on_backing and node.size and not truncate:
                held = extents_for(node.size) * EXTENT
                try:
                    async with ws.lock:  # writes wait until the current bytes are loaded
                        self._check_size(node.size)
                        with self._deadline("an open for writing waited for buffer memory"):
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
                ws.changed()

    async def _read_backing(self, node: Node) -> ChunkBuffer:
        fd, expected = await self._open_backing(node)
        try:
            return await self._read_verified(node, fd, expected)
        finally:
            self._close_later(fd)

    async def _read_verified(self, node: Node, fd: int, expected: str | None) -> ChunkBuffer:
        """Read the version behind ``fd`` whole and check it against ``expected``, its checksum
        when it was opened (a newer version may be published since)."""
        try:
            data = await self.io.read(self.store.read_verified, fd, expected, self.extents)
        except ChecksumMismatch as err:
            if node.checksum == expected:  # the version the tree serves is bad
                await self._quarantine(node, str(err))
            raise
        if expected is None and node.checksum is None:  # written around the mount: adopt it
            node.checksum = data.checksum()
            if node.attached:
                self.io.submit(
                    Queue.WRITE, self.store.store_checksum, self.index.path(node), node.checksum
                )
        return data

    async def _quarantine(self, node: Node, why: str) -> None:
        self.checksum_failures += 1
        async with self._ns:
            if not node.attached or not node.on_backing:
                return
            rel, *aliases = self.index.paths(node)
            dest = await self.io.read(self.store.quarantine, rel)
            for alias in aliases:  # every name of it goes
                await self.io.read(self.store.discard, alias)
            for alias_parent, alias_name in list(node.links):
                self.index.unlink(alias_parent, alias_name)
                self.invalidator.entry(alias_parent.ino, alias_name)
            parent = node.parent
            assert parent is not None
            node.on_backing = False
            self._chunk_event(node, stored=False)
            self.index.detach(node)
        log.error(
            "quarantined %s to %s: %s",
            rel.decode(errors="replace"),
            dest.decode(errors="replace"),
            why,
        )
        # Before the reader hears EIO: its next access() must already miss.
        await self.invalidator.entry_now(parent.ino, node.name, node.ino)

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
        if handle.fd is None:  # opened while the file was being written
            if not node.on_backing:  # and it was never published: there are no bytes
                raise FUSEError(errno.EIO)
            handle.fd, handle.checksum = await self._open_backing(node)
        data = await self._read_verified(node, handle.fd, handle.checksum)
        self.counters["bytes_read"] += data.size
        return data

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FUSEError(errno.EBADF)
        ws = self._writes[handle.node.ino]
        if ws.failed is not None:
            raise FUSEError(ws.failed)
        async with ws.lock:
            try:
                await self._reserve(ws, off, off + len(buf))
            except FUSEError as err:
                ws.failed = err.errno  # the file can no longer be what its writer meant
                raise
            ws.buffer.write(off, buf)
            ws.changed()
        handle.node.mtime_ns = handle.node.ctime_ns = time.time_ns()
        return len(buf)

    def _check_size(self, size: int) -> None:
        """A file lives whole in the write buffer while it is written: no larger than it."""
        if size > self.budget.capacity:
            raise FUSEError(errno.EFBIG)

    async def _reserve(self, ws: WriteState, offset: int, end: int) -> None:
        """Take budget for the extents a write of [offset, end) adds (holes take none).

        Writers wait for memory; but if every holder waits for more (the budget is split among
        many half-written files), nobody could ever go on: past the deadline, EIO.
        """
        self._check_size(end)
        extra = ws.buffer.extents_to_add(offset, end)
        if extra:
            with self._deadline("a write waited for buffer memory"):
                await self.budget.acquire(extra * EXTENT)

    def _resize(self, ws: WriteState, size: int) -> None:
        """Truncate a buffer (budget reserved beforehand if it grows; returned if it shrinks)."""
        before = ws.buffer.capacity
        ws.buffer.truncate(size)
        if ws.buffer.capacity < before:
            self.budget.release(before - ws.buffer.capacity)

    async def flush(self, fh: int) -> None:
        """close(): where a written file's errors (ENOSPC, EIO) can still reach the writer.

        The bytes go to a temp file now; the last release publishes them. A close that comes
        from the kernel tearing down a killed writer publishes nothing.
        """
        if fh in self._control:
            return
        handle = self._handle(fh)
        ws = self._writes.get(handle.node.ino)
        if not handle.writable or ws is None:
            return
        if ws.failed is not None:
            raise FUSEError(ws.failed)
        if process.killed_by_signal(handle.opener):
            ws.abandoned = True
            log.warning(
                "inode %d: its writer was killed with it open: not published", handle.node.ino
            )
            return
        if ws.dirty:
            await self._prepare_or_fail(handle.node, ws, durable=False)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handle(fh)
        node = handle.node
        ws = self._writes.get(node.ino)
        if handle.writable and ws is not None and ws.dirty:
            if ws.failed is not None:
                raise FUSEError(ws.failed)
            await self._prepare_or_fail(node, ws, durable=True)
        elif node.on_backing:

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
            self._releasing += 1
            try:
                await self._bounded(partial(self._release_writer, node, ws))
            except FUSEError as err:
                log.warning("publish of inode %d failed at release: %s", node.ino, err)
            finally:
                self._releasing -= 1
        self.index.release_if_unused(node)

    async def _close_reader(self, handle: Handle) -> None:
        if handle.content is not None:
            with contextlib.suppress(Exception):  # a failed load holds nothing
                (await handle.content.wait()).release()
        if handle.fd is not None:
            self._close_later(handle.fd)
            handle.fd = None

    async def _prepare_or_fail(self, node: Node, ws: WriteState, durable: bool) -> None:
        try:
            await self._bounded(partial(self._prepare, node, ws, durable))
        except FUSEError as err:
            ws.failed = err.errno  # the writer was told: these bytes are never published
            raise

    async def _prepare(self, node: Node, ws: WriteState, durable: bool) -> None:
        async with ws.lock:  # writes to this file wait until its bytes are on the store
            await self._prepare_locked(node, ws, durable)

    async def _prepare_locked(self, node: Node, ws: WriteState, durable: bool) -> None:
        """Write the buffer to a temp file, with room reserved for it, unless done already."""
        current = ws.prepared
        if current is not None:
            if current.generation == ws.generation and (current.durable or not durable):
                return
            ws.prepared = None
            self._discard(current)
        held = await self.evictor.reserve(ws.buffer.size)
        attrs = self._file_attrs(node)
        try:
            published = await self._write_tmp(ws.buffer, attrs, durable)
        except BaseException:
            self.evictor.release(held)
            raise
        ws.prepared = Prepared(published, ws.generation, attrs, held, durable)

    def _discard(self, prepared: Prepared) -> None:
        self.evictor.release(prepared.held)
        self.io.submit(Queue.WRITE, self.store.discard, prepared.published.tmp)

    async def _release_writer(self, node: Node, ws: WriteState) -> None:
        """One writer less; the last one publishes what its close left, or nothing."""
        gone: Node | None = None
        async with ws.lock:  # after a prepare that outlived its deadline
            try:
                if ws.writers == 1:
                    await self._publish(node, ws)
            finally:
                gone = self._drop_writer(node)
        if gone is not None:  # unpublished, its name went: the kernel must know before we answer
            await self.invalidator.entry_now(gone.ino, node.name, node.ino)

    async def _publish(self, node: Node, ws: WriteState) -> None:
        """Rename the prepared bytes into place if they are the file as its last close left
        it; otherwise (a write failed, the writer was killed, no close) drop them."""
        prepared, ws.prepared = ws.prepared, None
        if not ws.dirty:
            if prepared is not None:
                self._discard(prepared)
            return
        if ws.failed is not None or ws.abandoned or prepared is None:
            why = "a write failed" if ws.failed is not None else "its writer did not close it"
            log.info("inode %d not published: %s", node.ino, why)
            if prepared is not None:
                self._discard(prepared)
            return
        if prepared.generation != ws.generation:  # changed after its close (shared mmap)
            self._discard(prepared)
            log.info("inode %d not published: changed after its last close", node.ino)
            return
        try:
            rewritten = await self._commit(node, ws, prepared)
        finally:  # after set_published: the bytes are counted in one place at all times
            self.evictor.release(prepared.held)
        if rewritten:
            self.invalidator.inode(node.ino)  # cached pages of the old version must go
        elif prepared.published.blocks != math.ceil(prepared.published.size / 512):
            # The kernel may hold the st_blocks we gave while the file was dirty; `du` must see
            # the real ones. (Usually equal for chunk files: then the kernel keeps its cache and
            # the engine's next access() of the chunk costs no round trip.)
            self.invalidator.attributes(node.ino)

    async def _commit(self, node: Node, ws: WriteState, prepared: Prepared) -> bool:
        """Rename a temp file over the node's name; returns whether it replaced a version."""
        pub = prepared.published
        async with self._ns:
            if not node.attached:  # unlinked while open: the bytes have no name to take
                self.io.submit(Queue.WRITE, self.store.discard, pub.tmp)
                ws.dirty = False
                return False
            rel = self.index.path(node)
            try:
                await self.io.read(self.store.rename, pub.tmp, rel)
            except BaseException:
                self.io.submit(Queue.WRITE, self.store.discard, pub.tmp)
                raise
            mode, uid, gid, times = self._file_attrs(node)
            if (mode, uid, gid, times) != prepared.attrs:  # chmod, chown, touch after close
                await self.io.read(self.store.set_attrs, rel, mode, (uid, gid), times)
            for alias in self.index.paths(node)[1:]:  # hard links: every name, the new bytes
                await self.io.read(self.store.relink, rel, alias)
            rewritten = node.on_backing
            node.on_backing = True
            node.rewritten = node.rewritten or rewritten
            node.checksum = pub.checksum
            if not node.hits:  # never read: as recent as its write (what a restart sees)
                node.last_read_ns = node.mtime_ns
            if namespaces.is_namespace_config(node) and node.parent is not None:
                config = ws.buffer.read(0, namespaces.CONFIG_MAX_BYTES + 1)
                node.parent.meta = namespaces.parse_config(bytes(config))
            self.index.set_published(node, pub.size, pub.blocks)
            ws.dirty = False
            self.counters["publishes"] += 1
            self.counters["bytes_written"] += pub.size
            self._chunk_event(node, stored=True)
            return rewritten

    @staticmethod
    def _file_attrs(node: Node) -> tuple[int, int, int, tuple[int, int]]:
        return node.mode, node.uid, node.gid, (node.atime_ns, node.mtime_ns)

    async def _write_tmp(
        self, data: ChunkBuffer, attrs: tuple[int, int, int, tuple[int, int]], durable: bool
    ) -> Published:
        args = (data, *attrs, durable)
        for _ in range(DISK_FULL_RETRIES):
            try:
                return await self.io.write(self.store.write_tmp, *args)
            except OSError as err:
                # The backing filesystem filled up before the capacity did (other data shares
                # it, or readers still hold evicted files open): make room the same way.
                if err.errno != errno.ENOSPC:
                    raise
                if not await self.evictor.free_up(data.size, "disk full"):
                    raise
        raise FUSEError(errno.ENOSPC)

    def _busy(self, node: Node) -> bool:
        """Files that eviction must leave alone: pinned, being written, not on disk yet, or a
        namespace's config.json (tiny, and what names the model in every report)."""
        return (
            node.ino in self._writes
            or not node.on_backing
            or not node.is_file
            or bool(node.links)  # several names: an operator's deliberate act
            or self.index.pinned(node)
            or namespaces.is_namespace_config(node)
        )

    async def _evict(self, node: Node, reason: str, wait_for_kernel: bool = True) -> bool:
        """Remove a file to make room, now: its space must be free for the publish that asked.

        Readers that opened it keep their own descriptors of its bytes; an open through a name
        the kernel resolved before gets ESTALE, and the VFS then finds the name gone.
        """
        async with self._ns:
            if not node.attached or self._busy(node):
                return False
            parent = node.parent
            assert parent is not None
            with contextlib.suppress(FileNotFoundError):  # deleted around the mount
                await self.io.read(self.store.unlink, self.index.path(node))
            node.on_backing = False
            self._chunk_event(node, stored=False)
            self.index.detach(node)
        log.debug("evicted inode %d (%s)", node.ino, reason)
        if wait_for_kernel:  # access() of the name must miss from now on
            await self.invalidator.entry_now(parent.ino, node.name, node.ino)
        else:
            self.invalidator.entry(parent.ino, node.name, node.ino)
        return True

    def _drop_writer(self, node: Node) -> Node | None:
        """One writer less; the last one takes the write state (and its memory) away. Returns
        the directory a never-published name left, if it did."""
        ws = self._writes.get(node.ino)
        if ws is not None:
            ws.writers -= 1
            if ws.writers == 0:
                return self._drop_write_state(node)
        return None

    def _drop_write_state(self, node: Node) -> Node | None:
        ws = self._writes.pop(node.ino)
        if ws.prepared is not None:
            self._discard(ws.prepared)
            ws.prepared = None
        self.budget.release(ws.buffer.capacity)
        ws.buffer.release()
        self.invalidator.attributes(node.ino)
        if not (ws.dirty and not node.on_backing and node.attached):
            return None
        # Never published: the name must not outlive the bytes it stood for.
        parent = node.parent
        assert parent is not None
        self.index.detach(node)
        self.invalidator.entry(parent.ino, node.name, node.ino)
        return parent

    # -- attributes -------------------------------------------------------------------------

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        if control.is_control(inode):
            raise FUSEError(errno.EROFS)
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
        if ws is not None:
            async with ws.lock:
                if self._writes.get(node.ino) is ws:  # not let go while we waited
                    # Open for writing: the writers' close publishes the new size; if they
                    # all closed already, nobody will after this truncate: it completes the file.
                    self._truncate_buffer(node, ws, size)
                    if ws.prepared is not None:
                        await self._prepare_locked(node, ws, durable=False)
                    return
        # truncate(2) by path with no writer: open it for writing ourselves, and publish.
        if not node.on_backing:
            raise FUSEError(errno.ESTALE)
        await self._open_for_write(node, truncate=size == 0)
        ws = self._writes[node.ino]
        try:
            async with ws.lock:
                self._truncate_buffer(node, ws, size)
                await self._prepare_locked(node, ws, durable=False)
        finally:
            await self._release_writer(node, ws)

    def _truncate_buffer(self, node: Node, ws: WriteState, size: int) -> None:
        if ws.failed is not None:
            raise FUSEError(ws.failed)
        self._check_size(size)  # growing adds a hole: no memory to reserve
        self._resize(ws, size)
        ws.changed()
        node.mtime_ns = node.ctime_ns = time.time_ns()

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
        if control.is_control(inode):
            raise FUSEError(pyfuse3.ENOATTR)  # the control files have no attributes
        value = self._xattrs(self._node(inode)).get(name)
        if value is None:  # security.* lands here at once: the kernel asks on every first write
            raise FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if control.is_control(inode):
            return []
        return list(self._xattrs(self._node(inode)))

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        """``user.kvfs.pin`` = 1 exempts a file, or everything under a directory, from eviction;
        0 undoes it. The flag is kept with the backing file, so it survives a restart."""
        if control.is_control(inode):
            raise FUSEError(errno.EROFS)
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
            if await self._evict(node, "request", wait_for_kernel=False):
                self.evictor.evictions["request"] += 1

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if control.is_control(inode):
            raise FUSEError(errno.EROFS)
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
        if node.is_file:
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
            # Files open for writing or closed but not yet published (their last release).
            values[b"user.kvfs.unpublished"] = b"%d" % (len(self._writes) + self._releasing)
        return values
