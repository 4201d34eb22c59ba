"""KernelSession: kvfs's own FUSE session on /dev/fuse, passthrough included.

Each test mounts ``MemoryFS`` (below: a pyfuse3.Operations with its tree in memory and each
file's bytes in a real backing file under tmp_path) with a KernelSession served by trio in a
thread of this process, and drives it with real syscalls from the test. The operations count
their calls, so a test can tell what reached the daemon and what the kernel answered itself.

Read throughput of one 256 MiB file, read whole in 16 MiB reads: directly, through passthrough,
and served by this session's daemon (no passthrough, the kernel's default 128 KiB reads). GB/s,
median of 3, the range over three runs of ``python tests/test_kernel_session.py``; warm: in the
page cache, cold: after ``echo 3 > /proc/sys/vm/drop_caches``; 2 vCPUs, ext4 on virtio, other
test jobs running. pyfuse3 serving the same operations: 0.74-0.76 warm.

            plain       passthrough    served        passthrough / plain
    warm    4.8-5.3     5.0-5.3        0.71-0.76     0.96-1.09
    cold    1.16-1.25   1.09-1.40      0.40-0.54     0.94-1.12
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import os
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from kvfs.mount.fuse_abi import InitFlag
from kvfs.mount.kernel_session import (
    KernelSession,
    PassthroughFileInfo,
    ReaddirToken,
    RequestContext,
    SetattrFields,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
    ),
    pytest.mark.timeout(60),
]

ROOT = pyfuse3.ROOT_INODE
TIMEOUT = 300.0  # entries and attributes: cached by the kernel for the whole test
MiB = 1 << 20

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
libc.renameat2.argtypes += [ctypes.c_uint]
AT_FDCWD = -100


@dataclass
class Node:
    mode: int
    nlink: int = 1
    rdev: int = 0
    target: bytes = b""  # of a symlink
    data: Path | None = None  # a regular file's backing file
    children: dict[bytes, int] = field(default_factory=dict)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    times_ns: int = field(default_factory=time.time_ns)
    lookups: int = 0


class MemoryFS(pyfuse3.Operations):
    """A whole filesystem in one sitting: the tree in memory, file bytes in backing files.

    Opens answer with the backing file for passthrough unless ``passthrough`` is off; the
    names in ``slow`` and ``raising`` make ``lookup`` wait or raise.
    """

    enable_writeback_cache = False

    def __init__(self, backing: Path) -> None:
        super().__init__()
        self.backing = backing
        self.session: KernelSession
        self.nodes: dict[int, Node] = {ROOT: Node(stat.S_IFDIR | 0o755, nlink=2)}
        self.calls: Counter[str] = Counter()
        self.looked_up: Counter[bytes] = Counter()
        self.attr_reads: Counter[int] = Counter()  # getattr, by inode
        self.write_sizes: list[int] = []
        self.flush_callers: list[int] = []
        self.passthrough = True
        self.served: set[int] = set()  # inodes opened without passthrough regardless
        self.slow: dict[bytes, float] = {}
        self.raising: dict[bytes, BaseException] = {}
        self.idle_raises = False
        self.handles: dict[int, int] = {}  # fh: the backing file's fd
        self._next_ino = ROOT + 1
        self._next_fh = 1

    # -- the tree, for the tests ----------------------------------------------------------------

    def add(self, parent: int, name: bytes, mode: int, data: bytes | None = None) -> int:
        ino = self._next_ino
        self._next_ino += 1
        node = self.nodes[ino] = Node(mode, nlink=2 if stat.S_ISDIR(mode) else 1)
        if stat.S_ISREG(mode):
            node.data = self.backing / str(ino)
            node.data.write_bytes(data or b"")
        self.nodes[parent].children[name] = ino
        return ino

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        node = self.nodes[ino]
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.st_mode = node.mode
        entry.st_nlink = node.nlink
        entry.st_rdev = node.rdev
        entry.st_size = node.data.stat().st_size if node.data else len(node.target)
        entry.st_blocks = (entry.st_size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = node.times_ns
        entry.entry_timeout = entry.attr_timeout = TIMEOUT
        return entry

    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        self.nodes[ino].lookups += 1  # the kernel holds one more reference
        return self.attrs(ino)

    def _new(self, parent: int, name: bytes, mode: int, **fields: Any) -> pyfuse3.EntryAttributes:
        if name in self.nodes[parent].children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        ino = self.add(parent, name, mode)
        for key, value in fields.items():
            setattr(self.nodes[ino], key, value)
        return self._entry(ino)

    def _child(self, parent: int, name: bytes) -> int:
        ino = self.nodes[parent].children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return ino

    def _file_info(self, ino: int, fd: int) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = fd
        if self.passthrough and ino not in self.served:
            return PassthroughFileInfo(fh, backing_fd=fd)
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)  # served: every read reaches us

    # -- handlers -------------------------------------------------------------------------------

    def idle_now(self) -> None:
        self.calls["idle_now"] += 1
        if self.idle_raises:
            raise RuntimeError("a bug in the operations")

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        self.calls["lookup"] += 1
        self.looked_up[name] += 1
        if name in self.slow:
            await trio.sleep(self.slow[name])
        if name in self.raising:
            raise self.raising[name]
        ino = self.nodes[parent_inode].children.get(name)
        if ino is None:  # a miss the kernel may cache
            miss = pyfuse3.EntryAttributes()
            miss.st_ino = 0
            miss.entry_timeout = TIMEOUT
            return miss
        return self._entry(ino)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, nlookup in inode_list:
            if ino in self.nodes:
                self.nodes[ino].lookups -= nlookup

    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        self.calls["getattr"] += 1
        self.attr_reads[inode] += 1
        return self.attrs(inode)

    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.nodes[inode]
        if fields.update_size and node.data is not None:
            os.truncate(node.data, attr.st_size)
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_mtime:
            node.times_ns = attr.st_mtime_ns
        return self.attrs(inode)

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return self.nodes[inode].target

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._new(parent_inode, name, mode, rdev=rdev)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        self.nodes[parent_inode].nlink += 1
        return self._new(parent_inode, name, mode)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._new(parent_inode, name, stat.S_IFLNK | 0o777, target=target)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        ino = self._child(parent_inode, name)
        del self.nodes[parent_inode].children[name]
        self.nodes[ino].nlink -= 1

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        ino = self._child(parent_inode, name)
        if self.nodes[ino].children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del self.nodes[parent_inode].children[name]
        self.nodes[parent_inode].nlink -= 1

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Any,
    ) -> None:
        old, new = self.nodes[parent_inode_old], self.nodes[parent_inode_new]
        moving = self._child(parent_inode_old, name_old)
        replaced = new.children.get(name_new)
        if flags & pyfuse3.RENAME_NOREPLACE and replaced is not None:
            raise pyfuse3.FUSEError(errno.EEXIST)
        if flags & pyfuse3.RENAME_EXCHANGE:
            if replaced is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            old.children[name_old] = replaced
        else:
            del old.children[name_old]
        new.children[name_new] = moving

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        self.nodes[new_parent_inode].children[new_name] = inode
        self.nodes[inode].nlink += 1
        return self._entry(inode)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        self.calls["open"] += 1
        data = self.nodes[inode].data
        assert data is not None
        return self._file_info(inode, os.open(data, os.O_RDWR | (flags & os.O_TRUNC)))

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self.calls["create"] += 1
        entry = self._new(parent_inode, name, mode)
        data = self.nodes[entry.st_ino].data
        assert data is not None
        return self._file_info(entry.st_ino, os.open(data, os.O_RDWR)), entry

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.calls["read"] += 1
        return os.pread(self.handles[fh], size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.calls["write"] += 1
        self.write_sizes.append(len(buf))
        return os.pwrite(self.handles[fh], buf, off)

    async def flush(self, fh: int, caller: int = 0) -> None:
        self.calls["flush"] += 1
        self.flush_callers.append(caller)

    async def release(self, fh: int) -> None:
        self.calls["release"] += 1
        os.close(self.handles.pop(fh))

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.calls["fsync"] += 1
        os.fsync(self.handles[fh])

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        self.calls["readdir"] += 1
        entries = sorted(self.nodes[fh].children.items())
        for i, (name, ino) in enumerate(entries[start_id:], start_id):
            if not self.session.readdir_reply(token, name, self.attrs(ino), i + 1):
                return
            self.nodes[ino].lookups += 1

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = 4096
        out.f_blocks, out.f_bfree, out.f_bavail = 1000, 600, 500
        out.f_files, out.f_ffree, out.f_favail = 100, 40, 40
        out.f_namemax = 255
        return out

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        self.nodes[inode].xattrs[name] = value

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        try:
            return self.nodes[inode].xattrs[name]
        except KeyError:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return list(self.nodes[inode].xattrs)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        if self.nodes[inode].xattrs.pop(name, None) is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)


# -- mounting -----------------------------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@contextmanager
def serving(ops: MemoryFS, mountpoint: Path, **kwargs: Any) -> Iterator[KernelSession]:
    """Mount ``ops`` with a KernelSession served in a thread; always unmounted afterwards."""
    session = KernelSession(**kwargs)
    ops.session = session
    session.init(ops, mountpoint, {"default_permissions", "fsname=kvfs-test"})
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            trio.run(session.main)
        except BaseException as err:
            failures.append(err)

    thread = threading.Thread(target=serve, name="kernel-session", daemon=True)
    thread.start()
    try:
        yield session
    finally:
        session.terminate()
        thread.join(10)
        if thread.is_alive():  # a handler hangs: end its request, and with it the loop
            session.abort()
            thread.join(10)
        session.close(unmount=True)
        if is_mounted(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    assert not thread.is_alive(), "the session did not stop"
    assert not failures, failures
    assert not is_mounted(mountpoint)


@pytest.fixture
def fs(tmp_path: Path) -> MemoryFS:
    (tmp_path / "backing").mkdir()
    return MemoryFS(tmp_path / "backing")


@pytest.fixture
def mnt(fs: MemoryFS, tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with serving(fs, mountpoint):
        yield mountpoint


def in_thread(fn: Any, *args: Any) -> None:
    """Run a notification off the test's thread, as the daemon does."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


