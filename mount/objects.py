"""The object layer: every file's whole life on the backing store, whatever FUSE session asks.

A file is an object. Writing one: ``create`` or ``open_write``, then ``write``s into a memory
buffer (bounded by ``write_buffer_bytes``, holes taking none; no file may be larger than it),
``close_write`` at each FLUSH (the buffer goes to a temp file with its checksum, where errors
still reach the writer's close()), and ``release_writer`` at the last release (the temp file is
renamed into place: the publish). A file created ``passthrough`` has no buffer: the kernel
writes its temp file itself, ``close_write`` reserves room for what is there, and the publish
checksums it (the bytes the writer's close() left, unless they changed since). A file is
published once, as a successful close left it: never after a failed write, never by a writer
killed with it open. Reading one: ``open_read`` opens the exact version the index describes,
``load`` reads it whole and verifies it against that version's checksum; a mismatch quarantines
it. A name goes by ``unlink``/``rename`` or, to make room, by ``evict``.

What appears and vanishes is told to one ``Listener`` (KV events, the kernel's caches); errors
are OSErrors with the errno the client should see. No call waits on the backing store, on
memory or on the kernel longer than ``io_timeout``: ``deadline`` is the one construct, and an
operation whose caller gave up completes in the background (``bounded``), so the index never
disagrees with the backing store. The event loop never touches the backing store itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import stat
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, Protocol, TypeVar

import trio

from kvfs import layout, namespaces, process, vllm_layout
from kvfs.buffers import EXTENT, ChunkBuffer, ExtentPool, extents_for
from kvfs.checksum import ChecksumMismatch
from kvfs.config import MountConfig
from kvfs.index import Index, Node, Stamp
from kvfs.io_queues import DualQueuePool, Queue
from kvfs.mount import shared
from kvfs.mount.bridge import (
    IO,
    ByteBudget,
    Detached,
    Future,
    Lock,
    NamespaceLock,
    NeedsIO,
    log_failure,
)
from kvfs.mount.eviction import EvictionReason, Evictor
from kvfs.mount.sealer import Sealer
from kvfs.mount.share import Share
from kvfs.store import BackingStore, Found, Published, Sealed, file_stamp, fill_times, stat_stamp

log = logging.getLogger(__name__)
T = TypeVar("T")

# A publish that meets a full backing disk evicts and tries again, this many times at most.
DISK_FULL_RETRIES = 8
RECENCY_PERSIST_SECONDS = 1.0
# Temp files opened ahead for passthrough creates: a create then waits on no I/O (8 left some of
# 16 threads storing at once to open their own, in a trip made under the directory's lock in
# the kernel). Refilled half at a time, in one trip to the I/O pool. Crash-safe: the next
# mount empties .kvfs/spare.
SPARE_TMPS = 32
# A passthrough file written O_DIRECT smaller than this is checksummed at its publish, not left
# to the sealer: reading it back costs the disk little, and the sealer's later open, read and
# lock cost the event loop more than the publish's read does (4 KiB stores: ~8 % less daemon
# CPU in all, the sealer's work after them down from ~0.4 to ~0.05 ms a store).
CHECKSUM_LATER_MIN = 256 << 10

Attrs = tuple[int, int, int, tuple[int, int]]  # mode, uid, gid, (atime, mtime)


def _undeclared_bytes(digest: str | None, declared: str | None) -> OSError:
    """A file whose bytes differ from the checksum its writer declared: never published."""
    why = f"its bytes ({digest}) differ from the checksum its writer declared ({declared})"
    return OSError(errno.EBADMSG, why)


def fail(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class DeadlineExpired(OSError):
    """EIO for a request that waited past ``io_timeout`` (see ``Objects.deadline``)."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, os.strerror(errno.EIO))


class PublishFailure(StrEnum):
    """Why a file its writer closed was not published: the ``reason`` label of
    kvfs_publish_failures_total (snake_case)."""

    NO_SPACE = "no_space"  # ENOSPC: nothing could be evicted for it, or the disk stayed full
    TOO_LARGE = "too_large"  # EFBIG: larger than the write buffer
    TIMEOUT = "timeout"  # waited past --io-timeout, on the backing store or for buffer memory
    IO_ERROR = "io_error"  # the backing store failed otherwise (EIO, EROFS, ...)
    CHECKSUM = "checksum"  # EBADMSG: the bytes differ from the checksum their writer declared

    @classmethod
    def of(cls, err: OSError) -> PublishFailure:
        if isinstance(err, DeadlineExpired) or err.errno == errno.ETIMEDOUT:
            return cls.TIMEOUT
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return cls.NO_SPACE
        if err.errno == errno.EFBIG:
            return cls.TOO_LARGE
        if err.errno == errno.EBADMSG:
            return cls.CHECKSUM
        return cls.IO_ERROR


@dataclass
class ObjectCounters:
    """What the object layer did since the mount (the daemon's report and /metrics show it)."""

    reads: int = 0  # published files opened for reading
    cached_opens: int = 0  # of those, backing files opened in the loop (``open_read_now``)
    changed_around: int = 0  # verified files found changed at a passthrough open: checked again
    bytes_read: int = 0  # read from the backing store and verified
    publishes: int = 0  # files published (written whole)
    bytes_written: int = 0  # bytes published
    publish_failures: Counter[PublishFailure] = field(default_factory=Counter)  # files
    quarantined: int = 0  # files that failed their checksum, moved to .kvfs/quarantine
    quarantined_bytes: int = 0
    checksums_declared: int = 0  # files published with the checksum their writer declared
    # store temp files whose rename did not come within --rename-wait (published under their
    # temp names: an engine that died between close and rename, or a wait set too short)
    renames_missed: int = 0
    # --shared: names another host published that a lookup found on the backing directory;
    # files another host removed that this index still had; publishes that found another
    # host's file with other bytes under their name (that file kept, ours dropped).
    fell_through: int = 0
    gone_elsewhere: int = 0
    publish_conflicts: int = 0

    def report(self) -> dict[str, Any]:
        """As the daemon's report (JSON) shows them: every failure reason, 0 or not."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["publish_failures"] = {r.value: self.publish_failures[r] for r in PublishFailure}
        return values


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class Listener(Protocol):
    """Who hears what the object layer did; called on the event loop."""

    def stored(self, node: Node) -> None:
        """A file was published under its name (or moved to a new one)."""

    def removed(self, node: Node) -> None:
        """A published file left its name and its bytes go (unlinked, evicted, quarantined)."""

    def moved_away(self, node: Node) -> None:
        """A published file is about to take another name (``stored`` follows): same bytes."""

    def name_gone(self, parent: Node, name: bytes, node: Node) -> None:
        """The daemon took a name away behind the kernel's back: drop it from its cache."""

    async def name_gone_now(self, parent: Node, name: bytes, node: Node) -> None:
        """``name_gone``, returning once the kernel has dropped it."""

    def attributes_changed(self, node: Node) -> None:
        """Size, blocks or times changed behind the kernel's back."""

    def content_changed(self, node: Node) -> None:
        """A new version replaced the bytes in place: cached pages must go."""

    def released(self, node: Node) -> None:
        """The kernel and every handle let go of a node that left the tree."""


@dataclass(frozen=True)
class Prepared:
    """A file's bytes written to ``.kvfs/tmp`` at close, waiting for the last release."""

    published: Published | None  # None: a passthrough file, checksummed at its publish
    version: Any  # of the file these bytes are (``Objects._version``)
    attrs: Attrs  # mode, owner and times they were written with
    held: int  # capacity reserved for them
    durable: bool
    declared: str | None = None  # the checksum its writer declared for these bytes


@dataclass(frozen=True)
class TmpFile:
    """The temp backing file the kernel writes a passthrough file into (``fd`` read-write)."""

    rel: bytes
    fd: int


@dataclass
class WriteState:
    """The buffer of a file that is open for writing; ``lock`` keeps writes out while it is
    written to the backing store. A passthrough file has an empty buffer and its ``file``."""

    buffer: ChunkBuffer
    file: TmpFile | None = None
    dirty: bool = False  # differs from the published version
    writers: int = 0
    lock: Lock = field(default_factory=Lock)
    generation: int = 0  # bumped by every change of the buffer
    prepared: Prepared | None = None
    failed: int | None = None  # errno of a failed write or close: it is never published
    abandoned: bool = False  # its writer was killed with the file open: never published
    direct: bool = False  # a passthrough writer opened it O_DIRECT: its bytes skip the page cache
    # A passthrough file's size and mtime as its rename published it, its writer's descriptor
    # still open: a write after that (through a dup of it) changed it behind its checksum.
    published_as: tuple[int, int] | None = None
    renaming: int = 0  # renames that gave the closed file its final name, its publish to come
    publishing: Future[None] | None = None  # the publish its last rename began in the background
    committing: bool = False  # its publish is putting it under its name: renames wait
    declared: str | None = None  # its writer's checksum for the bytes its next close leaves

    def changed(self) -> None:
        self.dirty = True
        self.generation += 1


@dataclass
class Reader:
    """One opened version of a published file; or, ``unpublished``, the temp file of one
    being written in passthrough (the inode its publish renames: it reads on after that)."""

    fd: int
    checksum: str | None
    unpublished: bool = False


def _stamped(read: Callable[..., T], fd: int, *args: Any) -> tuple[Stamp, T]:
    """On the pool: the ``file_stamp`` of an open file, then ``read(fd, *args)``: what a
    passthrough open will compare, taken before the read checks the bytes (on a network store
    a stat is a trip to the server: never in the loop)."""
    return file_stamp(fd), read(fd, *args)


