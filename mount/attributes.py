"""What the kernel is told about a node, and what a SETATTR asks to change: the
translation between the index's nodes and FUSE's attribute structures (both sessions take
pyfuse3's). The control files' own attributes are control.py's."""

from __future__ import annotations

import pyfuse3

from kvfs import layout
from kvfs.buffers import ALIGN
from kvfs.index import Node

Changes = tuple[int | None, tuple[int, int] | None, tuple[int, int] | None]


def of_node(node: Node, size: tuple[int, int], timeout: float) -> pyfuse3.EntryAttributes:
    """``size``: the size and 512-byte blocks to show (a file being written shows its
    buffer's or temp file's, ``Objects.size``)."""
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = node.ino
    attr.entry_timeout = attr.attr_timeout = timeout
    attr.st_mode = node.mode
    attr.st_nlink = node.nlink
    attr.st_uid, attr.st_gid = node.uid, node.gid
    attr.st_rdev = node.rdev
    attr.st_size, attr.st_blocks = size
    attr.st_blksize = 4096
    attr.st_atime_ns, attr.st_mtime_ns = node.atime_ns, node.mtime_ns
    attr.st_ctime_ns = node.ctime_ns
    return attr


def negative(timeout: float) -> pyfuse3.EntryAttributes:
    """A negative entry: the kernel caches the miss for ``timeout`` seconds."""
    miss = pyfuse3.EntryAttributes()
    miss.st_ino = 0
    miss.entry_timeout = timeout
    return miss


def changes(node: Node, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields) -> Changes:
    """The mode, owner and times a SETATTR sets (None: left as they are); the size is
    the caller's (a truncate)."""
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
    return mode, owner, times


def statvfs(space: tuple[int, int, int, int, int, int]) -> pyfuse3.StatvfsData:
    """STATFS from ``Objects.space``: df's Used is blocks - bfree, kvfs's own usage; Avail
    is what a writer can still get, which the disk may cap below the capacity."""
    out = pyfuse3.StatvfsData()
    out.f_bsize = out.f_frsize = ALIGN
    out.f_blocks, out.f_bfree, out.f_bavail = (n // ALIGN for n in space[:3])
    out.f_files, out.f_ffree, out.f_favail = space[3:]
    out.f_namemax = layout.NAME_MAX
    return out
