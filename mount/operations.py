"""The FUSE front end of kvfs: inodes, handles, control files, xattrs and errnos.

Every file's life (buffered writes, publish at the last release, verified reads, quarantine,
eviction, deadlines) is the object layer's (mount/objects.py); this class translates requests
into its calls and keeps the handle tables; what the objects did reaches KV events and the
kernel's caches through ``MountListener`` (mount/listener.py). Whatever a handler raises fails
that request only (``contained``).

Which errno answers what: docs/design-notes.md, "Errnos".
"""

from __future__ import annotations

import errno
import inspect
import os
import stat
from functools import partial

import pyfuse3
from pyfuse3 import FUSEError

from kvfs import layout, process
from kvfs.buffers import ALIGN
from kvfs.config import MountConfig
from kvfs.control_protocol import Report
from kvfs.index import ROOT_INO, Index, Node
from kvfs.mount import control, sessions
from kvfs.mount.batch_lookup import BatchLookups, Caller
from kvfs.mount.bridge import contained
from kvfs.mount.events import MountEvents
from kvfs.mount.handles import Handle, Handles
from kvfs.mount.invalidator import Invalidator
from kvfs.mount.kernel_session import FuseSession, NeedsIO, PassthroughFileInfo
from kvfs.mount.listener import MountListener
from kvfs.mount.lookups import LookupCounts
from kvfs.mount.metrics import Metrics
from kvfs.mount.objects import Objects
from kvfs.mount.scrub import Scrub
from kvfs.mount.shared import MISS_TIMEOUT
from kvfs.store import BackingStore

PATH_MAX = 4096  # the longest symlink target Linux takes

# Every request pyfuse3 may hand to the operations.
FUSE_HANDLERS = tuple(
    name
    for name, member in vars(pyfuse3.Operations).items()
    if not name.startswith("_") and inspect.iscoroutinefunction(member)
)