class Objects:
    def __init__(
        self,
        cfg: MountConfig,
        store: BackingStore,
        index: Index,
        capacity: int,
        listener: Listener,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.index = index
        self.listener = listener
        self.evictor = Evictor(index, capacity, self.busy, self.evict)
        self.pool = DualQueuePool(cfg.read_threads, cfg.write_threads)
        self.budget = ByteBudget(cfg.write_buffer_bytes)  # extents held by write buffers
        self.extents = ExtentPool(keep_bytes=cfg.write_buffer_bytes)
        self.writes: dict[int, WriteState] = {}
        self.releasing = 0  # last releases of written files under way
        # Last releases waiting for their file's rename (``release_after_rename``), by inode,
        # in the order they began: the time the wait ends, the file, its write state.
        self._rename_waits: dict[int, tuple[float, Node, WriteState]] = {}
        self.counters = ObjectCounters()
        self.deadline_expiries = 0
        self.checksum_failures = 0
        self._recency_dirty: dict[int, Node] = {}  # read since their recency was persisted
        self._spare_tmps: list[TmpFile] = []
        self._to_close: deque[int] = deque()  # backing fds for the pool to close (close_later)
        self.adopted: set[int] = set()  # --shared: files a lookup found (another host's)
        # Checksums of files written past the page cache, taken after their publish where
        # chunks are trusted once checked (first-read); not on a share, whose hosts compare
        # checksums as they publish.
        later = cfg.verify == "first-read" and store.host is None
        backlog = cfg.checksum_backlog_bytes if later else 0
        self.sealer = Sealer(backlog, self.recheck)
        index.on_release = self._released
        # --shared: one capacity and eviction order for the share, from the hosts' journals
        # (reads them all now, at mount); None on a backing directory of our own: no cost.
        self.share: Share | None = None
        if store.host is not None:
            self.share = Share(self, cfg.lease_ttl)
            self.evictor.shared = self.share
        # Created in start(), once trio is running.
        self._ns: NamespaceLock
        self.io: IO
        self._detached: Detached
        self._rename_waits_begun: trio.Event  # set as the first of them begins

    def start(self, nursery: trio.Nursery) -> None:
        """Begin serving in ``nursery`` (the eviction sweep, the recency writer and detached
        operations run there)."""
        # Held across a namespace change (index and backing together); shared by publishes.
        self._ns = NamespaceLock()
        self.io = IO(self.pool)
        self._detached = Detached(nursery)
        if self.share is None:
            nursery.start_soon(self.evictor.sweep_forever)
        else:  # the share's sweep (as the lease holder), journals and lease
            self.share.start(nursery)
        nursery.start_soon(self.persist_recency_forever)
        nursery.start_soon(self.sealer.run_forever)
        self._spare_wanted = trio.Event()
        nursery.start_soon(self.keep_spare_tmps_forever)
        self._rename_waits_begun = trio.Event()
        nursery.start_soon(self.expire_rename_waits_forever)

    def shutdown(self) -> None:
        """Make the directories only the index has, persist the last reads' recency, drop the
        spare temp files, finish the queued I/O and stop its threads (the loop may be gone:
        nothing is delivered to it)."""
        unmade = self._unmade_dirs()
        if unmade:
            dirs = self._dirs_to_make(unmade)
            self.pool.submit(Queue.WRITE, partial(self.store.make_dirs, dirs), log_failure)
        for spare in self._spare_tmps:
            os.close(spare.fd)
            self.pool.submit(Queue.WRITE, partial(self.store.discard, spare.rel), log_failure)
        self._spare_tmps.clear()
        if self._recency_dirty:
            reads = self._recency()
            self.pool.submit(Queue.WRITE, partial(self.store.save_recency, reads), log_failure)
            if self.share is not None:
                self.share.reads(reads)
        if self.share is not None:
            self.share.shutdown()
        self.pool.shutdown()

    async def persist_recency_forever(self) -> None:
        """Reads change recency (last read, hits) in memory at once; the backing files' xattrs
        follow once a second, in one job: one setxattr per open on the open's path cost a
        third of a hot reopen. A kill -9 loses at most that second of recency (a hint for the
        eviction order, never bytes)."""
        while True:
            await trio.sleep(RECENCY_PERSIST_SECONDS)
            if self._recency_dirty:
                reads = self._recency()
                self.io.post(Queue.WRITE, self.store.save_recency, reads)
                if self.share is not None:  # the share's global recency
                    self.share.reads(reads)

    async def keep_spare_tmps_forever(self) -> None:
        """Keep up to SPARE_TMPS temp files open for the next passthrough creates, from the
        first one on (a session that serves writes needs none). A store that fails (a full or
        stalled disk) leaves the creates to open their own."""
        while True:
            await self._spare_wanted.wait()
            self._spare_wanted = trio.Event()
            missing = SPARE_TMPS - len(self._spare_tmps)
            try:
                opened = partial(self.io.write, self.store.open_spares, missing)
                spares = await self.bounded(opened, undo=self._drop_spares)
            except OSError as err:
                log.debug("no spare temp files: %s", err)
                continue
            self._spare_tmps.extend(TmpFile(*spare) for spare in spares)

    def _drop_spares(self, opened: list[tuple[bytes, int]]) -> None:
        for rel, fd in opened:
            os.close(fd)
            self.io.post(Queue.WRITE, self.store.discard, rel)

    async def _new_tmp(self, mode: int) -> TmpFile:
        if self._spare_tmps:
            return self._spare_tmp()
        self._spare_wanted.set()
        return TmpFile(*await self.io.read(self.store.open_tmp, mode))

    def _spare_tmp(self) -> TmpFile:
        """A spare temp file (its mode is set at the publish, with the rest); more are opened
        once half are taken."""
        if len(self._spare_tmps) <= SPARE_TMPS // 2:
            self._spare_wanted.set()
        return self._spare_tmps.pop()

    def _recency(self) -> list[tuple[bytes, int, int]]:
        dirty, self._recency_dirty = self._recency_dirty, {}
        return [
            (self._backing_rel(node), node.last_read_ns, node.hits)
            for node in dirty.values()
            if node.on_backing
        ]

    @property
    def unpublished(self) -> int:
        """Files open for writing, or closed and not yet published (their last release)."""
        return len(self.writes) + self.releasing

    # -- deadlines ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def deadline(self, what: str) -> Iterator[None]:
        """The one deadline of the mount: nothing waits longer than ``io_timeout`` on the
        backing store, on memory or on the kernel; past it, EIO for that request."""
        with trio.move_on_after(self.cfg.io_timeout) as scope:
            yield
        if scope.cancelled_caught:
            self.deadline_expiries += 1
            log.warning("%s %.1fs: EIO", what, self.cfg.io_timeout)
            raise DeadlineExpired()

    async def bounded(
        self, fn: Callable[[], Awaitable[T]], undo: Callable[[T], object] | None = None
    ) -> T:
        """Run an operation to completion in its own task; wait for it within the deadline.

        ``undo`` releases what the operation acquired if it completes after its caller gave up
        (an fd, a writer count): nobody will use it then.
        """
        future = self._detached.start(fn)
        try:
            return await self.wait(future)
        except OSError:
            if undo is not None and not future.done:
                self._detached.start(partial(self._undo_late, future, undo))
            raise

    async def wait(self, future: Future[T]) -> T:
        with self.deadline("a request waited on the backing store"):
            return await future.wait()

    def start_detached(self, fn: Callable[[], Awaitable[T]]) -> Future[T]:
        return self._detached.start(fn)

    @staticmethod
    async def _undo_late(future: Future[T], undo: Callable[[T], object]) -> None:
        with contextlib.suppress(Exception):  # it failed after all: nothing to undo
            undo(await future.wait())

    def close_later(self, fd: int) -> None:
        """Close a backing fd off the event loop: a close can block on a stalled store. The fds
        given before the pool gets to them are closed in the same trip."""
        self._to_close.append(fd)
        if len(self._to_close) == 1:
            self.io.post(Queue.READ, self._close_pending)

    def _close_pending(self) -> None:
        """On the pool: close what close_later gave, until none is left."""
        while self._to_close:
            with contextlib.suppress(OSError):
                os.close(self._to_close.popleft())

    # -- names ------------------------------------------------------------------------------

    def _ns_shared(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The namespace lock for a change that takes no name another holder may have checked
        (a publish under the file's own name, a change made in memory at once): shared; alone
        on a shared backing directory, where the share's journal and the other hosts' files
        take one change at a time."""
        return self._ns.shared() if self.share is None else self._ns

    def _attached(self, node: Node) -> bytes:
        """The node's relative path; ENOENT if it left the tree meanwhile."""
        if not node.attached:
            raise fail(errno.ENOENT)
        return self.index.path(node)

    def _child(self, parent: Node, name: bytes) -> Node:
        node = self.index.child(parent, name)
        if node is None:
            raise fail(errno.ENOENT)
        return node

    async def make_node(
        self,
        parent: Node,
        name: bytes,
        make: Callable[[bytes, int, int], os.stat_result],
        owner: tuple[int, int],
        target: bytes = b"",
    ) -> Node:
        """Create a name on the backing store with ``make(rel, uid, gid)``, then in the index:
        a directory, symlink, fifo, socket, device node or empty regular file."""

        async def op() -> Node:
            async with self._ns:
                if self.index.child(parent, name) is not None:
                    raise fail(errno.EEXIST)
                rel = os.path.join(self._attached(parent), name)
                await self._make_dirs(parent)
                st = await self.io.read(make, rel, *owner)
                node = self.index.new_node(name, st.st_mode, *owner)
                fill_times(node, st)
                node.on_backing = True
                node.rdev, node.target = st.st_rdev, target
                if node.is_file:  # mknod of a regular file: an empty one, published
                    node.checksum = ChunkBuffer(self.extents).checksum()
                self.index.attach(parent, name, node)
                if not node.is_dir:  # a directory's size is 0 here: du -b counts files only
                    self.index.set_published(node, st.st_size, st.st_blocks)
                if node.is_file and self.share is not None:
                    self.share.published(rel, st.st_size)
                return node

        return await self.bounded(op)

    async def mkdir(self, parent: Node, name: bytes, mode: int, owner: tuple[int, int]) -> Node:
        """A new directory: in the index only (``_dir_in_index``); on a shared backing
        directory, where other hosts look, on the backing store at once."""
        if self.share is not None:

            def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
                return self.store.mkdir(rel, mode, uid, gid)

            return await self.make_node(parent, name, make, owner)

        async def op() -> Node:
            async with self._ns_shared():  # made at once: no change of names under way
                return self._dir_in_index(parent, name, mode, owner)

        return await self.bounded(op)

    def mkdir_now(self, parent: Node, name: bytes, mode: int, owner: tuple[int, int]) -> Node:
        """``mkdir`` from memory; NeedsIO while the namespace lock is held (a rename or rmdir
        may be between its check of a name and its change) and on a shared mount."""
        if self._ns.locked() or self.share is not None:
            raise NeedsIO()
        return self._dir_in_index(parent, name, mode, owner)

    def _dir_in_index(self, parent: Node, name: bytes, mode: int, owner: tuple[int, int]) -> Node:
        """A directory in the index only. The backing store gets it, with the mode and owner
        the node has by then, when something is first put beneath it (``_make_dirs``): an
        engine's mkdir -p before each store costs no trip to the disk (vLLM puts every chunk two
        new hash directories deep), and a crash loses only directories with nothing published
        in them."""
        if self.index.child(parent, name) is not None:
            raise fail(errno.EEXIST)
        self._attached(parent)
        node = self.index.new_node(name, mode, *owner)
        node.atime_ns = node.mtime_ns = node.ctime_ns = time.time_ns()
        self.index.attach(parent, name, node)
        return node

    async def _make_dirs(self, directory: Node) -> None:
        """Make the directory and those above it that only the index has, in one trip; the
        caller holds the namespace lock."""
        unmade = self._unmade(directory)
        if unmade:
            await self.io.read(self.store.make_dirs, self._dirs_to_make(unmade))
            self._made(unmade)

    def _unmade(self, directory: Node) -> list[Node]:
        """The directory and those above it that only the index has (``_dir_in_index``), top
        down."""
        unmade = []
        while not directory.on_backing and directory.parent is not None:
            unmade.append(directory)
            directory = directory.parent
        unmade.reverse()
        return unmade

    def _unmade_dirs(self) -> list[Node]:
        """Every directory in the tree that only the index has, each after its parent."""
        unmade, stack = [], [self.index.root]
        while stack:
            directory = stack.pop()
            if not directory.subdirs:  # (a chunk directory's files are not looked at)
                continue
            assert directory.children is not None
            for child in directory.children.values():
                if child.is_dir:
                    stack.append(child)
                    if not child.on_backing:
                        unmade.append(child)
        return unmade

    def _dirs_to_make(self, unmade: list[Node]) -> list[tuple[bytes, int, int, int]]:
        return [(self.index.path(d), d.mode, d.uid, d.gid) for d in unmade]

    @staticmethod
    def _made(unmade: list[Node]) -> None:
        for directory in unmade:
            directory.on_backing = True

    async def rmdir(self, parent: Node, name: bytes) -> None:
        async def op() -> None:
            async with self._ns:
                node = self._child(parent, name)
                if not node.is_dir:
                    raise fail(errno.ENOTDIR)
                if node.children:
                    raise fail(errno.ENOTEMPTY)
                rel = self._attached(node)
                if node.on_backing:  # else only the index has it
                    await self.io.read(self.store.rmdir, rel)
                self.index.detach(node)

        await self.bounded(op)

    async def unlink(self, parent: Node, name: bytes) -> None:
        async def op() -> None:
            async with self._ns_shared():  # a name only the index has goes at once
                if self._unlinked_in_memory(parent, name):
                    return
            async with self._ns:
                node = self._child(parent, name)
                if node.is_dir:
                    raise fail(errno.EISDIR)
                if node.on_backing:
                    await self._retire(node, os.path.join(self._attached(parent), name))
                self.index.unlink(parent, name)

        await self.bounded(op)

    def _unlinked_in_memory(self, parent: Node, name: bytes) -> bool:
        """Unlink a file that is not on the backing store (not published yet, its publish not
        under way) from the index alone; False for any other."""
        node = self._child(parent, name)
        if node.is_dir:
            raise fail(errno.EISDIR)
        if node.on_backing or self._committing(node):
            return False
        self.index.unlink(parent, name)
        self._end_rename_wait(node)
        return True

    async def rename(
        self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, noreplace: bool
    ) -> None:
        async def op() -> None:
            # The engine's store: its closed temp file, renamed to the chunk's name, in memory
            # where it can (waiting for changes of names only); published in the background.
            moved = None
            async with self._ns_shared():
                with contextlib.suppress(NeedsIO):
                    moved = self._moved_in_memory(
                        old_parent, old_name, new_parent, new_name, noreplace
                    )
            if moved is not None:
                node, closed = moved
                if closed is not None:
                    self._publish_renamed(node, closed)
                return
            async with self._ns:
                node, target = self._renaming(old_parent, old_name, new_parent, new_name, noreplace)
                if target is node:  # two names of one file: POSIX says do nothing
                    return
                old_rel = os.path.join(self._attached(old_parent), old_name)
                new_rel = os.path.join(self._attached(new_parent), new_name)
                if node.is_dir and target is not None and target.on_backing:
                    await self._make_dirs(node)  # to take the place of the empty one there
                if node.on_backing:
                    await self._make_dirs(new_parent)
                moving = self._published_below(node) if self.share is not None else []
                # Shared: an engine's temp renamed to a final name publishes it, and must not
                # replace a file another host published there (unless it is the same bytes).
                placing = (
                    self.store.host is not None
                    and node.on_backing
                    and node.is_file
                    and not node.links
                    and (target is None or self._theirs(target, node))
                )
                if target is not None and not target.is_dir and target.on_backing:
                    if placing:  # its file stays, under the node that takes its name
                        target.on_backing = False
                    else:
                        # If the node is not published yet, the old bytes must go all the
                        # same: the name now means the new file.
                        await self._retire(target, new_rel, replaced=node.on_backing)
                found = None
                if placing:
                    found = await self.io.read(self.store.link_new, old_rel, new_rel)
                    self.listener.moved_away(node)
                elif node.on_backing:
                    await self.io.read(self.store.rename, old_rel, new_rel)
                    self.listener.moved_away(node)
                if target is not None:
                    self.index.unlink(new_parent, new_name)
                self.index.move(old_parent, old_name, new_parent, new_name)
                if self.share is not None:
                    self._journal_moves(moving, found is not None)
                if found is not None:
                    if self._lost_race(node, node.checksum or "", found):
                        self.listener.content_changed(node)
                elif node.on_backing:
                    self.listener.stored(node)
                # Closed and not published: over another file, or its last release is
                # publishing it (RELEASE came first), which places it under this name.
                closed = self._being_published(node) or self._closed_write(node)
                if closed is not None:
                    closed.renaming += 1
            if closed is not None:  # over a name, or of a published file: once it is in place
                await self._publish_closed(node, closed)

        await self.bounded(op)

    def _publish_renamed(self, node: Node, closed: WriteState) -> None:
        """Publish a closed file under the name its rename just gave it, in the background:
        the rename is answered at once (a reader that opens it meanwhile waits for this
        publish, ``await_renamed_publish``). A daemon killed before the publish ends, one pool
        trip later, drops the chunk (a cache miss, as for a file whose release it had not
        published yet); never part of it."""

        async def publish() -> None:
            try:
                await self._publish_closed(node, closed)
            except OSError:
                pass  # counted and logged where it failed; the name goes with the write state
            except Exception:
                log.exception("publish of %s after its rename failed", self._name(node))

        closed.publishing = self.start_detached(publish)

    async def _publish_closed(self, node: Node, closed: WriteState) -> None:
        """Publish a closed file under the name its rename gave it, unless its RELEASE did
        (then it fails if that publish failed). The rename counted itself in
        ``closed.renaming`` as it gave the name (the name is final: the publish seals the file
        in the trip that places it); a last release waiting for the rename
        (``release_after_rename``) ends with it, with nothing left to publish."""
        try:
            async with closed.lock:
                if self._closed_write(node) is closed:
                    await self._publish(node, closed)
                    if closed.file is not None and node.on_backing:
                        closed.published_as = self._version(closed)[:2]
                else:
                    self._check_not_lost(node, closed)
        finally:
            closed.renaming -= 1
            self._end_rename_wait(node)

    def _check_not_lost(self, node: Node, ws: WriteState) -> None:
        """After a rename waited for a publish of ``ws`` that its RELEASE made: the rename
        fails if that publish did (or the release dropped the file unpublished)."""
        if not node.on_backing and (ws.failed is not None or self.writes.get(node.ino) is not ws):
            raise fail(ws.failed or errno.EIO)

    def rename_now(
        self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, noreplace: bool
    ) -> None:
        """``rename`` from memory of a file not published yet to a free name: only the index
        changes. A file written since its last close is done (its last release publishes it
        under the new name); a closed one, or one its release is publishing, is published
        under it in the background (``_publish_renamed``). NeedsIO for any other rename, and
        while a change of names or the file's own publish holds the namespace lock."""
        if self._ns.locked() or self.share is not None:
            raise NeedsIO()
        node, closed = self._moved_in_memory(old_parent, old_name, new_parent, new_name, noreplace)
        if closed is not None:
            self._publish_renamed(node, closed)

    def _moved_in_memory(
        self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, noreplace: bool
    ) -> tuple[Node, WriteState | None]:
        """Rename a file not published yet to a free name in the index only: the file, and
        the closed write state the rename is to publish (None: its last release publishes it
        under the new name). NeedsIO for any other rename, and while the file's own publish
        puts it under its old name."""
        node, target = self._renaming(old_parent, old_name, new_parent, new_name, noreplace)
        if not self._renames_in_memory(node, target, new_parent):
            raise NeedsIO()
        closed = self._being_published(node) or self._closed_write(node)
        if closed is not None and closed.committing:  # its path is on its way to the disk
            raise NeedsIO()
        self.index.move(old_parent, old_name, new_parent, new_name)
        if closed is not None:
            closed.renaming += 1  # before its RELEASE's publish begins, as a rule: sealed as placed
        return node, closed

    def _renames_in_memory(self, node: Node, target: Node | None, new_parent: Node) -> bool:
        """Whether a rename of ``node`` changes only the index: a file not on the backing store
        to a free name (its publish places it under the new one)."""
        if target is not None or node.is_dir or node.on_backing:
            return False
        if not (node.attached and new_parent.attached):
            raise fail(errno.ENOENT)
        return True

    def _being_published(self, node: Node) -> WriteState | None:
        """The write state of a file not published yet whose lock is held: its last release
        may be publishing it (its FLUSH's bytes taken, the seal under way) under the name the
        index gives it when it places it."""
        ws = self.writes.get(node.ino)
        return ws if ws is not None and not node.on_backing and ws.lock.locked() else None

    def _committing(self, node: Node) -> bool:
        """Whether a publish is putting the file's new bytes under its name now."""
        ws = self.writes.get(node.ino)
        return ws is not None and ws.committing

    def _closed_write(self, node: Node) -> WriteState | None:
        """The write state of a file whose writer closed it (FLUSH) and wrote nothing since,
        not published yet: the engine's store, between its close() and its rename."""
        ws = self.writes.get(node.ino)
        if ws is None or not ws.dirty or ws.failed is not None or ws.abandoned:
            return None
        prepared = ws.prepared
        return ws if prepared is not None and prepared.version == self._version(ws) else None

    def _renaming(
        self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, noreplace: bool
    ) -> tuple[Node, Node | None]:
        """The node a rename moves and the one it replaces, if the rename may be made."""
        node = self._child(old_parent, old_name)
        target = self.index.child(new_parent, new_name)
        if target is not None and target is not node:
            if noreplace:
                raise fail(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise fail(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise fail(errno.EISDIR)
            if target.children:
                raise fail(errno.ENOTEMPTY)
        if node.is_dir and Index.is_ancestor(node, new_parent):
            raise fail(errno.EINVAL)
        return node, target

    def _published_below(self, node: Node) -> list[tuple[bytes, Node]]:
        """The published files a rename of ``node`` moves, with their paths before it."""
        files = self.index.walk_files(node) if node.is_dir else iter([node])
        return [
            (self.index.path(f), f) for f in files if f.is_file and f.on_backing and not f.links
        ]

    def _journal_moves(self, moving: list[tuple[bytes, Node]], lost: bool) -> None:
        """Tell the share a rename moved these files (``lost``: the one file moved did not
        take its new name: another host's file holds it)."""
        assert self.share is not None
        for old, node in moving:
            if lost or not node.attached:
                self.share.removed(old)
            else:
                self.share.moved([(old, self.index.path(node), node)])

    async def link(self, node: Node, parent: Node, name: bytes) -> None:
        """A hard link: one more name for a file. A file with several names is never evicted;
        each publish of it puts the new bytes under every name."""

        async def op() -> None:
            async with self._ns:
                if self.index.child(parent, name) is not None:
                    raise fail(errno.EEXIST)
                rel = os.path.join(self._attached(parent), name)
                if node.on_backing:  # else its publish makes every name
                    await self._make_dirs(parent)
                    await self.io.read(self.store.link, self._attached(node), rel)
                self.index.link(node, parent, name)
                node.ctime_ns = time.time_ns()

        await self.bounded(op)

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
            self.listener.removed(node)
            if self.share is not None:
                self.share.removed(rel)
            if node.lookups or node.open_count:
                await self.io.read(self.store.rename, rel, self.store.unlinked_path(node.ino))
                return
        if not replaced:
            await self.io.read(self.store.unlink, rel)
        if last:
            node.on_backing = False

    def _released(self, node: Node) -> None:
        """The kernel and every handle let go of a node that left the tree: free its bytes."""
        self.listener.released(node)
        self.adopted.discard(node.ino)
        if node.on_backing and not node.is_dir:
            self.io.post(Queue.WRITE, self.store.discard, self.store.unlinked_path(node.ino))

    def _backing_rel(self, node: Node) -> bytes:
        """Where the backing store holds a node's published bytes."""
        if node.attached:
            return self.index.path(node)
        if node.on_backing:
            return self.store.unlinked_path(node.ino)
        raise fail(errno.ENOENT)

    async def set_attrs(
        self,
        node: Node,
        mode: int | None,
        owner: tuple[int, int] | None,
        times: tuple[int, int] | None,
    ) -> None:
        async def op() -> None:
            async with self._ns:
                if node.on_backing and node.attached:
                    before, st = await self.io.read(
                        self.store.set_attrs, self.index.path(node), mode, owner, times
                    )
                    node.ctime_ns = st.st_ctime_ns
                    # A touch moves the mtime that a passthrough open compares, not the bytes:
                    # still trusted, unless the file had changed around the mount before it.
                    if before == node.verified_as:
                        node.verified_as = stat_stamp(st)
                else:  # its publish writes what the node says
                    node.ctime_ns = time.time_ns()
                    fd = self.passthrough_fd(node)
                    if times is not None and fd is not None:  # the kernel writes its mtime
                        await self.io.read(partial(os.utime, fd, ns=times))
                if mode is not None:
                    node.mode = mode
                if owner is not None:
                    node.uid, node.gid = owner
                if times is not None:
                    node.atime_ns, node.mtime_ns = times

        await self.bounded(op)

    async def set_pinned(self, node: Node, pinned: bool) -> None:
        async def op() -> None:
            async with self._ns:
                rel = self._attached(node)
                if node.is_dir:
                    await self._make_dirs(node)
                await self.io.read(self.store.save_pinned, rel, pinned)
                self.index.set_pinned(node, pinned)

        await self.bounded(op)

    async def space(self) -> tuple[int, int, int, int, int, int]:
        """Bytes of capacity, free in it, and available to a writer (the disk may have less
        left), and the backing filesystem's inodes: total, free, available."""
        st = await self.bounded(partial(self.io.read, self.store.statvfs))
        free = self.evictor.free
        available = min(free, st.f_bavail * st.f_frsize)
        return self.evictor.capacity, free, available, st.f_files, st.f_ffree, st.f_favail

    # -- writing ----------------------------------------------------------------------------

    async def create(
        self,
        parent: Node,
        name: bytes,
        mode: int,
        owner: tuple[int, int],
        exclusive: bool,
        passthrough: bool = False,
        direct: bool = False,
    ) -> tuple[Node, bool]:
        """A new empty file open for writing (visible at once, published at its last release),
        or the existing one, not opened; True if it was created. ``passthrough``: the kernel
        writes it into its temp file (``passthrough_fd``), not the daemon into a buffer;
        ``direct``: with O_DIRECT, as the writer opened it."""

        async def op() -> tuple[Node, bool]:
            # Under the lock: mkdir/rename/rmdir check a name, await the disk, then change the
            # index, and a create must not slip in between. Shared: the name is checked again
            # once the temp file came, as a create or mkdir may have taken it meanwhile.
            async with self._ns_shared():
                existing = self._existing(parent, name, exclusive)
                file = None
                if existing is None and passthrough:
                    file = await self._new_tmp(mode)
                    try:  # a create or mkdir may have taken the name meanwhile
                        existing = self._existing(parent, name, exclusive)
                    except OSError:
                        self._spare_tmps.append(file)  # unused: a spare again
                        raise
                    if existing is not None:
                        self._spare_tmps.append(file)
                if existing is not None:
                    return existing, False
                return self._new_file(parent, name, mode, owner, direct, file), True

        return await self.bounded(
            op, undo=lambda result: self.drop_writer(result[0]) if result[1] else None
        )

    def create_now(
        self,
        parent: Node,
        name: bytes,
        mode: int,
        owner: tuple[int, int],
        exclusive: bool,
        direct: bool,
    ) -> Node:
        """``create`` of a new passthrough file, from memory: from a spare temp file, with the
        namespace free. NeedsIO where it would wait, or the name exists and may be opened."""
        if self._ns.locked() or not self._spare_tmps:
            raise NeedsIO()
        if self._existing(parent, name, exclusive) is not None:
            raise NeedsIO()
        return self._new_file(parent, name, mode, owner, direct, self._spare_tmp())

    def _existing(self, parent: Node, name: bytes, exclusive: bool) -> Node | None:
        """What a create finds under the name (EEXIST for an exclusive one); ENOENT when the
        directory went."""
        existing = self.index.child(parent, name)
        if existing is not None and exclusive:
            raise fail(errno.EEXIST)
        if existing is None and not parent.attached:
            raise fail(errno.ENOENT)
        return existing

    def _new_file(
        self,
        parent: Node,
        name: bytes,
        mode: int,
        owner: tuple[int, int],
        direct: bool,
        file: TmpFile | None,
    ) -> Node:
        """A new empty file under the name, open for writing (one writer), into ``file`` when
        the kernel writes it in passthrough."""
        ws = WriteState(ChunkBuffer(self.extents), file=file, writers=1, direct=direct)
        node = self.index.new_node(name, stat.S_IFREG | mode, *owner)
        node.atime_ns = node.mtime_ns = node.ctime_ns = time.time_ns()
        self.index.attach(parent, name, node)
        self.writes[node.ino] = ws
        ws.changed()
        return node

    async def open_write(self, node: Node, truncate: bool) -> None:
        """One more writer; the file's bytes are loaded first (verified) unless truncated. A
        writer of a published file is served: none may pass through meanwhile."""
        if node.ino not in self.writes and not node.on_backing:
            raise fail(errno.ESTALE)
        if node.passthrough_opens and self.passthrough_fd(node) is None:
            raise fail(errno.ETXTBSY)
        await self.bounded(
            partial(self._open_write, node, truncate), undo=lambda _: self.drop_writer(node)
        )

    async def _open_write(self, node: Node, truncate: bool) -> None:
        ws = self.writes.get(node.ino)
        if ws is not None and ws.file is not None:
            # Its last release may be publishing it (under the lock): a writer that joined now
            # would write into the file just published, in place. Join after; or, if it went,
            # open the published file for writing like any other.
            async with ws.lock:
                pass
            ws = self.writes.get(node.ino)
        if ws is None:
            ws = self.writes[node.ino] = WriteState(ChunkBuffer(self.extents))
            if node.on_backing and node.size and not truncate:
                held = extents_for(node.size) * EXTENT
                try:
                    async with ws.lock:  # writes wait until the current bytes are loaded
                        self._check_size(node.size)
                        with self.deadline("an open for writing waited for buffer memory"):
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

    async def write(self, node: Node, offset: int, data: bytes) -> None:
        ws = self.writes[node.ino]
        if ws.failed is not None:
            raise fail(ws.failed)
        if ws.file is not None:  # a passthrough file's write the kernel sent us after all
            await self._on_tmp(ws.file, _pwrite_all, data, offset)
            ws.changed()
            node.mtime_ns = node.ctime_ns = time.time_ns()
            return
        async with ws.lock:
            try:
                await self._reserve(ws, offset, offset + len(data))
            except OSError as err:
                self._failed(node, ws, err)  # the file can no longer be what its writer meant
                raise
            ws.buffer.write(offset, data)
            ws.changed()
        node.mtime_ns = node.ctime_ns = time.time_ns()

    def _check_size(self, size: int) -> None:
        """A file lives whole in the write buffer while it is written: no larger than it."""
        if size > self.budget.capacity:
            raise fail(errno.EFBIG)

    async def _reserve(self, ws: WriteState, offset: int, end: int) -> None:
        """Take budget for the extents a write of [offset, end) adds (holes take none).

        Writers wait for memory; but if every holder waits for more (the budget is split among
        many half-written files), nobody could ever go on: past the deadline, EIO.
        """
        self._check_size(end)
        extra = ws.buffer.extents_to_add(offset, end)
        if extra:
            with self.deadline("a write waited for buffer memory"):
                await self.budget.acquire(extra * EXTENT)

    def _resize(self, ws: WriteState, size: int) -> None:
        """Truncate a buffer (budget reserved beforehand if it grows; returned if it shrinks)."""
        before = ws.buffer.capacity
        ws.buffer.truncate(size)
        if ws.buffer.capacity < before:
            self.budget.release(before - ws.buffer.capacity)

    async def close_write(self, node: Node, closer: int) -> None:
        """A writer's close() (FLUSH): write the bytes to a temp file now, so that errors reach
        it; the last release publishes them. The close the kernel makes for a writer it is
        tearing down after a kill publishes nothing: ``closer`` is the thread that closes, or
        the process that opened the file where the session does not tell (pyfuse3)."""
        ws = self._closing(node, closer)
        if ws is not None:
            await self._prepare_or_fail(node, ws, durable=False)

    def close_write_now(self, node: Node, closer: int) -> None:
        """``close_write`` from memory: a passthrough file's close only reserves its room (its
        seal waits for the last release). NeedsIO where that would wait, or a buffer is to be
        written."""
        ws = self.writes.get(node.ino)
        if ws is not None and ws.file is None and ws.declared is not None:
            raise NeedsIO()  # a buffered file's declaration is checked against its bytes
        if ws is not None and ws.dirty and (ws.file is None or ws.lock.locked()):
            raise NeedsIO()
        ws = self._closing(node, closer)
        if ws is None:
            return
        current, version = ws.prepared, self._version(ws)
        if current is not None and current.version == version:
            self._take_declared(ws)
            return
        held = self.evictor.reserve_now(version[0])
        if current is not None:
            ws.prepared = None
            self._discard(ws, current)
        node.mtime_ns = version[1]
        attrs = self._file_attrs(node)
        ws.prepared = Prepared(None, version, attrs, held, False, ws.declared)
        ws.declared = None

    def declare_checksum(self, node: Node, value: str | None) -> None:
        """A writer's checksum of the bytes it is writing (``user.kvfs.checksum`` set on the
        file; None: taken back), for those its next close leaves. A passthrough file is then
        published with it, not read back from the disk (the daemon never sees its bytes; the
        scrub checks them against it later); a buffered one, whose bytes the daemon checksums
        itself, only if they match. EPERM where no write is under way."""
        ws = self.writes.get(node.ino)
        if ws is None:
            raise fail(errno.EPERM)
        ws.declared = value

    @staticmethod
    def _take_declared(ws: WriteState) -> None:
        """A declaration made after the close that prepared these same bytes covers them
        (checked now where the daemon holds them)."""
        declared, ws.declared = ws.declared, None
        if declared is None or ws.prepared is None:
            return
        published = ws.prepared.published
        if published is not None and published.checksum != declared:
            raise _undeclared_bytes(published.checksum, declared)
        ws.prepared = dataclasses.replace(ws.prepared, declared=declared)

    def _closing(self, node: Node, closer: int) -> WriteState | None:
        """The file a writer's close is to prepare for its publish; None if none is (nothing
        written, or the close of a writer killed with it open)."""
        ws = self.writes.get(node.ino)
        if ws is None:
            return None
        if ws.failed is not None:
            raise fail(ws.failed)
        if process.killed_by_signal(closer):
            ws.abandoned = True
            log.warning("%s: its writer was killed with it open: not published", self._name(node))
            return None
        return ws if ws.dirty else None

    async def fsync(self, node: Node, writer: bool) -> None:
        ws = self.writes.get(node.ino)
        if writer and ws is not None and ws.dirty:
            if ws.failed is not None:
                raise fail(ws.failed)
            await self._prepare_or_fail(node, ws, durable=True)
        elif node.on_backing:

            async def op() -> None:
                async with self._ns:
                    rel = self._backing_rel(node)
                await self.io.write(self.store.fsync, rel)

            await self.bounded(op)

    async def release_writer(self, node: Node) -> None:
        """A writer's last descriptor went (RELEASE); the last writer publishes."""
        ws = self.writes.get(node.ino)
        if ws is None or self.release_after_rename(node):
            return
        self.releasing += 1
        await self._last_release(node, ws)

    def release_after_rename(self, node: Node) -> bool:
        """Give a store's temp file (``vllm_layout.is_store_temp``), closed and not renamed
        yet, ``--rename-wait`` for the rename that follows its close: its last release ends
        now, and what it has to do waits (``_rename_waits``). That rename names the file in
        memory and publishes it under the chunk's name in one trip (``_publish_closed``), at
        whose end the release finds nothing left to do (``_released_in_memory``); an unlink,
        or the wait's end (``expire_rename_waits_forever``), finishes the release as any
        other. False, and nothing done, for any other release: its file is published at once
        (a reader may open it under the name it has).

        Published at once, the temp file took two trips under its own name (seal, place) and
        the rename a third to move it, waiting on the last two, alone on the namespace lock
        and, in the kernel, holding its directory's lock. With 16 threads storing into one
        directory, most renames came after the release had begun (docs/benchmarks.md,
        session 19). Waiting without a task keeps the store's RELEASE out of its rename's way:
        the kernel session answers it in its receive loop."""
        ws = self.writes.get(node.ino)
        wait = self.cfg.rename_wait
        if ws is None or not wait or ws.writers != 1 or ws.renaming:
            return False
        if node.on_backing or not node.attached or not vllm_layout.is_store_temp(node.name):
            return False
        if self._closed_write(node) is not ws:
            return False
        self.releasing += 1
        if not self._rename_waits:
            self._rename_waits_begun.set()
        self._rename_waits[node.ino] = (trio.current_time() + wait, node, ws)
        return True

    async def expire_rename_waits_forever(self) -> None:
        """Finish the last releases whose wait for a rename ran out (``release_after_rename``):
        their files are published under the names they have. The waits end in the order they
        began (one ``--rename-wait`` each)."""
        while True:
            if not self._rename_waits:
                self._rename_waits_begun = trio.Event()
                await self._rename_waits_begun.wait()
                continue
            deadline, node, ws = next(iter(self._rename_waits.values()))
            if trio.current_time() < deadline:
                await trio.sleep_until(deadline)
                continue
            del self._rename_waits[node.ino]
            self.counters.renames_missed += 1
            try:
                self._end_release(node, ws)
            except Exception:  # a bug: logged, and the other waits still end
                log.exception("the last release of %s failed", self._name(node))

    def _end_rename_wait(self, node: Node) -> None:
        """A last release that waits for the file's rename (``release_after_rename``) is
        finished: the file was renamed (and the rename's publish ended), or unlinked (no
        rename will come)."""
        waiting = self._rename_waits.pop(node.ino, None)
        if waiting is not None:
            self._end_release(node, waiting[2])

    def _end_release(self, node: Node, ws: WriteState) -> None:
        """What a last release left to its file's rename: done from memory where nothing is
        left to publish; else in the background."""
        if self._released_in_memory(node, ws):
            self.releasing -= 1
            self.index.release_if_unused(node)
        else:
            self.start_detached(partial(self._last_release, node, ws, forget=True))

    async def _last_release(self, node: Node, ws: WriteState, forget: bool = False) -> None:
        """A writer's last release, counted in ``releasing`` (uncounted here). ``forget``: the
        kernel's RELEASE was answered before (``release_after_rename``): the index may drop the
        node once it ends."""
        try:
            if not self._released_in_memory(node, ws):
                await self.bounded(partial(self._release_writer, node, ws))
        except OSError as err:
            # A failed publish was counted and logged where it failed; past the deadline (which
            # logged that) it goes on in the background.
            log.debug("last release of %s: %s", self._name(node), err)
        finally:
            self.releasing -= 1
            if forget:
                self.index.release_if_unused(node)

    def _released_in_memory(self, node: Node, ws: WriteState) -> bool:
        """A last release with nothing to publish (a store's temp file its rename published
        while the release waited, ``release_after_rename``): the write state goes at once,
        without the task and the lock ``_release_writer`` takes. False for any other release."""
        if ws.writers != 1 or ws.dirty or ws.prepared is not None or ws.lock.locked():
            return False
        if self._written_after_rename(ws):
            return False  # quarantined there
        gone = self.drop_writer(node)
        assert gone is None  # (published: its name stays)
        return True

    def _written_after_rename(self, ws: WriteState) -> bool:
        """Whether a passthrough file its rename published was written since, through a
        descriptor still open (behind its checksum)."""
        return ws.published_as is not None and ws.published_as != self._version(ws)[:2]

    async def _release_writer(self, node: Node, ws: WriteState) -> None:
        gone: Node | None = None
        try:
            async with ws.lock:  # after a prepare that outlived its deadline
                try:
                    if ws.writers == 1:
                        await self._publish(node, ws)
                        if self._written_after_rename(ws):
                            await self._quarantine(node, "written after its rename published it")
                finally:
                    gone = self.drop_writer(node)
        finally:
            # Unpublished (its publish may have just failed), its name went: the kernel must
            # know before the release ends.
            if gone is not None:
                await self.listener.name_gone_now(gone, node.name, node)

    async def _prepare_or_fail(self, node: Node, ws: WriteState, durable: bool) -> None:
        try:
            await self.bounded(partial(self._prepare, node, ws, durable))
        except OSError as err:
            self._failed(node, ws, err)  # the writer is told: never published
            raise

    def _failed(self, node: Node, ws: WriteState, err: OSError) -> None:
        """A write, close or the publish of the file failed: it will not be published. Counted
        and logged once per file, at once: it still has the name its writer gave it."""
        if ws.failed is None:
            reason = PublishFailure.of(err)
            self.counters.publish_failures[reason] += 1
            log.warning("publish of %s failed (%s): %s", self._name(node), reason, err)
        ws.failed = err.errno or errno.EIO

    def _name(self, node: Node) -> str:
        """What the log calls a file: its path under the mount, as the operator finds it."""
        if node.attached:
            return self.index.path(node).decode(errors="replace")
        return f"inode {node.ino} (unlinked)"

    async def _prepare(self, node: Node, ws: WriteState, durable: bool) -> None:
        async with ws.lock:  # writes to this file wait until its bytes are on the store
            await self._prepare_locked(node, ws, durable)

    async def _prepare_locked(self, node: Node, ws: WriteState, durable: bool) -> None:
        """Write the buffer to a temp file (or seal the passthrough one), with room reserved
        for it, unless done already."""
        current, version = ws.prepared, self._version(ws)
        if current is not None:
            if current.version == version and (current.durable or not durable):
                self._take_declared(ws)
                return
            ws.prepared = None
            self._discard(ws, current)
        if ws.file is not None:  # the kernel's writes set the file's mtime (and utimens too)
            node.mtime_ns = version[1]
        attrs = self._file_attrs(node)
        held = await self.evictor.reserve(ws.buffer.size if ws.file is None else version[0])
        prepared = Prepared(None, version, attrs, held, durable, ws.declared)
        ws.declared = None
        try:
            if ws.file is None:
                published = await self._write_tmp(ws.buffer, attrs, durable)
                prepared = dataclasses.replace(prepared, published=published)
                if prepared.declared not in (None, published.checksum):
                    self._discard_tmp(ws, prepared)
                    raise _undeclared_bytes(published.checksum, prepared.declared)
            elif durable:  # fsync: checksummed and flushed now, not at the publish
                sealed = await self._seal(ws, prepared)
                assert sealed is not None  # (unchecked: it always seals)
                prepared = sealed
        except BaseException:
            self.evictor.release(held)
            raise
        ws.prepared = prepared

    async def _seal(
        self, ws: WriteState, prepared: Prepared, check: bool = False, with_checksum: bool = True
    ) -> Prepared | None:
        """Checksum a passthrough file as it is now and give it its attributes; sealing changes
        its ctime, so the version is the one after. ``check``: None, nothing done, if the file
        changed since ``prepared`` was made (in the same trip to the I/O pool).
        ``with_checksum=False``: the attributes only (the sealer checksums it later)."""
        seal = self._seal_call(ws, prepared, prepared.version if check else None, with_checksum)
        return self._sealed(prepared, await self.io.write(seal))

    def _seal_call(
        self,
        ws: WriteState,
        prepared: Prepared,
        unchanged_since: tuple[int, int, int] | None,
        with_checksum: bool,
    ) -> Callable[[], Sealed]:
        """``BackingStore.seal_tmp`` of a passthrough file as ``prepared`` says."""
        assert ws.file is not None
        mode, uid, gid, times = prepared.attrs
        return partial(
            self.store.seal_tmp,
            ws.file.rel,
            ws.file.fd,
            mode,
            uid,
            gid,
            times,
            prepared.durable,
            ws.direct,
            unchanged_since,
            with_checksum,
            prepared.declared,
        )

    @staticmethod
    def _sealed(prepared: Prepared, sealed: Sealed) -> Prepared | None:
        if sealed is None:
            return None
        published, version = sealed
        return dataclasses.replace(prepared, published=published, version=version)

    @staticmethod
    def _reads_to_seal(prepared: Prepared) -> bool:
        """Whether a passthrough file's seal reads its bytes (for its checksum): not if its
        writer declared one, nor if it is small."""
        return prepared.declared is None and prepared.version[0] >= CHECKSUM_LATER_MIN

    def _checksum_later(self, ws: WriteState, size: int) -> bool:
        """Whether a passthrough file's publish leaves its checksum to the sealer: written past
        the page cache (a read-back would cost the disk a second trip), not small, and room in
        its backlog."""
        return ws.direct and size >= CHECKSUM_LATER_MIN and self.sealer.admits(size)

    @staticmethod
    def _version(ws: WriteState) -> Any:
        """What identifies the file's current bytes: the buffer's generation, or the size and
        times of a passthrough file (the kernel writes it without telling us). An fstat of an
        open file on a local filesystem (passthrough runs on no other) reads no disk: inline."""
        if ws.file is None:
            return ws.generation
        return BackingStore.version(ws.file.fd)

    def _discard(self, ws: WriteState, prepared: Prepared) -> None:
        """Let prepared bytes go, and the room held for them."""
        self.evictor.release(prepared.held)
        self._discard_tmp(ws, prepared)

    def _discard_tmp(self, ws: WriteState, prepared: Prepared) -> None:
        """Remove the temp file of prepared bytes (a passthrough file's stays: its writers and
        readers have it; it goes with the write state)."""
        if ws.file is None and prepared.published is not None:
            self.io.post(Queue.WRITE, self.store.discard, prepared.published.tmp)

    async def _publish(self, node: Node, ws: WriteState) -> None:
        """Rename the prepared bytes into place if they are the file as its last close left
        it; otherwise (a write failed, the writer was killed, no close) drop them."""
        prepared, ws.prepared = ws.prepared, None
        if not ws.dirty:
            if prepared is not None:
                self._discard(ws, prepared)
            return
        if ws.failed is not None or ws.abandoned or prepared is None:
            why = "a write failed" if ws.failed is not None else "its writer did not close it"
            log.info("%s not published: %s", self._name(node), why)
            if prepared is not None:
                self._discard(ws, prepared)
            return
        try:
            seal: bool | None = None  # sealed by the commit (with its checksum, or not)
            sealed: Prepared | None = prepared
            if prepared.published is None:  # a passthrough file: sealed at its publish
                # a chmod or touch after its close holds; one trip checks and seals (and takes
                # its checksum, unless declared or the sealer may take it later)
                attrs = self._file_attrs(node)
                later = prepared.declared is None and self._checksum_later(ws, prepared.version[0])
                prepared = dataclasses.replace(prepared, attrs=attrs)
                if ws.renaming and (later or not self._reads_to_seal(prepared)):
                    seal = not later  # its final name is known: sealed as it is placed
                else:
                    sealed = await self._seal(ws, prepared, check=True, with_checksum=not later)
            elif prepared.version != self._version(ws):
                sealed = None
            committed = None
            if sealed is not None:
                prepared = sealed
                committed = await self._commit(node, ws, prepared, seal)
            if committed is None:  # changed after its close (mmap); the room: released below
                self._discard_tmp(ws, prepared)
                log.info("%s not published: changed after its last close", self._name(node))
                return
            rewritten, prepared = committed
        except OSError as err:  # its writer's close() succeeded: only the count and log tell
            self._failed(node, ws, err)
            raise
        finally:  # after set_published: the bytes are counted in one place at all times
            self.evictor.release(prepared.held)
        assert prepared.published is not None
        if prepared.published.checksum is None and node.attached:
            self.sealer.defer(node, prepared.published.size)
        else:  # a store all the same: the sealer's read-back waits for the engine to pause
            self.sealer.busy()
            if prepared.declared is not None:
                self.counters.checksums_declared += 1
        if rewritten:
            self.listener.content_changed(node)
        elif prepared.published.blocks != math.ceil(prepared.published.size / 512):
            # The kernel may hold the st_blocks we gave while the file was dirty; `du` must see
            # the real ones. (Usually equal for chunk files: then the kernel keeps its cache and
            # the engine's next access() of the chunk costs no round trip.)
            self.listener.attributes_changed(node)

    async def _commit(
        self, node: Node, ws: WriteState, prepared: Prepared, seal: bool | None = None
    ) -> tuple[bool, Prepared] | None:
        """Rename a temp file over the node's name: whether it replaced a version, and the
        prepared file as published. ``seal`` (a passthrough file not sealed yet: with its
        checksum or not): sealed first, in the trip that places it where it can be; None if
        it changed since its close.

        Publishes share the namespace lock (each puts one file under its own name; two making
        the same directory is harmless): concurrent stores place their files in parallel
        trips. Not on a shared backing directory, where a publish may take another host's
        file instead."""
        async with self._ns_shared():
            node.version += 1
            ws.committing = True
            try:
                return await self._commit_locked(node, ws, prepared, seal)
            finally:
                ws.committing = False

    async def _commit_locked(
        self, node: Node, ws: WriteState, prepared: Prepared, seal: bool | None
    ) -> tuple[bool, Prepared] | None:
        placed = False
        if seal is not None:
            sealed = await self._seal_to_place(node, ws, prepared, seal)
            if sealed is None:
                return None
            prepared, placed = sealed
        pub = prepared.published
        assert pub is not None
        if not node.attached:  # unlinked, or renamed over, before its publish
            node.size, node.blocks = pub.size, pub.blocks  # what its readers still read
            if node.lookups or node.open_count:
                # The kernel may still open it through a name it resolved before: its bytes
                # wait where a retired file's do (`_retire`), uncharged, until the kernel
                # forgets it (`_released`).
                await self.io.read(self.store.rename, pub.tmp, self.store.unlinked_path(node.ino))
                node.on_backing, node.checksum = True, pub.checksum
                node.verified_as = self._published_as(ws)
                ws.dirty = False
            else:
                self._discard_tmp(ws, prepared)  # the room held: released by _publish
            return False, prepared
        rel = self.index.path(node)
        try:
            found = None if placed else await self._place(node, pub.tmp, rel)
        except BaseException:
            self._discard_tmp(ws, prepared)
            raise
        if found is not None:  # another host published this name first: theirs stays
            ws.dirty = False
            return self._lost_race(node, pub.checksum or "", found), prepared
        attrs = self._file_attrs(node)
        if attrs != prepared.attrs:  # chmod, chown, touch after its close
            mode, uid, gid, times = attrs
            await self.io.read(self.store.set_attrs, rel, mode, (uid, gid), times)
        for parent, _ in node.links:
            await self._make_dirs(parent)
        for alias in self.index.paths(node)[1:]:  # hard links: every name, the new bytes
            await self.io.read(self.store.relink, rel, alias)
        rewritten = node.on_backing
        node.on_backing = True
        node.rewritten = node.rewritten or rewritten
        node.checksum = pub.checksum
        node.verified_as = self._published_as(ws)
        if not node.hits:  # never read: as recent as its write (what a restart sees)
            node.last_read_ns = node.mtime_ns
        if namespaces.is_namespace_config(node) and node.parent is not None:
            config = await self._read_unpublished(ws, 0, namespaces.CONFIG_MAX_BYTES + 1)
            node.parent.meta = namespaces.parse_config(config)
        self.index.set_published(node, pub.size, pub.blocks)
        if self.share is not None and not node.links:
            self.share.published(rel, pub.size)
        ws.dirty = False
        self.counters.publishes += 1
        self.counters.bytes_written += pub.size
        self.listener.stored(node)
        return rewritten, prepared

    @staticmethod
    def _published_as(ws: WriteState) -> Stamp | None:
        """A file this daemon just published is trusted as it stands (checksummed, or written
        by the kernel for its writers and sealed later): a passthrough file's stamp. None for
        one written from the buffer (no passthrough then: its first passthrough open checks
        it)."""
        return None if ws.file is None else file_stamp(ws.file.fd)

    async def _seal_to_place(
        self, node: Node, ws: WriteState, prepared: Prepared, with_checksum: bool
    ) -> tuple[Prepared, bool] | None:
        """Seal a passthrough file whose final name is known (the caller holds ``_ns``), and
        place it there in the same trip where ``_place`` would have renamed it: the sealed
        file and whether it was placed; None if it changed since its close."""
        if not node.attached or node.on_backing or node.links or self.store.host is not None:
            sealed = await self._seal(ws, prepared, check=True, with_checksum=with_checksum)
            return None if sealed is None else (sealed, False)
        assert node.parent is not None
        unmade = self._unmade(node.parent)  # made in the same trip
        seal = self._seal_call(ws, prepared, prepared.version, with_checksum)
        dirs = self._dirs_to_make(unmade)
        sealed = self._sealed(
            prepared, await self.io.read(self.store.seal_into, seal, self.index.path(node), dirs)
        )
        if sealed is None:
            return None
        self._made(unmade)
        return sealed, True

    async def _place(self, node: Node, src: bytes, rel: bytes) -> Found | None:
        """Rename ``src`` to ``rel``; on a shared backing directory a name this daemon has not
        published is taken with link() instead, which never replaces another host's file:
        what holds the name then is returned (``_lost_race``)."""
        if self.store.host is None or node.on_backing:
            assert node.parent is not None
            unmade = self._unmade(node.parent)  # made in the same trip
            await self.io.read(self.store.rename_into, src, rel, self._dirs_to_make(unmade))
            self._made(unmade)
            return None
        return await self.io.read(self.store.link_new, src, rel)

    def _theirs(self, target: Node, node: Node) -> bool:
        """Whether a rename of ``node`` over ``target`` would replace another host's file (one
        a lookup found on the share) with other bytes."""
        return (
            target.ino in self.adopted
            and target.is_file
            and not target.links
            and (target.checksum is None or target.checksum != node.checksum)
        )

    def _lost_race(self, node: Node, ours: str, found: Found) -> bool:
        """The node takes the file another host published under its name first. Other bytes
        under one name (vLLM's names are content hashes) are counted and logged; returns
        whether the kernel must drop what it cached of ours."""
        conflict = found.checksum != ours
        if conflict:
            self.counters.publish_conflicts += 1
            log.warning(
                "publish of %s: another host published other bytes (checksum %s, ours %s) "
                "under that name first; theirs kept",
                self._name(node),
                found.checksum,
                ours,
            )
        shared.describe(self.index, node, found)
        self.adopted.add(node.ino)  # another host's file now
        node.rewritten = node.rewritten or conflict  # readers bypass pages of our version
        self.listener.stored(node)
        return conflict

    @staticmethod
    def _file_attrs(node: Node) -> Attrs:
        return node.mode, node.uid, node.gid, (node.atime_ns, node.mtime_ns)

    async def _write_tmp(self, data: ChunkBuffer, attrs: Attrs, durable: bool) -> Published:
        for _ in range(DISK_FULL_RETRIES):
            try:
                return await self.io.write(self.store.write_tmp, data, *attrs, durable)
            except OSError as err:
                # The backing filesystem filled up before the capacity did (other data shares
                # it, or readers still hold evicted files open): make room the same way.
                if err.errno != errno.ENOSPC:
                    raise
                if not await self.evictor.free_up(data.size, EvictionReason.DISK_FULL):
                    raise
        raise fail(errno.ENOSPC)

    async def truncate(self, node: Node, size: int) -> None:
        await self.bounded(partial(self._truncate, node, size))

    async def _truncate(self, node: Node, size: int) -> None:
        ws = self.writes.get(node.ino)
        if ws is not None:
            async with ws.lock:
                if self.writes.get(node.ino) is ws:  # not let go while we waited
                    # Open for writing: the writers' close publishes the new size; if they
                    # all closed already, nobody will after this truncate: it completes the file.
                    await self._truncate_locked(node, ws, size)
                    if ws.prepared is not None:
                        await self._prepare_locked(node, ws, durable=False)
                    return
        # truncate(2) by path with no writer: open it for writing ourselves, and publish.
        if not node.on_backing:
            raise fail(errno.ESTALE)
        await self._open_write(node, truncate=size == 0)
        ws = self.writes[node.ino]
        try:
            async with ws.lock:
                await self._truncate_locked(node, ws, size)
                await self._prepare_locked(node, ws, durable=False)
        finally:
            await self._release_writer(node, ws)

    async def _truncate_locked(self, node: Node, ws: WriteState, size: int) -> None:
        if ws.failed is not None:
            raise fail(ws.failed)
        if ws.file is not None:
            await self.io.write(os.ftruncate, ws.file.fd, size)
        else:
            self._check_size(size)  # growing adds a hole: no memory to reserve
            self._resize(ws, size)
        ws.changed()
        node.mtime_ns = node.ctime_ns = time.time_ns()

    def drop_writer(self, node: Node) -> Node | None:
        """One writer less; the last one takes the write state (and its memory) away. Returns
        the directory a never-published name left, if it did."""
        ws = self.writes.get(node.ino)
        if ws is not None:
            ws.writers -= 1
            if ws.writers == 0:
                return self._drop_write_state(node)
        return None

    def _drop_write_state(self, node: Node) -> Node | None:
        ws = self.writes.pop(node.ino)
        if ws.prepared is not None:
            self._discard(ws, ws.prepared)
            ws.prepared = None
        if ws.file is not None:
            self.close_later(ws.file.fd)
            if ws.dirty:  # never published: its temp file goes
                self.io.post(Queue.WRITE, self.store.discard, ws.file.rel)
        self.budget.release(ws.buffer.capacity)
        ws.buffer.release()
        if ws.file is None or ws.dirty or not node.on_backing:
            # What the kernel holds came from the buffer, or from a file that is not published:
            # it must ask again. (A passthrough file just published needs no word: its writes
            # made the kernel drop what it held, and we answered since with that same file's.)
            self.listener.attributes_changed(node)
        if not (ws.dirty and not node.on_backing and node.attached):
            return None
        # Never published: the name must not outlive the bytes it stood for.
        parent = node.parent
        assert parent is not None
        self.index.detach(node)
        self.listener.name_gone(parent, node.name, node)
        return parent

    async def read_unpublished(self, node: Node, offset: int, size: int) -> bytes | None:
        """Bytes of a file open for writing (what its readers see until it is published), or
        None if it is not."""
        ws = self.writes.get(node.ino)
        if ws is None:
            return None
        return await self._read_unpublished(ws, offset, size)

    async def _read_unpublished(self, ws: WriteState, offset: int, size: int) -> bytes:
        if ws.file is None:  # a copy, now: the buffer may change, or go, at the next await
            return bytes(ws.buffer.read(offset, size))
        return await self._on_tmp(ws.file, os.pread, size, offset)

    async def _on_tmp(self, file: TmpFile, fn: Callable[..., T], *args: Any) -> T:
        """``fn(fd, *args)`` on the I/O pool, within the deadline, on a descriptor of its own,
        taken now and closed after ``fn``: the write state may close ``file.fd`` (and its
        number be reused) while this waits, or after its caller gave up."""
        fd = os.dup(file.fd)

        def run() -> T:
            try:
                return fn(fd, *args)
            finally:
                os.close(fd)

        return await self.bounded(partial(self.io.write, run))

    def passthrough_fd(self, node: Node) -> int | None:
        """The temp file the kernel writes a passthrough file into, while it is written: every
        open of the file must pass through to it."""
        ws = self.writes.get(node.ino)
        return ws.file.fd if ws is not None and ws.file is not None else None

    def may_pass_through(self, node: Node) -> bool:
        """Whether a reader's open of ``node`` may pass through to its backing file (where
        the session can). While the kernel passes an inode through, it fails any other open
        that does not (EIO): a file written in passthrough is opened so by all; a published
        one by readers once it is verified (--verify first-read), unless the daemon serves a
        handle of it or it was published again in place (the page cache may hold another
        version)."""
        if node.passthrough_opens:
            return True
        first_read = self.cfg.verify == "first-read"
        trusted = node.verified_as is not None
        return first_read and trusted and not node.rewritten and node.open_count == 0

    def still_verified(self, node: Node, stamp: Stamp) -> None:
        """At a reader's open in passthrough, the ``file_stamp`` of the backing file it opened:
        one changed since it was verified (written around the mount: another process on the
        backing directory) is no longer trusted, so that open is served and checks it. (Taken
        in the loop: passthrough is for local stores only, where a stat reads an inode in
        memory; a served read's stamp is taken on the pool, ``_stamped``.)"""
        if node.verified_as is not None and stamp != node.verified_as:
            node.verified_as = None
            self.counters.changed_around += 1
            log.warning("%s changed on the backing store since it was verified", self._name(node))

    def may_pass_through_held(self, node: Node) -> bool:
        """``may_pass_through`` for a reopen on the backing file the kernel still holds (no
        descriptor here), checked at its path: a stat in the loop that the kernel answers from
        its caches (the file it holds keeps its path's entries there). False where that finds
        another file or none: the open then goes the usual way, which opens and checks it."""
        if not self.may_pass_through(node):
            return False
        try:
            stamp = file_stamp(self.store.abs(self._backing_rel(node)))
        except OSError:  # moved or removed (around the mount, or by a change of names now)
            return False
        if stamp == node.verified_as:
            return True
        if not self._ns.locked():  # (a change of names may be moving files: told at the open)
            self.still_verified(node, stamp)
        return False

    def size(self, node: Node) -> tuple[int, int]:
        """Size and 512-byte blocks to show: the buffer's while it differs from the published,
        a passthrough file's own (an fstat, which reads the inode in memory: no disk I/O)."""
        ws = self.writes.get(node.ino)
        if ws is not None and ws.file is not None:
            st = os.fstat(ws.file.fd)
            return st.st_size, st.st_blocks
        if ws is not None and (ws.dirty or not node.on_backing):
            return ws.buffer.size, math.ceil(ws.buffer.size / 512)
        return node.size, node.blocks

    # -- reading ----------------------------------------------------------------------------

    async def open_read(self, node: Node, passthrough: bool = False) -> Reader | None:
        """Open the published version of a file for a reader. While it is being written: None
        for a buffered one (its readers see the buffer until the version they will read is
        published), the temp file for a passthrough one; once its rename published it as it
        stands, the published version. ``passthrough``: for the kernel to read itself (not
        O_DIRECT)."""
        ws = self.writes.get(node.ino)
        if ws is not None and not self._renamed_and_published(node, ws):
            return None if ws.file is None else Reader(os.dup(ws.file.fd), None, unpublished=True)
        self._check_published(node)
        reader = await self.bounded(
            partial(self._open_backing, node, not passthrough),
            undo=lambda late: self.close_later(late.fd),
        )
        if passthrough:
            self.still_verified(node, file_stamp(reader.fd))
        self.count_read(node)
        return reader

    def open_read_now(self, node: Node, passthrough: bool) -> Reader:
        """``open_read`` from memory, in the receive loop: a published file, not being written,
        whose backing path the kernel resolves from its caches (``open_reader_cached``: no
        I/O, so no trip to the I/O pool). NeedsIO for any other, and while a change of names,
        or a publish of this file, may be moving it on the backing store."""
        if node.ino in self.writes or self.store.host is not None:
            raise NeedsIO()
        if self._ns.locked() or self._committing(node):
            raise NeedsIO()
        self._check_published(node)
        fd = self.store.open_reader_cached(self._backing_rel(node), not passthrough)
        if fd is None:
            raise NeedsIO()
        if passthrough:
            self.still_verified(node, file_stamp(fd))
        self.count_read(node)
        self.counters.cached_opens += 1
        return Reader(fd, node.checksum)

    async def await_renamed_publish(self, node: Node) -> None:
        """A reader's open of a file that its rename is publishing in the background
        (``_publish_renamed``: one pool trip) waits for that publish, within the deadline (EIO
        past it, as for any wait on the store), and then reads the chunk as published (passed
        through, counted), not its temp file."""
        ws = self.writes.get(node.ino)
        if ws is not None and ws.publishing is not None and not ws.publishing.done:
            await self.wait(ws.publishing)

    def _renamed_and_published(self, node: Node, ws: WriteState) -> bool:
        """Whether a file that its writer still holds open was published by its rename as it
        stands: its readers open the published version."""
        published = ws.publishing is not None and ws.publishing.done and node.on_backing
        return published and not ws.dirty and not self._written_after_rename(ws)

    @staticmethod
    def _check_published(node: Node) -> None:
        if not node.on_backing:
            # Evicted or quarantined after the kernel resolved the name: the VFS looks the
            # name up afresh on ESTALE, and finds it gone.
            raise fail(errno.ESTALE)

    def count_read(self, node: Node) -> None:
        """A read of a published file, for eviction: counted at open, since the kernel's page
        cache (or passthrough) answers the reads themselves. Persisted, so that the order
        survives a restart. ESTALE if the file went after the kernel resolved its name."""
        self._check_published(node)
        self.index.read(node, time.time_ns())
        self.counters.reads += 1
        self.sealer.busy()
        self._recency_dirty[node.ino] = node  # persisted by persist_recency_forever

    async def _open_backing(self, node: Node, direct: bool = True) -> Reader:
        """The exact version the index describes, and the checksum of that version. The
        namespace lock keeps its name in place; shared with the publishes of other files (the
        sealer's and the scrub's opens, and served reads, do not wait for every store), alone
        where one of this file may change the version meanwhile."""
        if self.store.host is None:
            async with self._ns.shared():
                if not self._committing(node):
                    version = node.version
                    rel = self._backing_rel(node)
                    fd = await self.io.read(self.store.open_reader, rel, direct)
                    if node.version == version:
                        return Reader(fd, node.checksum)
                    self.close_later(fd)  # published again meanwhile: opened again, alone
        async with self._ns:
            try:
                fd = await self.io.read(self.store.open_reader, self._backing_rel(node), direct)
                return Reader(fd, node.checksum)
            except FileNotFoundError:
                if self.store.host is None or not node.attached or node.links:
                    raise
                parent = self._gone(node)
        # Another host removed it: a miss (ENOENT) like any other, and before the reader
        # hears it, a miss for its next lookup too.
        await self.listener.name_gone_now(parent, node.name, node)
        raise fail(errno.ENOENT)

    def _gone(self, node: Node) -> Node:
        """Drop a file that another host evicted or unlinked from the index (caller holds the
        lock); returns its former parent, whose name for it the kernel must forget."""
        if self.share is not None:
            self.share.forget(self.index.path(node))
        parent = self._take_out(node)
        self.counters.gone_elsewhere += 1
        return parent

    def _take_out(self, node: Node) -> Node:
        """A published file's bytes left the backing store (the caller holds the lock): out of
        the index, and the listener told. Returns its former parent."""
        parent = node.parent
        assert parent is not None
        node.on_backing = False
        self.listener.removed(node)
        self.index.detach(node)
        return parent

    async def fall_through(self, parent: Node, name: bytes) -> Node | None:
        """A name the index lacks, looked up on a shared backing directory (another host may
        have published it since the mount): a file or directory found there joins the index.
        One stat, bounded by the deadline like any request on the store."""
        if layout.is_reserved(parent is self.index.root, name) or not parent.attached:
            return None
        rel = os.path.join(self.index.path(parent), name)

        async def op() -> Node | None:
            found = await self.io.read(self.store.probe, rel)
            async with self._ns:  # a create, rename or another lookup here meanwhile wins
                known = self.index.child(parent, name)
                if known is not None or found is None or not parent.attached:
                    return known
                if os.path.join(self.index.path(parent), name) != rel:  # the parent moved
                    return None
                self.counters.fell_through += 1
                return self._adopt(parent, name, found)

        return await self.bounded(op)

    async def fall_through_paths(self, rels: Sequence[bytes]) -> set[bytes]:
        """``fall_through`` for many paths at once (a batched lookup's misses), in one trip to
        the I/O pool: what the index lacks of each path is looked for on the shared backing
        directory, and a file found there joins the index with the directories above it.
        Returns the paths that are files now."""
        if self.store.host is None:
            return set()
        # Per path: the deepest node the index knows on it, and the components below it.
        todo: list[tuple[Node, bytes, list[bytes]]] = []
        known = set()  # joined the index since the caller looked
        for rel in rels:
            node, parts = self.index.root, rel.split(b"/")
            if not parts or layout.is_reserved(True, parts[0]):
                continue
            depth = 0
            while depth < len(parts) and node.children is not None:
                child = node.children.get(parts[depth])
                if child is None:
                    break
                node, depth = child, depth + 1
            if depth < len(parts) and node.children is not None:
                todo.append((node, self.index.path(node), parts[depth:]))
            elif depth == len(parts) and node.is_file:
                known.add(rel)
        if not todo:
            return known

        def probe_all() -> list[list[Found]]:
            seen: dict[bytes, Found | None] = {}
            out = []
            for _, above, parts in todo:
                found: list[Found] = []
                for part in parts:
                    above = os.path.join(above, part)
                    if above not in seen:
                        seen[above] = self.store.probe(above)
                    hit = seen[above]
                    if hit is None:
                        break
                    found.append(hit)
                    if not stat.S_ISDIR(hit.st.st_mode):
                        break
                out.append(found)
            return out

        async def op() -> set[bytes]:
            probed = await self.io.read(probe_all)
            files = set(known)
            async with self._ns:  # creates, renames and lookups meanwhile win
                for (node, above, parts), found in zip(todo, probed, strict=True):
                    if not node.attached or self.index.path(node) != above:
                        continue  # it moved meanwhile: the client asks again
                    walked = 0
                    for part, hit in zip(parts, found, strict=False):
                        if node.children is None:
                            break
                        child = node.children.get(part)
                        if child is None:
                            self.counters.fell_through += 1
                            child = self._adopt(node, part, hit)
                        node, walked = child, walked + 1
                    if walked == len(parts) and node.is_file:
                        files.add(os.path.join(above, *parts))
            return files

        return await self.bounded(op)

    def _adopt(self, parent: Node, name: bytes, found: Found) -> Node:
        """A file or directory another host made joins the index (the caller holds the
        lock); a file no journal told this host of (not yet, or never) is counted in the
        share from now on."""
        node = shared.adopt(self.index, parent, name, found)
        if node.is_file:
            self.adopted.add(node.ino)
            rel = self.index.path(node)
            if self.share is not None and rel not in self.share.view.entries:
                self.share.published(rel, node.size, node.last_read_ns)
        return node

    async def load(self, node: Node, reader: Reader | None) -> tuple[Reader, ChunkBuffer]:
        """Read a version whole and verify it; ``reader`` None for a handle opened while the
        file was being written (the version published since)."""
        if reader is None:
            if not node.on_backing:  # never published: there are no bytes
                raise fail(errno.EIO)
            reader = await self._open_backing(node)
        data = await self._read_verified(node, reader)
        self.counters.bytes_read += data.size
        return reader, data

    async def _read_backing(self, node: Node) -> ChunkBuffer:
        reader = await self._open_backing(node)
        try:
            return await self._read_verified(node, reader)
        finally:
            self.close_later(reader.fd)

    async def _read_verified(self, node: Node, reader: Reader) -> ChunkBuffer:
        """Check against the checksum of the version opened (a newer one may be published)."""
        expected = reader.checksum
        try:
            read: tuple[Stamp, tuple[ChunkBuffer, str]] = await self.io.read(
                _stamped, self.store.read_verified, reader.fd, expected, self.extents
            )
        except ChecksumMismatch as err:
            if node.checksum == expected:  # the version the tree serves is bad
                await self._quarantine(node, str(err))
            raise
        stamp, (data, digest) = read
        self._checked(node, expected, digest, stamp)
        return data

    def _checked(self, node: Node, expected: str | None, digest: str, stamp: Stamp) -> None:
        """A version of the node read whole matched ``expected``, or had no checksum and now
        has ``digest`` (the store keeps it with the file it read); ``stamp``: its file's before
        the read (a write during it makes the next passthrough open check it again)."""
        if expected is None and node.checksum is None:  # it had none: it has now
            node.checksum = digest
        if node.checksum == (expected or digest):  # the version the tree serves
            node.verified_as = stamp

    async def recheck(self, node: Node) -> tuple[int, bool] | None:
        """Read a published file again, past the page cache where the store allows, and check
        it (the scrub, the sealer; no read is counted): its size and whether it matched (a
        file without a checksum has one from then on). A mismatch quarantines it. None if
        there is nothing to check (gone, or being written)."""
        if not node.attached or not node.on_backing or node.ino in self.writes:
            return None
        try:
            reader = await self._open_backing(node)
        except FileNotFoundError:
            if node.attached:
                raise  # gone from the backing store around the mount: the scrub says so
            return None  # unlinked while the open waited for the lock, and removed since
        stamp, (digest, size) = await self.io.read(self._recheck_and_close, reader)
        if reader.checksum is not None and digest != reader.checksum:
            if node.checksum == reader.checksum:  # the version the tree serves is bad
                await self._quarantine(node, f"scrub: checksum {digest} != {reader.checksum}")
            return size, False
        self._checked(node, reader.checksum, digest, stamp)
        return size, True

    def _recheck_and_close(self, reader: Reader) -> tuple[Stamp, tuple[str, int]]:
        """On the pool: ``store.recheck`` (``_stamped``), then the fd closed in the same trip
        (the scrub and the sealer check thousands of small files: a trip each is what they
        cost)."""
        try:
            return _stamped(self.store.recheck, reader.fd, reader.checksum)
        finally:
            os.close(reader.fd)

    # -- removal ----------------------------------------------------------------------------

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
                self.listener.name_gone(alias_parent, alias_name, node)
            parent = self._take_out(node)
            if self.share is not None:
                self.share.removed(rel)
            self.counters.quarantined += 1
            self.counters.quarantined_bytes += node.size
        log.error(
            "quarantined %s to %s: %s",
            rel.decode(errors="replace"),
            dest.decode(errors="replace"),
            why,
        )
        # Before the reader hears EIO: its next access() must already miss.
        await self.listener.name_gone_now(parent, node.name, node)

    def busy(self, node: Node) -> bool:
        """Files that eviction must leave alone: pinned, being written, not on disk yet, not a
        regular file, with several names, or a namespace's config.json (tiny, and what names the
        model in every report)."""
        return (
            node.ino in self.writes
            or not node.on_backing
            or not node.is_file
            or bool(node.links)  # several names: an operator's deliberate act
            or self.index.pinned(node)
            or namespaces.is_namespace_config(node)
        )

    async def evict(self, node: Node, reason: EvictionReason, wait_for_kernel: bool = True) -> bool:
        """Remove a file to make room, now: its space must be free for the publish that asked.

        Readers that opened it keep their own descriptors of its bytes; an open through a name
        the kernel resolved before gets ESTALE, and the VFS then finds the name gone.
        """
        async with self._ns:
            if not node.attached or self.busy(node):
                return False
            rel = self.index.path(node)
            with contextlib.suppress(FileNotFoundError):  # deleted around the mount
                await self.io.read(self.store.unlink, rel)
            parent = self._take_out(node)
            if self.share is not None:
                self.share.removed(rel)
        log.debug("evicted inode %d (%s)", node.ino, reason)
        if wait_for_kernel:  # access() of the name must miss from now on
            await self.listener.name_gone_now(parent, node.name, node)
        else:
            self.listener.name_gone(parent, node.name, node)
        return True

    async def evict_by_request(self, request: str, dry_run: bool = False) -> tuple[int, int]:
        """``namespace=NAME`` or ``older-than=SECONDS`` (from `kvfs evict`): evict those files,
        except what may not go (`busy`). Returns the files and bytes evicted, or with
        ``dry_run`` those that would be, touching nothing."""

        async def op() -> tuple[int, int]:
            key, _, value = request.partition("=")
            if key == "namespace":
                top = self.index.child(self.index.root, value.encode())
                if top is None or not top.is_dir:
                    raise fail(errno.ENOENT)
                files = list(self.index.walk_files(top))
            elif key == "older-than":
                try:
                    cutoff = time.time_ns() - int(float(value) * 1e9)
                except (ValueError, OverflowError):
                    raise fail(errno.EINVAL) from None
                files = [f for f in self.index.walk_files() if f.last_read_ns < cutoff]
            else:
                raise fail(errno.EINVAL)
            count = size = 0
            for node in files:  # the caller holds the root's lock: never wait on the kernel
                if dry_run:
                    gone = not self.busy(node)
                else:
                    gone = await self.evict(node, EvictionReason.REQUEST, wait_for_kernel=False)
                    if gone:
                        self.evictor.evicted(EvictionReason.REQUEST, node.size)
                count, size = count + gone, size + node.size * gone
            return count, size

        return await self.bounded(op)