def quietly(fn: Any, *args: Any) -> None:
    """Call ``fn``; an OSError is an answer too."""
    with suppress(OSError):
        fn(*args)


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the session --------------------------------------------------------------------------------


def test_init_agrees_on_the_protocol_before_returning(fs: MemoryFS, mnt: Path) -> None:
    session = fs.session
    assert session.proto_minor >= 31
    for flag in (InitFlag.DO_READDIRPLUS, InitFlag.PARALLEL_DIROPS, InitFlag.MAX_PAGES):
        assert flag in session.flags
    assert InitFlag.READDIRPLUS_AUTO not in session.flags
    assert InitFlag.WRITEBACK_CACHE not in session.flags
    assert session.passthrough == (InitFlag.PASSTHROUGH in session.kernel_flags)
    assert session.max_readahead > 0
    line = next(x for x in Path("/proc/self/mountinfo").read_text().splitlines() if str(mnt) in x)
    assert " - fuse.kvfs kvfs-test " in line
    assert "default_permissions" in line and "nosuid" in line and "nodev" in line


def test_unknown_mount_option_mounts_nothing(fs: MemoryFS, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="unknown FUSE mount option"):
        KernelSession().init(fs, tmp_path, {"no_such_option"})
    assert not is_mounted(tmp_path)