class KvfsOperations(pyfuse3.Operations):
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
        self.lookups = LookupCounts()
        shared = self.objects.fall_through_paths if cfg.shared is not None else None
        self.batch_lookups = BatchLookups(index, self.lookups, shared)
        for name in FUSE_HANDLERS:  # pyfuse3 calls the instance's attributes
            setattr(self, name, self.metrics.timed(name, contained(name, getattr(self, name))))
        # What the kernel session calls inline, in its receive loop: answered from memory.
        self.lookup_now = self.metrics.timed_now("lookup", self._lookup)
        self.getattr_now = self.metrics.timed_now("getattr", self._getattr)
        self.getxattr_now = self.metrics.timed_now("getxattr", self._getxattr)

    def report(self, walk: bool) -> Report:
        session = sessions.report(self.session)
        lookups = self.lookups.by_namespace
        return control.report(self.objects, self.scrub.stats, session, lookups, walk)

    def close(self) -> None:
        self.listener.close()
        self.objects.shutdown()
        for reader in self.handles.readers():
            os.close(reader.fd)

    # -- inodes and handles -----------------------------------------------------------------

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

    def _new_dir(self, parent_inode: int, name: bytes) -> Node:
        """The parent of a name about to be made, and the name checked."""
        parent = self._dir(parent_inode)
        if len(name) > layout.NAME_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        if layout.is_reserved(parent.ino == ROOT_INO, name):
            raise FUSEError(errno.EPERM)
        return parent

    @staticmethod
    def _owner(parent: Node, ctx: pyfuse3.RequestContext) -> tuple[int, int]:
        """Who owns a new name: its creator, in the group of a set-group-ID directory."""
        gid = parent.gid if parent.mode & stat.S_ISGID else ctx.gid
        return ctx.uid, gid

    def _masked(self, mode: int) -> int:
        """A new file's or directory's permission bits, less the mount's umask."""
        return mode & 0o7777 & ~self.cfg.file_umask

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.ino
        attr.entry_timeout = attr.attr_timeout = self.cfg.cache_timeout
        attr.st_mode = node.mode
        attr.st_nlink = node.nlink
        attr.st_uid, attr.st_gid = node.uid, node.gid
        attr.st_rdev = node.rdev
        attr.st_size, attr.st_blocks = self.objects.size(node)
        attr.st_blksize = 4096
        attr.st_atime_ns, attr.st_mtime_ns = node.atime_ns, node.mtime_ns
        attr.st_ctime_ns = node.ctime_ns
        return attr

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        """A reply that hands the kernel a reference to the node (a lookup it will forget)."""
        node.lookups += 1
        return self._attrs(node)

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

    # -- names ------------------------------------------------------------------------------

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        try:
            return self._lookup(parent_inode, name)
        except NeedsIO:  # shared: a name the index lacks may be on the backing directory
            parent = self._dir(parent_inode)
            node = await self.objects.fall_through(parent, name)
            return self._miss(parent, name) if node is None else self._entry(node)

    def _lookup(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes:
        """LOOKUP from memory, without waiting on anything: a session may answer it inline
        (``lookup_now``, timed, set in __init__). On a shared mount a name the index lacks
        raises NeedsIO: ``lookup`` then looks on the backing directory."""
        if parent_inode == control.DIR_INO or (parent_inode == ROOT_INO and name == control.NAME):
            ino = control.DIR_INO if parent_inode == ROOT_INO else control.FILES.get(name)
            if ino is None:
                raise FUSEError(errno.ENOENT)
            return control.attrs(ino, self.cfg.cache_timeout)
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
            if self.cfg.shared is not None:
                raise NeedsIO()
            return self._miss(parent, name)
        return self._entry(node)

    def _miss(self, parent: Node, name: bytes) -> pyfuse3.EntryAttributes:
        """A negative entry: the kernel caches the miss, so repeated exists() on a cold cache
        never reach the daemon. Every create here goes through us and replaces it; on a
        shared mount another host may publish the name any moment: cached briefly."""
        self.lookups.miss(parent, name)
        miss = pyfuse3.EntryAttributes()
        miss.st_ino = 0
        shared = self.cfg.shared is not None
        miss.entry_timeout = (
            min(self.cfg.cache_timeout, MISS_TIMEOUT) if shared else (self.cfg.cache_timeout)
        )
        return miss

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        self.forget_now(inode_list)

    def forget_now(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.index.forget(ino, count)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._getattr(inode)

    def _getattr(self, inode: int) -> pyfuse3.EntryAttributes:
        """GETATTR from memory, without waiting on anything (see `_lookup`)."""
        if control.is_control(inode):
            return control.attrs(inode, self.cfg.cache_timeout)
        return self._attrs(self._node(inode))

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._new_dir(parent_inode, name)
        mode = stat.S_IFDIR | self._masked(mode) | (parent.mode & stat.S_ISGID)  # as ext4 does

        def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
            return self.objects.store.mkdir(rel, mode, uid, gid)

        return self._entry(
            await self.objects.make_node(parent, name, make, self._owner(parent, ctx))
        )

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.objects.rmdir(self._dir(parent_inode), name)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.objects.unlink(self._dir(parent_inode), name)

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
        new_parent = self._new_dir(parent_inode_new, name_new)
        noreplace = bool(flags & pyfuse3.RENAME_NOREPLACE)
        await self.objects.rename(old_parent, name_old, new_parent, name_new, noreplace)
        self.lookups.made(new_parent, name_new)

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        new_parent = self._new_dir(new_parent_inode, new_name)
        if node.is_dir:
            raise FUSEError(errno.EPERM)
        await self.objects.link(node, new_parent, new_name)
        self.lookups.made(new_parent, new_name)
        return self._entry(node)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Symlinks are kept in the backing directory like anything else (the kernel follows
        them, and gives ELOOP); they are not chunks: no checksum, never evicted."""
        parent = self._new_dir(parent_inode, name)
        if len(target) >= PATH_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        make = partial(self.objects.store.symlink, target)
        owner = self._owner(parent, ctx)
        return self._entry(await self.objects.make_node(parent, name, make, owner, target))

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
        parent = self._new_dir(parent_inode, name)
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFREG):
            raise FUSEError(errno.EINVAL)

        def make(rel: bytes, uid: int, gid: int) -> os.stat_result:
            return self.objects.store.mknod(rel, kind | self._masked(mode), rdev, uid, gid)

        return self._entry(
            await self.objects.make_node(parent, name, make, self._owner(parent, ctx))
        )

    # -- directories ------------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode == control.DIR_INO:
            return self.handles.open_dir(list(control.FILES.items()))
        node = self._dir(inode)
        assert node.children is not None
        return self.handles.open_dir(sorted(node.children.items()))

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self.handles.listing(fh)
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            if isinstance(node, int):  # a control file
                if not self.session.readdir_reply(token, name, control.attrs(node, 1), i + 1):
                    break
                continue
            if not node.attached:
                continue
            if not self.session.readdir_reply(token, name, self._attrs(node), i + 1):
                break
            node.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self.handles.close_dir(fh)

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
        self.lookups.made(parent, name)
        handle = Handle(node, True, process.thread_group(ctx.pid), passthrough=passthrough)
        return self._file_info(handle), self._entry(node)

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
        # While the kernel passes an inode through, it fails any other open that does not (EIO):
        # a file written in passthrough is opened so by all (``_file_info``); a published one
        # by readers once it is verified (--verify first-read), unless the daemon serves a
        # handle of it or it was published again in place (the page cache may hold another
        # version). A writer of a published file is served: none may pass through meanwhile.
        if flags & os.O_ACCMODE != os.O_RDONLY:
            if node.passthrough_opens and self.objects.passthrough_fd(node) is None:
                raise FUSEError(errno.ETXTBSY)
            await self.objects.open_write(node, bool(flags & os.O_TRUNC))
            handle = Handle(node, True, process.thread_group(ctx.pid), passthrough=True)
            return self._file_info(handle)
        passthrough = sessions.passthrough(self.session) and (
            node.passthrough_opens > 0
            or (
                self.cfg.verify == "first-read"
                and node.verified
                and not node.rewritten
                and node.open_count == 0
            )
        )
        handle = Handle(node, writable=False, passthrough=passthrough)
        published = node.on_backing and node.ino not in self.objects.writes  # as it stands
        if passthrough and published and sessions.holds_backing(self.session, node.ino):
            # The kernel still holds this version's backing file from an earlier open: the
            # reopen of a hot chunk costs no I/O, here or in the kernel.
            self.objects.count_read(node)
            if node.parent is not None:
                self.lookups.hit(node.parent)
            fh = self.handles.open_file(handle)
            return PassthroughFileInfo(fh, keep_cache=True, reuse=True)
        handle.reader = await self.objects.open_read(node, passthrough)
        if handle.reader is not None and not handle.reader.unpublished and node.parent:
            self.lookups.hit(node.parent)
        # O_DIRECT needs nothing special: the kernel bypasses its cache for that file descriptor
        # and sends READs of up to 1 MiB, each answered in full from the verified buffer. A file
        # published again in place is read past the page cache, which holds one version only.
        return self._file_info(handle, keep_cache=not node.rewritten)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        if fh in self.batch_lookups.handles:
            return await self.batch_lookups.read(fh, off, size)
        content = self.handles.control(fh)
        if content is not None:
            return content[off : off + size]
        handle = self.handles.file(fh)
        reader = handle.reader
        if handle.writable or reader is None or reader.unpublished:  # opened while written
            unpublished = await self.objects.read_unpublished(handle.node, off, size)
            if unpublished is not None:
                return unpublished
        if handle.content is None:
            handle.content = self.objects.start_detached(
                partial(self.objects.load, handle.node, handle.reader)
            )
        handle.reader, content = await self.objects.wait(handle.content)
        return content.read(off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if fh in self.batch_lookups.handles:
            return self.batch_lookups.write(fh, off, buf)
        handle = self.handles.file(fh)
        if not handle.writable:
            raise FUSEError(errno.EBADF)
        await self.objects.write(handle.node, off, buf)
        return len(buf)

    async def flush(self, fh: int) -> None:
        """close(): where a written file's errors (ENOSPC, EIO) can still reach the writer."""
        if self.handles.control(fh) is not None or fh in self.batch_lookups.handles:
            return
        handle = self.handles.file(fh)
        if handle.writable:
            await self.objects.close_write(handle.node, handle.opener)

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

    async def _close_reader(self, handle: Handle) -> None:
        if handle.content is not None:
            try:
                handle.reader, content = await handle.content.wait()
                content.release()
            except Exception:  # a failed load holds no buffer
                pass
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
        if mode is not None or owner is not None or times is not None:
            await self.objects.set_attrs(node, mode, owner, times)
        return self._attrs(node)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The capacity and what is free within it (never more than the disk has left)."""
        space = await self.objects.space()
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = ALIGN
        # df's Used is blocks - bfree: kvfs's own usage. Avail is what a writer can still get,
        # which the disk may cap below the capacity (other data on it).
        out.f_blocks, out.f_bfree, out.f_bavail = (n // ALIGN for n in space[:3])
        out.f_files, out.f_ffree, out.f_favail = space[3:]
        out.f_namemax = layout.NAME_MAX
        return out

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
