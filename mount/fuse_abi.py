"""The FUSE kernel protocol, as the kernel session speaks it on /dev/fuse.

Written from the kernel's ``include/uapi/linux/fuse.h`` (protocol 7.42). Every message the
kernel sends starts with ``fuse_in_header``, followed by an opcode-specific struct and, for some
opcodes, NUL-terminated names or raw data; every reply starts with ``fuse_out_header``, whose
``error`` is 0 or a negative errno, followed by the opcode's out struct. Notifications are
replies with ``unique`` 0 and a notify code in ``error``.

The structs are ``struct.Struct`` formats in native byte order with standard sizes and no
implicit padding (``=``): the kernel's structs are 64-bit aligned by explicit padding fields, so
each format below lists every field, padding included, and its size is asserted against the
header. Fields the kernel declares ``uint64_t`` but reads as signed seconds (the times) are
packed signed, so that times before 1970 survive the trip.

Only what the session needs is here: the requests pyfuse3's operations handle, INIT, the
invalidation notifications and the passthrough ioctls.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag

# -- versions ---------------------------------------------------------------------------------

KERNEL_VERSION = 7
# The protocol this module describes. The session answers INIT with the lower of this and the
# kernel's minor: both sides then speak that one.
KERNEL_MINOR_VERSION = 42
# fuse_init_out has had its full 64-byte form since 7.23 (Linux 3.15). Older kernels expect a
# shorter reply and other compat sizes this session does not write: it refuses them at INIT.
MIN_KERNEL_MINOR = 23
# FUSE_PASSTHROUGH, max_stack_depth and fuse_open_out.backing_id arrived with 7.40 (Linux 6.9).
PASSTHROUGH_MINOR = 40

ROOT_ID = 1
# The kernel takes no larger read buffer guarantee than this; it also requires room for the
# largest WRITE (header, fuse_write_in and max_write bytes of data).
MIN_READ_BUFFER = 8192
# Longest name the kernel accepts in an entry notification (fs/fuse/fuse_i.h, not in the uapi).
NAME_MAX = 1024


class Opcode(IntEnum):
    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36  # no reply (unless EAGAIN: "ask again later")
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


class NotifyCode(IntEnum):
    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6
    RESEND = 7


class InitFlag(IntFlag):
    """INIT capability bits, as one 64-bit set.

    On the wire the low 32 bits are ``flags`` and the high 32 bits are ``flags2``, which the
    kernel only sends, and only reads back, when both sides set INIT_EXT.
    """

    ASYNC_READ = 1 << 0
    POSIX_LOCKS = 1 << 1
    FILE_OPS = 1 << 2
    ATOMIC_O_TRUNC = 1 << 3
    EXPORT_SUPPORT = 1 << 4
    BIG_WRITES = 1 << 5
    DONT_MASK = 1 << 6
    SPLICE_WRITE = 1 << 7
    SPLICE_MOVE = 1 << 8
    SPLICE_READ = 1 << 9
    FLOCK_LOCKS = 1 << 10
    HAS_IOCTL_DIR = 1 << 11
    AUTO_INVAL_DATA = 1 << 12
    DO_READDIRPLUS = 1 << 13
    READDIRPLUS_AUTO = 1 << 14
    ASYNC_DIO = 1 << 15
    WRITEBACK_CACHE = 1 << 16
    NO_OPEN_SUPPORT = 1 << 17
    PARALLEL_DIROPS = 1 << 18
    HANDLE_KILLPRIV = 1 << 19
    POSIX_ACL = 1 << 20
    ABORT_ERROR = 1 << 21
    MAX_PAGES = 1 << 22
    CACHE_SYMLINKS = 1 << 23
    NO_OPENDIR_SUPPORT = 1 << 24
    EXPLICIT_INVAL_DATA = 1 << 25
    MAP_ALIGNMENT = 1 << 26
    SUBMOUNTS = 1 << 27
    HANDLE_KILLPRIV_V2 = 1 << 28
    SETXATTR_EXT = 1 << 29
    INIT_EXT = 1 << 30
    INIT_RESERVED = 1 << 31
    # flags2, shifted up by 32
    SECURITY_CTX = 1 << 32
    HAS_INODE_DAX = 1 << 33
    CREATE_SUPP_GROUP = 1 << 34
    HAS_EXPIRE_ONLY = 1 << 35
    DIRECT_IO_ALLOW_MMAP = 1 << 36
    PASSTHROUGH = 1 << 37
    NO_EXPORT_SUPPORT = 1 << 38
    HAS_RESEND = 1 << 39
    ALLOW_IDMAP = 1 << 40
    OVER_IO_URING = 1 << 41


class OpenFlag(IntFlag):
    """``fuse_open_out.open_flags`` (FOPEN_*): how the kernel treats one open file."""

    DIRECT_IO = 1 << 0  # bypass the page cache
    KEEP_CACHE = 1 << 1  # keep cached pages from earlier opens
    NONSEEKABLE = 1 << 2
    CACHE_DIR = 1 << 3
    STREAM = 1 << 4
    NOFLUSH = 1 << 5
    PARALLEL_DIRECT_WRITES = 1 << 6
    PASSTHROUGH = 1 << 7  # reads, writes and mmap go to the backing file (backing_id)


class SetattrValid(IntFlag):
    """``fuse_setattr_in.valid`` (FATTR_*): which fields of a SETATTR mean something."""

    MODE = 1 << 0
    UID = 1 << 1
    GID = 1 << 2
    SIZE = 1 << 3
    ATIME = 1 << 4
    MTIME = 1 << 5
    FH = 1 << 6
    ATIME_NOW = 1 << 7
    MTIME_NOW = 1 << 8
    LOCKOWNER = 1 << 9
    CTIME = 1 << 10
    KILL_SUIDGID = 1 << 11


GETATTR_FH = 1 << 0  # fuse_getattr_in.getattr_flags: fh is valid
FSYNC_FDATASYNC = 1 << 0  # fuse_fsync_in.fsync_flags
RELEASE_FLUSH = 1 << 0  # fuse_release_in.release_flags
WRITE_CACHE = 1 << 0  # fuse_write_in.write_flags: delayed write from the page cache
EXPIRE_ONLY = 1 << 0  # fuse_notify_inval_entry_out.flags
UNIQUE_RESEND = 1 << 63  # high bit of unique on a resent request (HAS_RESEND only)

# -- structs ----------------------------------------------------------------------------------

# fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen (8-byte units), pad
IN_HEADER = struct.Struct("=IIQQIIIHH")
# fuse_out_header: len, error (0 or -errno; a notify code for notifications), unique
OUT_HEADER = struct.Struct("=IiQ")

# fuse_attr: ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode,
# nlink, uid, gid, rdev, blksize, flags
_ATTR = "QQQqqqIIIIIIIIII"
ATTR = struct.Struct("=" + _ATTR)
# fuse_entry_out: nodeid, generation, entry_valid, attr_valid, entry_valid_nsec,
# attr_valid_nsec, attr
ENTRY_OUT = struct.Struct("=QQQQII" + _ATTR)
# fuse_attr_out: attr_valid, attr_valid_nsec, dummy, attr
ATTR_OUT = struct.Struct("=QII" + _ATTR)

FORGET_IN = struct.Struct("=Q")  # nlookup
FORGET_ONE = struct.Struct("=QQ")  # nodeid, nlookup
BATCH_FORGET_IN = struct.Struct("=II")  # count, dummy; count FORGET_ONE follow
GETATTR_IN = struct.Struct("=IIQ")  # getattr_flags, dummy, fh
# fuse_setattr_in: valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec,
# mtimensec, ctimensec, mode, unused4, uid, gid, unused5
SETATTR_IN = struct.Struct("=IIQQQqqqIIIIIIII")
MKNOD_IN = struct.Struct("=IIII")  # mode, rdev, umask, padding; then name
MKDIR_IN = struct.Struct("=II")  # mode, umask; then name
RENAME_IN = struct.Struct("=Q")  # newdir; then oldname, newname
RENAME2_IN = struct.Struct("=QII")  # newdir, flags, padding; then oldname, newname
LINK_IN = struct.Struct("=Q")  # oldnodeid; then newname
OPEN_IN = struct.Struct("=II")  # flags, open_flags (FUSE_OPEN_KILL_SUIDGID)
CREATE_IN = struct.Struct("=IIII")  # flags, mode, umask, open_flags; then name
OPEN_OUT = struct.Struct("=QIi")  # fh, open_flags (FOPEN_*), backing_id
RELEASE_IN = struct.Struct("=QIIQ")  # fh, flags, release_flags, lock_owner
FLUSH_IN = struct.Struct("=QIIQ")  # fh, unused, padding, lock_owner
READ_IN = struct.Struct("=QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, pad
WRITE_IN = struct.Struct("=QQIIQII")  # fh, offset, size, write_flags, lock_owner, flags, pad
WRITE_OUT = struct.Struct("=II")  # size, padding
# fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding, spare[6]
STATFS_OUT = struct.Struct("=QQQQQIIII6I")
FSYNC_IN = struct.Struct("=QII")  # fh, fsync_flags, padding
# fuse_setxattr_in as sent unless SETXATTR_EXT was agreed (which adds two u32): size, flags
SETXATTR_IN = struct.Struct("=II")
GETXATTR_IN = struct.Struct("=II")  # size, padding; then name
GETXATTR_OUT = struct.Struct("=II")  # size, padding
ACCESS_IN = struct.Struct("=II")  # mask, padding
# fuse_init_in: major, minor, max_readahead, flags; from 7.36 also flags2 and unused[11]
INIT_IN = struct.Struct("=IIII")
INIT_IN_EXT = struct.Struct("=IIIII11I")
# fuse_init_out: major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, max_stack_depth, unused[6]
INIT_OUT = struct.Struct("=IIIIHHIIHHII6I")
INTERRUPT_IN = struct.Struct("=Q")  # unique of the interrupted request
# fuse_dirent: ino, off (the next entry's offset), namelen, type; then the name, padded to 8
DIRENT = struct.Struct("=QQII")
NOTIFY_INVAL_INODE_OUT = struct.Struct("=Qqq")  # ino, off (-1: attributes only), len (0: all)
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("=QII")  # parent, namelen, flags; then name, NUL
NOTIFY_DELETE_OUT = struct.Struct("=QQII")  # parent, child, namelen, padding; then name, NUL
BACKING_MAP = struct.Struct("=iIQ")  # fd, flags, padding


def _check_sizes() -> None:
    """The sizes fuse.h's structs have; a format that disagrees would corrupt every message."""
    expected = {
        IN_HEADER: 40,
        OUT_HEADER: 16,
        ATTR: 88,
        ENTRY_OUT: 128,
        ATTR_OUT: 104,
        SETATTR_IN: 88,
        OPEN_OUT: 16,
        RELEASE_IN: 24,
        FLUSH_IN: 24,
        READ_IN: 40,
        WRITE_IN: 40,
        STATFS_OUT: 80,
        INIT_IN_EXT: 64,
        INIT_OUT: 64,
        DIRENT: 24,
        NOTIFY_INVAL_INODE_OUT: 24,
        NOTIFY_INVAL_ENTRY_OUT: 16,
        NOTIFY_DELETE_OUT: 24,
        BACKING_MAP: 16,
    }
    for fmt, size in expected.items():
        assert fmt.size == size, (fmt.format, fmt.size, size)


_check_sizes()


def align8(size: int) -> int:
    """FUSE_REC_ALIGN: directory records are padded to 8 bytes."""
    return (size + 7) & ~7


# -- device ioctls ----------------------------------------------------------------------------

# asm-generic/ioctl.h: nr in bits 0-7, type in 8-15, size in 16-29, direction in 30-31.
_IOC_WRITE = 1
_IOC_READ = 2


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


DEV_IOC_MAGIC = 229
DEV_IOC_CLONE = _ioc(_IOC_READ, DEV_IOC_MAGIC, 0, 4)
# Register an open file as a passthrough backing file: returns its backing id (>= 1).
DEV_IOC_BACKING_OPEN = _ioc(_IOC_WRITE, DEV_IOC_MAGIC, 1, BACKING_MAP.size)
# Drop a backing id (a uint32 in memory); files opened with it keep their backing file.
DEV_IOC_BACKING_CLOSE = _ioc(_IOC_WRITE, DEV_IOC_MAGIC, 2, 4)