def test_main_returns_when_the_mount_goes_away(fs: MemoryFS, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    session = KernelSession()
    session.init(fs, mountpoint, pyfuse3.default_options)
    fs.session = session
    thread = threading.Thread(target=trio.run, args=(session.main,), daemon=True)
    thread.start()
    try:
        assert os.listdir(mountpoint) == []
        subprocess.run(["umount", str(mountpoint)], check=True)
        thread.join(10)
        assert not thread.is_alive()  # ENODEV ended main()
    finally:
        session.terminate()
        thread.join(10)
        session.close(unmount=True)  # not ours any more: nothing to unmount
        if is_mounted(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
    assert not is_mounted(mountpoint)


def test_lookup_getattr_and_a_cached_miss(fs: MemoryFS, mnt: Path) -> None:
    fs.add(ROOT, b"f", stat.S_IFREG | 0o640, b"12345")
    st = os.stat(mnt / "f")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_size == 5 and st.st_nlink == 1
    assert st.st_mtime_ns == fs.nodes[st.st_ino].times_ns

    for _ in range(3):
        assert not os.path.exists(mnt / "missing")
    assert fs.looked_up[b"missing"] == 1  # the negative entry is cached for its timeout
    (mnt / "missing").write_bytes(b"x")  # a create through the mount replaces the miss
    assert (mnt / "missing").read_bytes() == b"x"


def test_names_directories_links_and_special_files(fs: MemoryFS, mnt: Path) -> None:
    (mnt / "d").mkdir(mode=0o750)
    assert stat.S_ISDIR(os.stat(mnt / "d").st_mode)
    assert os.stat(mnt).st_nlink == 3
    (mnt / "d" / "f").write_bytes(b"data")
    with pytest.raises(OSError) as err:
        (mnt / "d").rmdir()
    assert err.value.errno == errno.ENOTEMPTY

    os.rename(mnt / "d" / "f", mnt / "g")
    assert os.listdir(mnt / "d") == [] and (mnt / "g").read_bytes() == b"data"
    (mnt / "d").rmdir()
    assert not (mnt / "d").exists()

    os.link(mnt / "g", mnt / "h")
    assert os.stat(mnt / "g").st_nlink == 2
    assert os.stat(mnt / "g").st_ino == os.stat(mnt / "h").st_ino
    os.unlink(mnt / "h")
    assert not (mnt / "h").exists()

    os.symlink("g", mnt / "s")
    assert os.readlink(mnt / "s") == "g"
    assert (mnt / "s").read_bytes() == b"data"

    os.mkfifo(mnt / "fifo", 0o600)
    assert stat.S_ISFIFO(os.lstat(mnt / "fifo").st_mode)
    os.mknod(mnt / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert os.lstat(mnt / "null").st_rdev == os.makedev(1, 3)

    (mnt / "t").write_bytes(b"other")
    renameat2 = libc.renameat2
    noreplace, exchange = pyfuse3.RENAME_NOREPLACE, pyfuse3.RENAME_EXCHANGE
    assert renameat2(AT_FDCWD, bytes(mnt / "g"), AT_FDCWD, bytes(mnt / "t"), noreplace) == -1
    assert ctypes.get_errno() == errno.EEXIST
    assert renameat2(AT_FDCWD, bytes(mnt / "g"), AT_FDCWD, bytes(mnt / "t"), exchange) == 0
    assert (mnt / "g").read_bytes() == b"other" and (mnt / "t").read_bytes() == b"data"


def test_setattr_reaches_the_operations(fs: MemoryFS, mnt: Path) -> None:
    (mnt / "f").write_bytes(b"0123456789")
    os.truncate(mnt / "f", 4)
    assert (mnt / "f").read_bytes() == b"0123"
    os.chmod(mnt / "f", 0o600)
    os.utime(mnt / "f", ns=(10**18, 2 * 10**18 + 5))
    st = os.stat(mnt / "f")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == 2 * 10**18 + 5


def test_served_create_write_read_flush_release(fs: MemoryFS, mnt: Path) -> None:
    fs.passthrough = False
    data = os.urandom(3 * MiB + 123)
    with open(mnt / "f", "wb", buffering=0) as f:
        assert f.write(data) == len(data)
    assert fs.calls["create"] == 1 and fs.calls["flush"] >= 1
    assert set(fs.flush_callers) == {threading.get_native_id()}  # the thread that closed
    assert max(fs.write_sizes) == MiB  # max_write and max_pages were agreed
    assert (fs.backing / str(os.stat(mnt / "f").st_ino)).read_bytes() == data
    assert (mnt / "f").read_bytes() == data
    assert fs.calls["read"] > 0
    with open(mnt / "f", "r+b") as f:
        f.write(b"xyz")
        f.flush()
        os.fsync(f.fileno())
    assert fs.calls["fsync"] == 1
    wait_for(lambda: fs.calls["release"] == 3 and not fs.handles)
    assert fs.session.backings == 0


def test_readdir_of_a_thousand_entries_with_readdirplus(fs: MemoryFS, mnt: Path) -> None:
    d = fs.add(ROOT, b"d", stat.S_IFDIR | 0o755)
    names = sorted(f"entry-{i:04d}" for i in range(1000))
    for name in names:
        fs.add(d, name.encode(), stat.S_IFREG | 0o644, b"")
    assert sorted(os.listdir(mnt / "d")) == names

    lookups = fs.calls["lookup"]
    with os.scandir(mnt / "d") as entries:
        seen = {e.name: (e.is_file(follow_symlinks=False), e.stat().st_ino) for e in entries}
    assert set(seen) == set(names)
    by_name = {n.decode(): ino for n, ino in fs.nodes[d].children.items()}
    assert all(kind and ino == by_name[name] for name, (kind, ino) in seen.items())
    # READDIRPLUS carried every entry's attributes: stat needed no LOOKUP and no GETATTR.
    assert fs.calls["lookup"] == lookups
    assert not any(fs.attr_reads[ino] for ino in by_name.values())

    listing = subprocess.run(["ls", "-l", str(mnt / "d")], capture_output=True, text=True)
    assert listing.returncode == 0
    assert len(listing.stdout.splitlines()) == 1001  # "total" and one line per entry


def test_extended_attributes_and_the_size_probe(fs: MemoryFS, mnt: Path) -> None:
    path = mnt / "f"
    path.write_bytes(b"")
    value = os.urandom(1000)
    os.setxattr(path, "user.big", value)
    os.setxattr(path, "user.small", b"v")
    assert os.getxattr(path, "user.big") == value  # os.getxattr retries past ERANGE
    assert sorted(os.listxattr(path)) == ["user.big", "user.small"]

    raw, name = bytes(path), b"user.big"
    assert libc.getxattr(raw, name, None, 0) == 1000  # size 0: how large it is
    buf = ctypes.create_string_buffer(10)
    assert libc.getxattr(raw, name, buf, 10) == -1 and ctypes.get_errno() == errno.ERANGE
    names = b"user.big\0user.small\0"
    assert libc.listxattr(raw, None, 0) == len(names)
    assert libc.listxattr(raw, buf, 10) == -1 and ctypes.get_errno() == errno.ERANGE

    with pytest.raises(OSError) as err:
        os.getxattr(path, "user.none")
    assert err.value.errno == errno.ENODATA
    with pytest.raises(OSError) as err:
        os.setxattr(path, "user.small", b"w", os.XATTR_CREATE)
    assert err.value.errno == errno.EEXIST
    with pytest.raises(OSError) as err:
        os.setxattr(path, "user.none", b"w", os.XATTR_REPLACE)
    assert err.value.errno == errno.ENODATA
    os.removexattr(path, "user.small")
    assert os.listxattr(path) == ["user.big"]


def test_statfs(mnt: Path) -> None:
    st = os.statvfs(mnt)
    assert (st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail) == (
        4096,
        4096,
        1000,
        600,
        500,
    )
    assert (st.f_files, st.f_ffree, st.f_namemax) == (100, 40, 255)
    df = subprocess.run(["df", "-k", str(mnt)], capture_output=True, text=True, check=True)
    assert df.stdout.splitlines()[1].split()[:4] == ["kvfs-test", "4000", "1600", "2000"]


def test_errors_reach_the_caller_and_a_bug_fails_one_request(fs: MemoryFS, mnt: Path) -> None:
    fs.raising[b"rofs"] = pyfuse3.FUSEError(errno.EROFS)
    fs.raising[b"nospc"] = OSError(errno.ENOSPC, "disk full")
    fs.raising[b"bug"] = RuntimeError("a bug in the operations")
    fs.raising[b"bad"] = pyfuse3.FUSEError(100000)  # not an errno: EIO
    for name, expected in (
        ("rofs", errno.EROFS),
        ("nospc", errno.ENOSPC),
        ("bug", errno.EIO),
        ("bad", errno.EIO),
    ):
        with pytest.raises(OSError) as err:
            os.stat(mnt / name)
        assert err.value.errno == expected, name
    assert fs.session.stats.errors[errno.EIO] >= 2
    (mnt / "after").write_bytes(b"still serving")
    assert (mnt / "after").read_bytes() == b"still serving"


def test_idle_now_runs_between_requests_and_a_bug_in_it_stops_nothing(
    fs: MemoryFS, mnt: Path
) -> None:
    fs.add(ROOT, b"f", stat.S_IFREG | 0o644)
    fs.idle_raises = True
    calls = fs.calls["idle_now"]
    names = (f"missing-{i}" for i in itertools.count())

    def another_miss_and_idle_again() -> bool:
        assert not os.path.exists(mnt / next(names))  # one request each (a new name)
        return fs.calls["idle_now"] >= calls + 2  # it raised, and was called again

    wait_for(another_miss_and_idle_again)
    assert os.stat(mnt / "f").st_size == 0  # still serving


def test_a_waiting_handler_does_not_hold_up_others(fs: MemoryFS, mnt: Path) -> None:
    fs.add(ROOT, b"slow", stat.S_IFREG | 0o644)
    fs.add(ROOT, b"fast", stat.S_IFREG | 0o644)
    fs.slow[b"slow"] = 1.0
    slow = threading.Thread(target=os.stat, args=(mnt / "slow",))
    slow.start()
    wait_for(lambda: fs.looked_up[b"slow"] == 1)
    start = time.monotonic()
    os.stat(mnt / "fast")  # a lookup in the same directory, meanwhile (PARALLEL_DIROPS)
    assert time.monotonic() - start < 0.5
    assert slow.is_alive()
    slow.join(5)


def test_invalidations_from_a_thread(fs: MemoryFS, mnt: Path) -> None:
    session = fs.session
    ino = fs.add(ROOT, b"f", stat.S_IFREG | 0o644, b"abc")
    for _ in range(2):
        assert os.access(mnt / "f", os.R_OK)
    assert fs.looked_up[b"f"] == 1
    in_thread(session.invalidate_entry, ROOT, b"f")
    assert os.access(mnt / "f", os.R_OK)
    assert fs.looked_up[b"f"] == 2  # the kernel asked again

    for _ in range(2):
        assert not os.access(mnt / "ghost", os.F_OK)
    in_thread(session.invalidate_entry, ROOT, b"ghost")  # a cached miss goes too
    assert not os.access(mnt / "ghost", os.F_OK)
    assert fs.looked_up[b"ghost"] == 2

    fs.nodes[ino].mode = stat.S_IFREG | 0o600  # changed behind the kernel's back
    assert stat.S_IMODE(os.stat(mnt / "f").st_mode) == 0o644  # cached
    in_thread(session.invalidate_inode, ino, True)
    assert stat.S_IMODE(os.stat(mnt / "f").st_mode) == 0o600

    del fs.nodes[ROOT].children[b"f"]  # evicted behind the kernel's back
    in_thread(session.invalidate_entry, ROOT, b"f", ino)
    assert not (mnt / "f").exists()

    with pytest.raises(OSError) as err:
        in_thread(session.invalidate_inode, 999_999)
    assert err.value.errno == errno.ENOENT


def test_close_frees_a_notification_stuck_behind_a_request_that_never_ends(
    fs: MemoryFS, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    fs.slow[b"hang"] = 3600.0
    with serving(fs, mountpoint, drain_timeout=0.2) as session:
        caller = threading.Thread(target=quietly, args=(os.stat, mountpoint / "hang"))
        caller.start()
        wait_for(lambda: fs.looked_up[b"hang"] == 1)
        # The lookup holds the directory; dropping a name in it waits for that lookup.
        notifier = threading.Thread(target=quietly, args=(session.invalidate_entry, ROOT, b"x"))
        notifier.start()
        time.sleep(0.2)
        assert notifier.is_alive()
    # main() gave the lookup up after drain_timeout; close() aborted the connection, which
    # ended the lookup and so let the notification through.
    caller.join(5)
    notifier.join(5)
    assert not caller.is_alive() and not notifier.is_alive()


# -- passthrough --------------------------------------------------------------------------------


@pytest.fixture
def passthrough(fs: MemoryFS, mnt: Path) -> Path:
    if not fs.session.passthrough:
        pytest.skip("the kernel offers no FUSE passthrough")
    return mnt


def test_passthrough_reads_never_reach_the_daemon(fs: MemoryFS, passthrough: Path) -> None:
    data = os.urandom(16 * MiB)
    fs.add(ROOT, b"big", stat.S_IFREG | 0o644, data)
    assert (passthrough / "big").read_bytes() == data
    with open(passthrough / "big", "rb") as f:
        f.seek(5 * MiB + 7)
        assert f.read(MiB) == data[5 * MiB + 7 : 6 * MiB + 7]
        import mmap

        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert mapped[-4096:] == data[-4096:]
    assert fs.calls["open"] == 2 and fs.calls["read"] == 0
    assert fs.session.stats.passthrough_opens == 2
    wait_for(lambda: fs.session.backings == 0 and not fs.handles)


def test_passthrough_writes_land_in_the_backing_file(fs: MemoryFS, passthrough: Path) -> None:
    data = os.urandom(4 * MiB)
    with open(passthrough / "w", "wb") as f:
        f.write(data)
    ino = os.stat(passthrough / "w").st_ino
    assert os.stat(passthrough / "w").st_size == len(data)
    assert (fs.backing / str(ino)).read_bytes() == data
    assert fs.calls["create"] == 1 and fs.calls["write"] == 0


def test_opens_of_one_inode_share_its_backing_file(fs: MemoryFS, passthrough: Path) -> None:
    data = os.urandom(MiB)
    fs.add(ROOT, b"f", stat.S_IFREG | 0o644, data)
    with open(passthrough / "f", "rb") as one, open(passthrough / "f", "rb") as two:
        assert fs.session.backings == 1  # the kernel refuses a second backing per inode
        assert one.read() == data and two.read() == data
    wait_for(lambda: fs.session.backings == 0)
    assert fs.calls["read"] == 0


def test_another_backing_file_for_an_open_inode_fails_that_open_only(
    fs: MemoryFS, passthrough: Path
) -> None:
    old, new = os.urandom(MiB), os.urandom(MiB)
    ino = fs.add(ROOT, b"f", stat.S_IFREG | 0o644, old)
    first, second = fs.nodes[ino].data, fs.backing / "new-version"
    second.write_bytes(new)
    with open(passthrough / "f", "rb") as reader:
        fs.nodes[ino].data = second  # a new version while the old one is open
        with pytest.raises(OSError) as err, open(passthrough / "f", "rb"):
            pass
        assert err.value.errno == errno.EIO  # the kernel's rule: one backing file per inode
        fs.nodes[ino].data = first
        with open(passthrough / "f", "rb") as again:  # the inode's backing file is still known
            assert again.read() == old
        assert reader.read() == old
    wait_for(lambda: fs.session.backings == 0 and not fs.handles)


def test_served_when_the_operations_give_no_backing_file(fs: MemoryFS, passthrough: Path) -> None:
    data = os.urandom(2 * MiB)
    fs.add(ROOT, b"f", stat.S_IFREG | 0o644, data)
    fs.passthrough = False
    assert (passthrough / "f").read_bytes() == data
    assert fs.calls["read"] > 0 and fs.session.stats.served_opens == 1


def test_served_when_the_backing_file_is_on_a_stacked_filesystem(
    fs: MemoryFS, passthrough: Path, tmp_path: Path
) -> None:
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "overlay")}
    for path in layers.values():
        path.mkdir()
    data = os.urandom(2 * MiB)
    (layers["lower"] / "f").write_bytes(data)
    options = "lowerdir={lower},upperdir={upper},workdir={work}".format(**layers)
    overlay = layers["overlay"]
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(overlay)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount an overlay here")
    try:
        ino = fs.add(ROOT, b"f", stat.S_IFREG | 0o644)
        fs.nodes[ino].data = overlay / "f"  # overlayfs: one stack level too deep for FUSE
        assert (passthrough / "f").read_bytes() == data
        assert fs.calls["read"] > 0
        assert fs.session.stats.backing_refused == 1 and fs.session.passthrough
        wait_for(lambda: not fs.handles)
    finally:
        subprocess.run(["umount", "-l", str(overlay)], check=False)


def test_the_request_context_and_setattr_fields_read_like_pyfuse3s() -> None:
    ctx = RequestContext(uid=1, gid=2, pid=3, umask=0o22)
    assert (ctx.uid, ctx.gid, ctx.pid, ctx.umask) == (1, 2, 3, 0o22)
    assert not SetattrFields().update_size
    info = PassthroughFileInfo(7, keep_cache=False, backing_fd=3)
    assert isinstance(info, pyfuse3.FileInfo)
    assert (info.fh, info.keep_cache, info.direct_io, info.backing_fd) == (7, False, False, 3)
    token = ReaddirToken(100, plus=False)
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = 5
    assert KernelSession().readdir_reply(token, b"a", attr, 1)
    assert len(token.buf) == 32  # a 24-byte dirent and the name, padded to 8
    assert not KernelSession().readdir_reply(token, b"b" * 60, attr, 2)


# -- the measurement in the docstring -------------------------------------------------------------


def _read_rate(path: Path, buf: bytearray, cold: bool) -> float:
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
    start = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.perf_counter() - start) / 1e9


def measure(workdir: Path, size: int = 256 * MiB, rounds: int = 3) -> None:
    """Print read throughput of one file read directly, through passthrough, and served by
    the daemon (the same backing file under another inode), in GB/s."""
    (workdir / "backing").mkdir()
    (workdir / "mnt").mkdir()
    fs = MemoryFS(workdir / "backing")
    data = workdir / "backing" / "data"
    with open(data, "wb") as f:
        for _ in range(size // (16 * MiB)):
            f.write(os.urandom(16 * MiB))
    for name in (b"data", b"served"):
        fs.nodes[fs.add(ROOT, name, stat.S_IFREG | 0o644)].data = data
    fs.served.add(fs.nodes[ROOT].children[b"served"])
    buf = bytearray(16 * MiB)
    with serving(fs, workdir / "mnt") as session:
        assert session.passthrough
        paths = {
            "plain": data,
            "passthrough": workdir / "mnt" / "data",
            "served": workdir / "mnt" / "served",
        }
        for cold in (False, True):
            rates = {}
            for kind, path in paths.items():
                _read_rate(path, buf, cold=False)  # warm-up (and the open's lookup)
                samples = sorted(_read_rate(path, buf, cold) for _ in range(rounds))
                rates[kind] = samples[rounds // 2]
            print(
                f"{'cold' if cold else 'warm'}: "
                + ", ".join(f"{kind} {rate:.2f}" for kind, rate in rates.items())
                + f" GB/s; passthrough/plain {rates['passthrough'] / rates['plain']:.2f}x"
            )


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, suppress(KeyboardInterrupt):
        measure(Path(tmp), size=int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 256 * MiB)
