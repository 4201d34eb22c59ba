"""The FUSE front end's namespace requests: lookups, directories and the names in them.

Each request checks its inputs, asks the object layer (mount/objects.py), and answers with the
node's attributes (mount/attributes.py); every reply that hands the kernel a node counts a
lookup it will forget. The files' requests, attributes and xattrs: mount/operations.py.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from functools import partial

import pyfuse3
from pyfuse3 import FUSEError

from kvfs import layout
from kvfs.config import MountConfig
from kvfs.index import ROOT_INO, Index, Node
from kvfs.mount import attributes, control
from kvfs.mount.bridge import NeedsIO
from kvfs.mount.handles import Handles
from kvfs.mount.kernel_session import FuseSession
from kvfs.mount.lookups import FastMisses, LookupCounts
from kvfs.mount.objects import Objects
from kvfs.mount.shared import MISS_TIMEOUT


class NameRequests(pyfuse3.Operations):
    """Lookups, directories and names; KvfsOperations (operations.py) builds what they use."""

    cfg: MountConfig
    index: Index
    session: FuseSession
    objects: Objects
    handles: Handles
    lookups: LookupCounts
    fast_misses: FastMisses | None

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
        return attributes.of_node(node, self.objects.size(node), self.cfg.cache_timeout)

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        """A reply that hands the kernel a reference to the node (a lookup it will forget)."""
        node.lookups += 1
        return self._attrs(node)

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
        node = self.index.child(parent, name)  # the common case first: a hit, or a miss
        if node is not None:
            return self._entry(node)
        if len(name) > layout.NAME_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            return self._entry(parent)
        if name == b"..":
            return self._entry(parent.parent or parent)
        if self.cfg.shared is not None:
            raise NeedsIO()
        return self._miss(parent, name)

    def _miss(self, parent: Node, name: bytes) -> pyfuse3.EntryAttributes:
        """A negative entry: the kernel caches the miss, so repeated exists() on a cold cache
        never reach the daemon. Every create here goes through us and replaces it; on a
        shared mount another host may publish the name any moment: cached briefly."""
        self.lookups.miss(parent, name)
        if self.fast_misses is not None:  # the next ones here: answered in C
            self.fast_misses.register(parent)
        shared = self.cfg.shared is not None
        return attributes.negative(
            min(self.cfg.cache_timeout, MISS_TIMEOUT) if shared else self.cfg.cache_timeout
        )

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.forget_now(inode_list)

    def forget_now(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.index.forget(ino, count)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent, mode, owner = self._mkdir_args(parent_inode, name, mode, ctx)
        return self._entry(await self.objects.mkdir(parent, name, mode, owner))

    def _mkdir_now(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """MKDIR from memory, in the kernel session's receive loop (``Objects.mkdir_now``)."""
        parent, mode, owner = self._mkdir_args(parent_inode, name, mode, ctx)
        return self._entry(self.objects.mkdir_now(parent, name, mode, owner))

    def _mkdir_args(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> tuple[Node, int, tuple[int, int]]:
        parent = self._new_dir(parent_inode, name)
        mode = stat.S_IFDIR | self._masked(mode) | (parent.mode & stat.S_ISGID)  # as ext4 does
        return parent, mode, self._owner(parent, ctx)

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
        old_parent, new_parent, noreplace = self._rename_args(
            parent_inode_old, parent_inode_new, name_new, flags
        )
        await self.objects.rename(old_parent, name_old, new_parent, name_new, noreplace)
        self.lookups.made(new_parent, name_new)

    def _rename_now(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
    ) -> None:
        """RENAME from memory, in the kernel session's receive loop: a file not published yet
        to a free name (``Objects.rename_now``); NeedsIO for any other."""
        old_parent, new_parent, noreplace = self._rename_args(
            parent_inode_old, parent_inode_new, name_new, flags
        )
        self.objects.rename_now(old_parent, name_old, new_parent, name_new, noreplace)
        self.lookups.made(new_parent, name_new)

    def _rename_args(
        self, parent_inode_old: int, parent_inode_new: int, name_new: bytes, flags: int
    ) -> tuple[Node, Node, bool]:
        """A rename's directories, checked, and whether it may replace what it finds."""
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise FUSEError(errno.EINVAL)
        old_parent = self._dir(parent_inode_old)
        new_parent = self._new_dir(parent_inode_new, name_new)
        return old_parent, new_parent, bool(flags & pyfuse3.RENAME_NOREPLACE)

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
        if len(target) >= layout.PATH_MAX:
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
