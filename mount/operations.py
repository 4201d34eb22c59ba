"""The FUSE front end of kvfs: inodes, handles, control files, xattrs and errnos.

Every file's life (buffered writes, publish at the last release, verified reads, quarantine,
eviction, deadlines) is the object layer's (mount/objects.py); this class translates requests
into its calls and keeps the handle tables; what the objects did reaches KV events and the
kernel's caches through ``MountListener`` (mount/listener.py). Whatever a handler raises fails
that request only (``contained``). Here: the files, attributes and xattrs; the namespace
requests (lookups, directories, names) are mount/names.py's.

Which errno answers what: docs/design-notes.md, "Errnos".
"""

from __future__ import annotations

import errno
import inspect
import os
from functools import partial

import pyfuse3
from pyfuse3 import FUSEError

from kvfs import process
from kvfs.buffers import ChunkBuffer
from kvfs.config import MountConfig
from kvfs.control_protocol import Report
from kvfs.index import Index, Node
from kvfs.mount import attributes, control, sessions
from kvfs.mount.batch_lookup import BatchLookups, Caller
from kvfs.mount.bridge import Future, NeedsIO, contained
from kvfs.mount.events import MountEvents
from kvfs.mount.handles import Handle, Handles
from kvfs.mount.invalidator import Invalidator
from kvfs.mount.kernel_session import FuseSession, PassthroughFileInfo
from kvfs.mount.listener import MountListener
from kvfs.mount.lookups import FastMisses, LookupCounts
from kvfs.mount.metrics import Metrics
from kvfs.mount.names import NameRequests
from kvfs.mount.objects import Objects, Reader
from kvfs.mount.scrub import Scrub
from kvfs.store import BackingStore

# Every request pyfuse3 may hand to the operations.
FUSE_HANDLERS = tuple(
    name
    for name, member in vars(pyfuse3.Operations).items()
    if not name.startswith("_") and inspect.iscoroutinefunction(member)
)


class KvfsOperations(NameRequests):
    enable_writeback_cache = False

    def __init__(
        self,
        cfg: MountConfig,
        store: BackingStore,
        index: Index,
        capacity: int,
        session: FuseSession = pyfuse3,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.session = session
        events = MountEvents(cfg.events) if cfg.events else None
        self.listener = MountListener(index, Invalidator(session), events, session)
        self.objects = Objects(cfg, store, index, capacity, self.listener)
        self.scrub = Scrub(self.objects, cfg.scrub_bytes_per_second)
        self.metrics = Metrics()
        self.handles = Handles()
        self.lookups = LookupCounts(index.get)
        shared = self.objects.fall_through_paths if cfg.shared is not None else None
        self.batch_lookups = BatchLookups(index, self.lookups, shared)
        for name in FUSE_HANDLERS:  # pyfuse3 calls the instance's attributes
            setattr(self, name, self.metrics.timed(name, contained(name, getattr(self, name))))
        # What the kernel session calls inline, in its receive loop: answered from memory.
        self.lookup_now = self.metrics.timed_now("lookup", self._lookup)
        self.getattr_now = self.metrics.timed_now("getattr", self._getattr)
        self.getxattr_now = self.metrics.timed_now("getxattr", self._getxattr)
        self.open_now = self.metrics.timed_now("open", self._reopen)
        self.release_now = self.metrics.timed_now("release", self._release_now)
        self.create_now = self.metrics.timed_now("create", self._create_now)
        self.flush_now = self.metrics.timed_now("flush", self._flush_now)
        self.rename_now = self.metrics.timed_now("rename", self._rename_now)
        self.mkdir_now = self.metrics.timed_now("mkdir", self._mkdir_now)
        # ... and once it has answered all it holds: what need not delay an answer.
        self.idle_now = self.lookups.settle
        # The first-time misses it may answer without the interpreter (none on a share).
        self.fast_misses = (
            FastMisses(self.lookups, self.metrics.latency.of("lookup").observe, cfg.cache_timeout)
            if cfg.shared is None
            else None
        )

    def report(self, walk: bool) -> Report:
        session = sessions.report(self.session)
        lookups = self.lookups.by_namespace
        return control.report(self.objects, self.scrub.stats, session, lookups, walk)

    def close(self) -> None:
        self.listener.close()
        self.objects.shutdown()
        for reader in self.handles.readers():
            os.close(reader.fd)

    def _file_info(self, handle: Handle, keep_cache: bool = False) -> pyfuse3.FileInfo:
        """The open reply: a passthrough handle names its backing file, where the kernel reads
        and writes; a served one is answered by read() and write()."""
        node = handle.node
        fd = self.objects.passthrough_fd(node)
        if fd is None and handle.reader is not None:
            fd = handle.reader.fd
        handle.passthrough = handle.passthrough and fd is not None
        fh = self.handles.open_file(handle)
        if not handle.passthrough:
            return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=node.rewritten)
        return PassthroughFileInfo(fh, keep_cache=True, backing_fd=fd)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._getattr(inode)

    def _getattr(self, inode: int) -> pyfuse3.EntryAttributes:
        """GETATTR from memory, without waiting on anything (see `_lookup`)."""
        if control.is_control(inode):
            return control.attrs(inode, self.cfg.cache_timeout)
        return self._attrs(self._node(inode))

    # -- files ------------------------------------------------------------------------------

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._new_dir(parent_inode, name)
        owner = self._owner(parent, ctx)
        exclusive = bool(flags & os.O_EXCL)
        passthrough = sessions.passthrough(self.session)  # the kernel writes it, not us
        direct = bool(flags & os.O_DIRECT)
        node, created = await self.objects.create(
            parent, name, self._masked(mode), owner, exclusive, passthrough, direct
        )
        if not created:
            return await self.open(node.ino, flags, ctx), self._entry(node)
        return self._created(parent, name, node, ctx, passthrough)

    def _create_now(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """CREATE from memory, in the kernel session's receive loop: a new file the kernel
        writes in passthrough (``Objects.create_now``); NeedsIO for any other."""
        if not sessions.passthrough(self.session):
            raise NeedsIO()
        parent = self._new_dir(parent_inode, name)
        owner = self._owner(parent, ctx)
        exclusive, direct = bool(flags & os.O_EXCL), bool(flags & os.O_DIRECT)
        node = self.objects.create_now(parent, name, self._masked(mode), owner, exclusive, direct)
        return self._created(parent, name, node, ctx, passthrough=True)

    def _created(
        self, parent: Node, name: bytes, node: Node, ctx: pyfuse3.RequestContext, passthrough: bool
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """The reply to a create that made the file: its writer's handle and its entry."""
        self.lookups.made(parent, name)
        handle = Handle(node, True, self._opener(ctx), passthrough=passthrough)
        return self._file_info(handle), self._entry(node)

    def _opener(self, ctx: pyfuse3.RequestContext) -> int:
        """The process a writer's FLUSH asks /proc about (was it killed with the file open?)
        where the FLUSH does not name the thread that closes (pyfuse3): the opener's. 0 where
        it does: each FLUSH then asks about its own caller (``flush``)."""
        return 0 if sessions.names_flush_caller(self.session) else process.thread_group(ctx.pid)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == control.LOOKUP_INO:
            fh = self.handles.new_fh()
            self.batch_lookups.open(fh, Caller(ctx.uid, process.groups(ctx.pid) | {ctx.gid}))
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if control.is_control(inode):
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise FUSEError(errno.EROFS)
            fh = self.handles.open_control(control.render(inode, self.report))
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        node = self._node(inode)
        if node.is_dir:
            raise FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            await self.objects.open_write(node, bool(flags & os.O_TRUNC))
            handle = Handle(node, True, self._opener(ctx), passthrough=True)
            return self._file_info(handle)
        held = self._reopen_held(node)
        if held is not None:
            return held
        await self.objects.await_renamed_publish(node)
        passthrough = sessions.passthrough(self.session) and self.objects.may_pass_through(node)
        handle = Handle(node, writable=False, passthrough=passthrough)
        handle.reader = await self.objects.open_read(node, passthrough)
        return self._opened(handle, bool(flags & os.O_DIRECT))

    def _opened(self, handle: Handle, direct: bool) -> pyfuse3.FileInfo:
        """The reply to a reader's open of the version ``handle.reader`` opened: passed through
        if it still may be (the open found the backing file as it was verified), else served.
        A served O_DIRECT reader's READs all come here, and none is answered before the whole
        version is read and checked: that read starts now, while the open is answered and the
        reader asks (a buffered reader's may be answered by the kernel's page cache)."""
        node = handle.node
        handle.passthrough = handle.passthrough and self.objects.may_pass_through(node)
        published = handle.reader is not None and not handle.reader.unpublished
        if published and node.parent:
            self.lookups.hit(node.parent)
        if published and direct and not handle.passthrough:
            self._load(handle)
        # O_DIRECT needs nothing special: the kernel bypasses its cache for that file descriptor
        # and sends READs of up to 1 MiB, each answered in full from the verified buffer. A file
        # published again in place is read past the page cache, which holds one version only.
        return self._file_info(handle, keep_cache=not node.rewritten)

    def _reopen(self, inode: int, flags: int) -> pyfuse3.FileInfo:
        """OPEN from memory, in the kernel session's receive loop: a reader's open of a chunk
        whose backing file the session holds, or whose backing path is in the kernel's caches
        (``Objects.open_read_now``); NeedsIO for any other open."""
        if control.is_control(inode) or flags & os.O_ACCMODE != os.O_RDONLY:
            raise NeedsIO()
        node = self._node(inode)
        if node.is_dir:
            raise NeedsIO()
        held = self._reopen_held(node)
        if held is not None:
            return held
        passthrough = sessions.passthrough(self.session) and self.objects.may_pass_through(node)
        handle = Handle(node, writable=False, passthrough=passthrough)
        handle.reader = self.objects.open_read_now(node, passthrough)
        return self._opened(handle, bool(flags & os.O_DIRECT))

    def _reopen_held(self, node: Node) -> pyfuse3.FileInfo | None:
        """A reader's open answered with the backing file the kernel still holds for this
        version from an earlier open: the reopen of a hot chunk costs no I/O, here or in the
        kernel. None where the session holds none (or may not pass the open through)."""
        published = node.on_backing and node.ino not in self.objects.writes  # as it stands
        if not (
            published
            and sessions.holds_backing(self.session, node.ino)
            and self.objects.may_pass_through_held(node)
        ):
            return None
        self.objects.count_read(node)
        if node.parent is not None:
            self.lookups.hit(node.parent)
        fh = self.handles.open_file(Handle(node, writable=False, passthrough=True))
        return PassthroughFileInfo(fh, keep_cache=True, reuse=True)

    async def read(  # type: ignore[override]  # both sessions take any buffer: no copy
        self, fh: int, off: int, size: int
    ) -> bytes | memoryview:
        if fh in self.batch_lookups.handles:
            return await self.batch_lookups.read(fh, off, size)
        generated = self.handles.control(fh)
        if generated is not None:
            return generated[off : off + size]
        handle = self.handles.file(fh)
        reader = handle.reader
        if handle.writable or reader is None or reader.unpublished:  # opened while written
            unpublished = await self.objects.read_unpublished(handle.node, off, size)
            if unpublished is not None:
                return unpublished
        version, content = await self.objects.wait(handle.content or self._load(handle))
        handle.reader = version
        return content.read(off, size)

    def _load(self, handle: Handle) -> Future[tuple[Reader, ChunkBuffer]]:
        """Read and check the version a reader opened, whole, in the background (the READs that
        need it wait, each within its deadline)."""
        handle.content = self.objects.start_detached(
            partial(self.objects.load, handle.node, handle.reader)
        )
        return handle.content

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if fh in self.batch_lookups.handles:
            return self.batch_lookups.write(fh, off, buf)
        handle = self.handles.file(fh)
        if not handle.writable:
            raise FUSEError(errno.EBADF)
        await self.objects.write(handle.node, off, buf)
        return len(buf)

    async def flush(self, fh: int, caller: int = 0) -> None:
        """close(): where a written file's errors (ENOSPC, EIO) can still reach the writer.
        ``caller``: the thread that closes, where the session names it (the kernel session);
        a process killed with the file open closes it from its exiting thread. Any process
        holding the descriptor may be the one killed mid-file (a child that inherited it), so
        each close is asked about its own caller; pyfuse3's, about the opener's process."""
        handle = self._writer(fh)
        if handle is not None:
            await self.objects.close_write(handle.node, caller or handle.opener)

    def _flush_now(self, fh: int, caller: int = 0) -> None:
        """FLUSH from memory, in the kernel session's receive loop (``Objects.close_write_now``):
        NeedsIO where it would wait."""
        handle = self._writer(fh)
        if handle is not None:
            self.objects.close_write_now(handle.node, caller or handle.opener)

    def _writer(self, fh: int) -> Handle | None:
        """A file's handle open for writing; None for any other handle."""
        if self.handles.control(fh) is not None or fh in self.batch_lookups.handles:
            return None
        handle = self.handles.file(fh)
        return handle if handle.writable else None

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.handles.file(fh)
        await self.objects.fsync(handle.node, handle.writable)

    async def release(self, fh: int) -> None:
        if self.handles.close_control(fh) or self.batch_lookups.close(fh):
            return
        handle = self.handles.close_file(fh)
        node = handle.node
        if handle.content is not None and not handle.content.done:
            # A load that outlived its READ's deadline still uses the fd: let it finish first.
            self.objects.start_detached(partial(self._close_reader, handle))
        else:
            await self._close_reader(handle)
        if handle.writable:
            await self.objects.release_writer(node)
        self.index.release_if_unused(node)

    def _release_now(self, fh: int) -> None:
        """RELEASE from memory, in the kernel session's receive loop: a reader's handle that
        the daemon served nothing through, or a store's temp file whose last release waits
        for its rename (``Objects.release_after_rename``); NeedsIO for any other."""
        handle = self.handles.get_file(fh)
        if handle is None or handle.content is not None:
            raise NeedsIO()
        if handle.writable and not self.objects.release_after_rename(handle.node):
            raise NeedsIO()
        self.handles.close_file(fh)
        self._drop_reader(handle)
        self.index.release_if_unused(handle.node)

    async def _close_reader(self, handle: Handle) -> None:
        if handle.content is not None:
            try:
                handle.reader, content = await handle.content.wait()
                content.release()
            except Exception:  # a failed load holds no buffer
                pass
        self._drop_reader(handle)

    def _drop_reader(self, handle: Handle) -> None:
        if handle.reader is not None:
            self.objects.close_later(handle.reader.fd)
            handle.reader = None

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
            await self.objects.truncate(node, attr.st_size)
        mode, owner, times = attributes.changes(node, attr, fields)
        if mode is not None or owner is not None or times is not None:
            await self.objects.set_attrs(node, mode, owner, times)
        return self._attrs(node)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The capacity and what is free within it (never more than the disk has left)."""
        return attributes.statvfs(await self.objects.space())

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return self._getxattr(inode, name)

    def _getxattr(self, inode: int, name: bytes) -> bytes:
        """GETXATTR from memory (see `_lookup`). The kernel asks for security.capability at
        every file's first write: answered before anything is built."""
        value = self._xattrs(inode).get(name) if name.startswith(b"user.") else None
        if value is None:
            raise FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return list(self._xattrs(inode))

    def _xattrs(self, inode: int) -> dict[bytes, bytes]:
        if control.is_control(inode):
            return {}  # the control files have no attributes
        return control.xattrs(self._node(inode), self.objects, self.report)

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        if control.is_control(inode):
            raise FUSEError(errno.EROFS)
        await control.set_xattr(self.objects, self._node(inode), name, value)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if control.is_control(inode):
            raise FUSEError(errno.EROFS)
        await control.set_xattr(self.objects, self._node(inode), name, None)
