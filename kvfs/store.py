"""The backing store: the blocking file operations behind the mount.

Every method here blocks on the backing filesystem, so the daemon calls them from its I/O worker
threads, never from its event loop. Paths are bytes, relative to the backing root, and name the
same file in the backing directory as in the visible tree.

Publishing is atomic: the bytes go to a file in ``.kvfs/tmp`` with their checksum in an xattr,
and only a rename puts them under a visible name. After a crash no visible name holds partial
data, and ``prepare`` removes what the crash left in ``.kvfs/tmp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfs import cached_open, checksum, layout, namespaces, vllm_layout
from kvfs.buffers import ALIGN, EXTENT, ChunkBuffer, ExtentPool
from kvfs.index import Index, Node, Stamp

log = logging.getLogger(__name__)

# Per-file metadata kept with the backing file, so a restart loses nothing.
RECENCY_XATTR = "user.kvfs.recency"  # b"<last read, ns since the epoch> <hits>"
PINNED_XATTR = "user.kvfs.pinned"  # present (b"1") on pinned files and directories


def _read_recency(path: bytes, node: Node) -> None:
    try:
        last_read, hits = os.getxattr(path, RECENCY_XATTR).split()
        node.last_read_ns, node.hits = int(last_read), int(hits)
    except (OSError, ValueError):
        node.last_read_ns = node.mtime_ns  # never read through kvfs: as recent as its write


def _read_pinned(path: bytes) -> bool:
    try:
        return os.getxattr(path, PINNED_XATTR) == b"1"
    except OSError:
        return False


class BackingBusy(RuntimeError):
    """Another daemon already serves this backing directory."""


class _Held(Exception):
    def __init__(self, rel: bytes, pid: str) -> None:
        self.rel, self.pid = rel, pid


@dataclass(frozen=True)
class Found:
    """A file or directory on the backing store that the index did not know (``probe``)."""

    st: os.stat_result
    checksum: str | None
    last_read_ns: int
    hits: int
    pinned: bool


@dataclass(frozen=True)
class Published:
    """A file written to ``.kvfs/tmp`` and ready to be renamed into the tree."""

    tmp: bytes  # relative path of the temp file
    size: int
    blocks: int
    checksum: str | None  # None: published before its checksum was taken (mount/sealer.py)


# What a seal gives: the file and its version (size, mtime, ctime) after, or None.
Sealed = tuple[Published, tuple[int, int, int]] | None


class BackingStore:
    def __init__(self, root: bytes, host: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.host = host  # --shared: this daemon's host id; None: it owns the directory alone
        self.xattrs = True  # cleared if the backing filesystem refuses user xattrs
        self.direct_io = False  # set by prepare() if the backing filesystem takes O_DIRECT
        self.hides_unlinked = False  # set by prepare(): see _probe_hiding
        self._lock_fds: list[int] = []
        # Temp, spare and unlinked files: the daemon's own; a shared one's are per host, so a
        # mount empties only what its own earlier run left (another host's are in use).
        own = layout.PRIVATE_DIR if host is None else layout.host_dir(host)
        self.tmp_dir = own + b"/tmp"
        self.spare_dir = own + b"/spare"
        self.unlinked_dir = own + b"/unlinked"

    def abs(self, rel: bytes) -> bytes:
        return os.path.join(self.root, rel) if rel else self.root

    def unlinked_path(self, ino: int) -> bytes:
        return b"%s/%d" % (self.unlinked_dir, ino)

    # -- start-up ---------------------------------------------------------------------------

    def prepare(self) -> int:
        """Create the private area, take the lock, and remove orphan temp files.

        Returns how many orphans were removed from the temp, spare and unlinked directories
        (the latter only mattered to the previous daemon's kernel references).
        """
        private = (self.tmp_dir, self.spare_dir, self.unlinked_dir, layout.QUARANTINE_DIR)
        for directory in private:
            os.makedirs(self.abs(directory), exist_ok=True)
        self._take_locks()
        removed = 0
        for directory in private[:3]:
            with os.scandir(self.abs(directory)) as entries:
                for entry in entries:
                    # A hidden file (_aside) may go meanwhile: its client's late release.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        self.direct_io = self._probe_direct_io()
        self.hides_unlinked = self._probe_hiding()
        return removed

    def _take_locks(self) -> None:
        """An owner holds ``.kvfs/lock`` exclusively; shared daemons hold it shared (so an
        owner and shared daemons refuse each other) and their host's lock exclusively (so two
        daemons with one host id refuse each other)."""
        where = self.root.decode(errors="replace")
        try:
            if self.host is None:
                self._lock(layout.LOCK_FILE, fcntl.LOCK_EX, True)
            else:
                self._lock(layout.LOCK_FILE, fcntl.LOCK_SH, False)
                self._lock(os.path.join(layout.host_dir(self.host), b"lock"), fcntl.LOCK_EX, True)
        except _Held as held:
            self.close()
            if self.host is None and held.rel == layout.LOCK_FILE and not held.pid:
                why = "shared by --shared kvfs daemons"
            elif self.host is None:
                why = f"served by another kvfs daemon (pid {held.pid or '?'})"
            elif held.rel == layout.LOCK_FILE:
                why = f"served by a kvfs daemon without --shared (pid {held.pid or '?'})"
            else:
                why = f"served as host {self.host} by another kvfs daemon (pid {held.pid or '?'})"
            raise BackingBusy(f"backing directory {where} is {why}") from None

    def _lock(self, rel: bytes, how: int, owner: bool) -> None:
        """flock ``rel``; ``owner``: write our pid into it, for the next one's message."""
        fd = os.open(self.abs(rel), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise _Held(rel, pid) from None
        self._lock_fds.append(fd)
        if owner:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        elif how == fcntl.LOCK_SH:  # no owner now: an old owner's pid would mislead
            os.ftruncate(fd, 0)

    def _probe_direct_io(self) -> bool:
        """Whether the backing filesystem takes O_DIRECT (tmpfs, ext4, xfs do; some NFS not)."""
        path = self.abs(os.path.join(self.tmp_dir, b"o_direct_probe"))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            page = mmap.mmap(-1, ALIGN)
            os.write(fd, page)
            page.close()
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(path)

    def _probe_hiding(self) -> bool:
        """Whether a file unlinked while open here is renamed aside instead (sshfs's
        ``.fuse_hidden*``, NFS's silly rename) until its release. libfuse can lose that release
        when it races the unlink: the file then stays, its space counted by no one (``_aside``
        keeps such files in the temp directory)."""
        probe = os.path.join(self.tmp_dir, b"hiding_probe")
        fd = os.open(self.abs(probe), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(self.abs(probe))
            return bool(os.listdir(self.abs(self.tmp_dir)))  # emptied by prepare()
        finally:
            os.close(fd)

    @property
    def _direct_flag(self) -> int:
        return os.O_DIRECT if self.direct_io else 0

    def close(self) -> None:
        while self._lock_fds:
            os.close(self._lock_fds.pop())

    def scan(self, index: Index) -> int:
        """Fill an empty index from the backing tree; returns how many engine temps it removed.

        Files with several names (hard links) become one node with several names.
        """
        st = os.stat(self.root)
        root = index.root
        root.mode, root.uid, root.gid = st.st_mode, st.st_uid, st.st_gid
        root.atime_ns, root.mtime_ns, root.ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        removed = 0
        linked: dict[int, Node] = {}  # backing inode -> node, for files with several names
        stack: list[tuple[Node, bytes]] = [(root, self.root)]
        while stack:
            parent, abs_dir = stack.pop()
            with os.scandir(abs_dir) as entries:
                for entry in entries:
                    name = entry.name
                    if layout.is_reserved(parent is root, name):
                        continue
                    if entry.is_file(follow_symlinks=False) and vllm_layout.is_engine_temp(name):
                        if self.host is None:  # shared: another host's engine may be writing it
                            os.unlink(entry.path)
                            removed += 1
                        continue
                    est = entry.stat(follow_symlinks=False)
                    first = linked.get(est.st_ino) if est.st_nlink > 1 else None
                    if first is not None and stat.S_ISREG(est.st_mode):
                        index.link(first, parent, name)
                        continue
                    node = index.new_node(name, est.st_mode, est.st_uid, est.st_gid)
                    fill_times(node, est)
                    node.on_backing = True
                    if node.children is None:  # a directory's size is 0: du -b counts files
                        node.size, node.blocks = est.st_size, est.st_blocks
                    node.rdev = est.st_rdev
                    if stat.S_ISLNK(est.st_mode):
                        node.target = os.readlink(entry.path)
                    elif node.is_file:
                        node.checksum = checksum.read_xattr(entry.path)
                        _read_recency(entry.path, node)
                        if est.st_nlink > 1:
                            linked[est.st_ino] = node
                    if not stat.S_ISLNK(est.st_mode):
                        index.set_pinned(node, _read_pinned(entry.path))
                    index.attach(parent, name, node, track=False)
                    if node.is_file and namespaces.is_namespace_config(node):
                        with open(entry.path, "rb") as config:
                            parent.meta = namespaces.parse_config(
                                config.read(namespaces.CONFIG_MAX_BYTES + 1)
                            )
                    if node.children is not None:
                        stack.append((node, entry.path))
        index.restore_policy()
        return removed

    # -- data -------------------------------------------------------------------------------

    def _new_tmp(
        self, extra_flags: int, mode: int, where: bytes | None = None
    ) -> tuple[bytes, int]:
        where = where or self.tmp_dir
        suffix = b"spare" if where == self.spare_dir else b"tmp"
        name = b"%d-%s.%s" % (os.getpid(), os.urandom(8).hex().encode(), suffix)
        rel = os.path.join(where, name)
        flags = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags
        return rel, os.open(self.abs(rel), flags, mode & 0o7777)

    def write_tmp(
        self,
        data: ChunkBuffer,
        mode: int,
        uid: int,
        gid: int,
        times_ns: tuple[int, int],
        durable: bool,
    ) -> Published:
        """Write a whole file under a fresh name in ``.kvfs/tmp``, with its checksum.

        Sizes in whole 4 KiB blocks go with O_DIRECT where the backing filesystem takes it (one
        copy, no page cache); ``durable`` adds an fsync. On any error nothing is left.
        """
        digest = data.checksum()
        direct = self.direct_io and data.size % ALIGN == 0
        rel, fd = self._new_tmp(os.O_WRONLY | (os.O_DIRECT if direct else 0), mode)
        try:
            for offset, view, hole in data.segments():
                while view and not hole:  # O_DIRECT writes of whole extents are never short
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            os.ftruncate(fd, data.size)  # holes stay holes (sparse), as on any filesystem
            blocks = self._finish(fd, digest, mode, uid, gid, times_ns, durable)
        except BaseException:
            os.close(fd)
            self.discard(rel)
            raise
        os.close(fd)
        return Published(rel, data.size, blocks, digest)

    def open_tmp(self, mode: int, spare: bool = False) -> tuple[bytes, int]:
        """A new empty file in ``.kvfs/tmp`` (``spare``: ``.kvfs/spare``, opened ahead) for the
        kernel to write itself (passthrough), open for reading and writing; ``seal_tmp``
        readies it for the rename that publishes it."""
        return self._new_tmp(os.O_RDWR, mode, self.spare_dir if spare else self.tmp_dir)

    def open_spares(self, count: int) -> list[tuple[bytes, int]]:
        """Up to ``count`` spare temp files (``open_tmp``, mode 0600: set at the publish) in one
        call; as many as could be opened, an error only if none could."""
        opened: list[tuple[bytes, int]] = []
        try:
            for _ in range(count):
                opened.append(self.open_tmp(0o600, spare=True))
        except OSError:
            if not opened:
                raise
        return opened

    def seal_tmp(
        self,
        rel: bytes,
        fd: int,
        mode: int,
        uid: int,
        gid: int,
        times_ns: tuple[int, int],
        durable: bool,
        direct: bool = False,
        unchanged_since: tuple[int, int, int] | None = None,
        with_checksum: bool = True,
        declared: str | None = None,
    ) -> Sealed:
        """Checksum a temp file as it is now and set its attributes: the file and its version
        (size, mtime, ctime after sealing: any later write changes it). ``direct``: it was
        written past the page cache (O_DIRECT), so it is read back that way, not faulted in
        page by page; ``with_checksum=False`` leaves that to later (no xattr, checksum None);
        ``declared``: the checksum its writer declared, kept without reading the file.
        None, touching nothing, if its version is no longer ``unchanged_since``; None too (or,
        unchecked, the version before the checksum, which the next check finds stale) if a
        writer still holding it wrote meanwhile: the times are set first, so such a write
        moves the mtime (timestamps after a stat are fine-grained) and is never lost in the
        utimens."""
        if unchanged_since is not None and self.version(fd) != unchanged_since:
            return None
        _give_attrs(fd, mode, uid, gid, times_ns)
        before = os.fstat(fd)
        digest: str | None = declared
        size = before.st_size
        if digest is None and with_checksum:
            if direct and self.direct_io:
                reader = os.open(self.abs(rel), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                try:
                    digest, size = checksum.of_file_direct(reader)
                finally:
                    os.close(reader)
            else:
                digest, size = checksum.of_file(fd)
        if digest is not None:
            self._keep_checksum(fd, digest)
        if durable:
            os.fsync(fd)
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            if unchanged_since is not None:
                return None
            return Published(rel, size, after.st_blocks, digest), _version_of(before)
        return Published(rel, size, after.st_blocks, digest), _version_of(after)

    def seal_into(
        self,
        seal: Callable[[], Sealed],
        dest: bytes,
        dirs: Sequence[tuple[bytes, int, int, int]],
    ) -> Sealed:
        """A ``seal_tmp`` call, then its file renamed to ``dest`` (``rename_into``) if it
        sealed: one call for a file whose final name is known."""
        sealed = seal()
        if sealed is not None:
            self.rename_into(sealed[0].tmp, dest, dirs)
        return sealed

    @staticmethod
    def version(fd: int) -> tuple[int, int, int]:
        return _version_of(os.fstat(fd))

    def _finish(
        self,
        fd: int,
        digest: str | None,
        mode: int,
        uid: int,
        gid: int,
        times_ns: tuple[int, int],
        durable: bool,
    ) -> int:
        """Checksum (if taken) and attributes onto a written temp file; returns its 512-byte
        blocks."""
        if digest is not None:
            self._keep_checksum(fd, digest)
        _give_attrs(fd, mode, uid, gid, times_ns)
        if durable:
            os.fsync(fd)
        return os.fstat(fd).st_blocks

    def discard(self, rel: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._aside(rel))

    def _aside(self, rel: bytes) -> bytes:
        """The path to unlink ``rel`` by. Where the backing filesystem hides a file unlinked
        while open (``_probe_hiding``), the name is first moved into this daemon's temp
        directory: what the client may leave behind then lies there, emptied at the next
        mount, not among the chunks, where no one would count or remove it."""
        if not self.hides_unlinked or rel.startswith(layout.PRIVATE_DIR + b"/"):
            return self.abs(rel)
        aside = self.abs(os.path.join(self.tmp_dir, b"gone-" + os.urandom(8).hex().encode()))
        os.rename(self.abs(rel), aside)
        return aside

    def open_reader(self, rel: bytes, direct: bool = True) -> int:
        """Open a backing file for ``read_verified`` (O_DIRECT where the filesystem takes it),
        or, ``direct`` False, for the kernel to read in passthrough (a backing file opened
        O_DIRECT would make every passthrough read direct, and unaligned ones fail)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | (self._direct_flag if direct else 0)
        return os.open(self.abs(rel), flags)

    def open_reader_cached(self, rel: bytes, direct: bool = True) -> int | None:
        """``open_reader`` without I/O, safe on an event loop: None where the path is not all
        in the kernel's caches (``cached_open``)."""
        return cached_open.open_cached(
            self.abs(rel), os.O_RDONLY | (self._direct_flag if direct else 0)
        )

    def read_verified(
        self, fd: int, expected: str | None, pool: ExtentPool
    ) -> tuple[ChunkBuffer, str]:
        """Read a whole open file into extents and check it against its checksum; the bytes
        and their checksum, stored with the file if it had none.

        Raises ChecksumMismatch if ``expected`` is set and differs, or if the file is shorter
        than fstat says. Each extent is asked for whole (aligned, as O_DIRECT needs); only the
        last one comes back short, at the end of the file.
        """
        size = os.fstat(fd).st_size
        buf = ChunkBuffer(pool)
        try:
            for index, extent in enumerate(buf.allocate(size)):
                want, view, got = min(EXTENT, size - index * EXTENT), memoryview(extent), 0
                while got < want:
                    count = os.preadv(fd, [view[got:]], index * EXTENT + got)
                    if count == 0:
                        raise checksum.ChecksumMismatch(errno.EIO, "backing file is short")
                    got += count
            digest = buf.checksum()
            if expected is not None and digest != expected:
                raise checksum.ChecksumMismatch(errno.EIO, f"checksum {digest} != {expected}")
            if expected is None:
                self._adopt(fd, digest)
        except BaseException:
            buf.release()
            raise
        return buf, digest

    def recheck(self, fd: int, expected: str | None) -> tuple[str, int]:
        """The checksum of an open file as the disk holds it (O_DIRECT where it can, else
        as read) and its size, stored with the file if it had none."""
        digest, size = checksum.of_file_direct(fd)
        if expected is None:
            self._adopt(fd, digest)
        return digest, size

    def _keep_checksum(self, fd: int, digest: str) -> None:
        """Store a checksum with an open file (its xattr)."""
        if self.xattrs and not checksum.write_xattr(fd, digest):
            self.xattrs = False
            log.warning("%s has no user xattrs: checksums are kept in memory only", self.root)

    def _adopt(self, fd: int, digest: str) -> None:
        """Keep the checksum just taken of a file that had none (written around the mount, or
        published before its checksum). Given by fd, it lands on the inode that was read,
        whatever name that has by now. Where it cannot be stored (another user's file, a
        read-only store) the daemon keeps it in memory, and the read goes on."""
        try:
            self._keep_checksum(fd, digest)
        except OSError as err:
            log.info("checksum %s of an adopted file kept in memory only: %s", digest, err)

    def probe(self, rel: bytes) -> Found | None:
        """What the backing directory has under ``rel`` that the index lacks (a shared
        directory: another host published it): a regular file (with its checksum, recency
        and pin) or a directory; None for nothing there, or anything else."""
        path = self.abs(rel)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISDIR(st.st_mode):
            return Found(st, None, 0, 0, _read_pinned(path))
        if not stat.S_ISREG(st.st_mode):
            return None
        probe = Node(0, b"", st.st_mode)
        probe.mtime_ns = st.st_mtime_ns
        _read_recency(path, probe)
        return Found(st, checksum.read_xattr(path), probe.last_read_ns, probe.hits, False)

    def link_new(self, src: bytes, rel: bytes) -> Found | None:
        """Put ``src`` under the name ``rel`` unless something is there already (a shared
        directory: another host published that name first), and drop the name ``src``.

        link() is atomic on every filesystem that has hard links, NFS included (EEXIST): two
        hosts publishing one name never replace each other, with no window between a check
        and a rename. Returns None if ours took the name, else what holds it (kept), with its
        checksum (computed if it has none in its xattr).
        """
        try:
            os.link(self.abs(src), self.abs(rel), follow_symlinks=False)
        except FileExistsError:
            found = self.probe(rel)
            if found is None:  # a directory or symlink took it: the name is not ours to take
                raise
            if found.checksum is None and not stat.S_ISDIR(found.st.st_mode):
                fd = os.open(self.abs(rel), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    found = dataclasses.replace(found, checksum=checksum.of_file(fd)[0])
                finally:
                    os.close(fd)
            self.discard(src)
            return found
        self.discard(src)
        return None

    def save_recency(self, reads: list[tuple[bytes, int, int]]) -> None:
        """Persist reads: (path, last read in ns, hits) each. A file may have gone (or moved)
        since: then there is nothing to keep. Nor where a client put a symlink in its place:
        the link is never followed (user xattrs on a symlink: EPERM)."""
        if self.xattrs:
            for rel, last_read_ns, hits in reads:
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    os.setxattr(
                        self.abs(rel),
                        RECENCY_XATTR,
                        b"%d %d" % (last_read_ns, hits),
                        follow_symlinks=False,
                    )

    def save_pinned(self, rel: bytes, pinned: bool) -> None:
        path = self.abs(rel)
        if pinned:
            os.setxattr(path, PINNED_XATTR, b"1", follow_symlinks=False)
        else:
            with contextlib.suppress(OSError):
                os.removexattr(path, PINNED_XATTR, follow_symlinks=False)

    def fsync(self, rel: bytes) -> None:
        fd = os.open(self.abs(rel), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def quarantine(self, rel: bytes) -> bytes:
        """Move a bad file out of the visible tree; returns its quarantine path."""
        flat = rel.replace(b"/", b"%")[-200:]
        dest = os.path.join(layout.QUARANTINE_DIR, b"%s.%s" % (flat, os.urandom(4).hex().encode()))
        os.rename(self.abs(rel), self.abs(dest))
        return dest

    # -- namespace --------------------------------------------------------------------------

    def mkdir(self, rel: bytes, mode: int, uid: int, gid: int) -> os.stat_result:
        path = self.abs(rel)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            # A directory there is our own: left by a crash, or by a publish that failed
            # after it made the directories above it.
            if not os.path.isdir(path):
                raise
        os.chmod(path, mode & 0o7777)  # exactly the mode asked, not less the daemon's umask
        return self._own(path, uid, gid)

    def symlink(self, target: bytes, rel: bytes, uid: int, gid: int) -> os.stat_result:
        path = self.abs(rel)
        os.symlink(target, path)
        return self._own(path, uid, gid)

    def mknod(self, rel: bytes, mode: int, rdev: int, uid: int, gid: int) -> os.stat_result:
        """A fifo, socket, device node or empty regular file, as mknod(2) makes them."""
        path = self.abs(rel)
        os.mknod(path, mode, rdev)
        os.chmod(path, mode & 0o7777)  # not subject to the daemon's own umask
        return self._own(path, uid, gid)

    def link(self, existing: bytes, new: bytes) -> None:
        os.link(self.abs(existing), self.abs(new), follow_symlinks=False)

    def relink(self, source: bytes, rel: bytes) -> None:
        """Point the name ``rel`` at the file ``source`` names, atomically (a hard link made
        under a temp name, then renamed over it)."""
        tmp = self.abs(os.path.join(self.tmp_dir, os.urandom(8).hex().encode() + b".link"))
        os.link(self.abs(source), tmp)
        try:
            os.rename(tmp, self.abs(rel))
        except BaseException:
            os.unlink(tmp)
            raise

    def _own(self, path: bytes, uid: int, gid: int) -> os.stat_result:
        if (uid, gid) != (os.geteuid(), os.getegid()):
            os.chown(path, uid, gid, follow_symlinks=False)
        return os.lstat(path)

    def rmdir(self, rel: bytes) -> None:
        os.rmdir(self.abs(rel))

    def unlink(self, rel: bytes) -> None:
        os.unlink(self._aside(rel))

    def rename(self, old: bytes, new: bytes) -> None:
        os.rename(self.abs(old), self.abs(new))

    def make_dirs(self, dirs: Sequence[tuple[bytes, int, int, int]]) -> None:
        """``mkdir`` each (path, mode, uid, gid), parents first."""
        for rel, mode, uid, gid in dirs:
            self.mkdir(rel, mode, uid, gid)

    def rename_into(
        self, old: bytes, new: bytes, dirs: Sequence[tuple[bytes, int, int, int]]
    ) -> None:
        """``rename`` into a directory that ``make_dirs(dirs)`` makes first."""
        self.make_dirs(dirs)
        self.rename(old, new)

    def set_attrs(
        self,
        rel: bytes,
        mode: int | None,
        owner: tuple[int, int] | None,
        times_ns: tuple[int, int] | None,
    ) -> tuple[Stamp, os.stat_result]:
        """Set what is given; the file's ``file_stamp`` before, and its attributes after."""
        path = self.abs(rel)
        before = os.lstat(path)
        if mode is not None and not stat.S_ISLNK(before.st_mode):  # a symlink's mode: nothing
            os.chmod(path, mode & 0o7777)
        if owner is not None:
            os.chown(path, *owner, follow_symlinks=False)
        if times_ns is not None:
            os.utime(path, ns=times_ns, follow_symlinks=False)
        return stat_stamp(before), os.lstat(path)

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.root)


def _give_attrs(fd: int, mode: int, uid: int, gid: int, times_ns: tuple[int, int]) -> None:
    os.fchmod(fd, mode & 0o7777)
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, uid, gid)
    os.utime(fd, ns=times_ns)


def file_stamp(file: int | bytes) -> Stamp:
    """What a write to a file (open, or at a path) changes: its inode, size and mtime (a
    write through the mount or around it; not the xattrs kvfs keeps on it, which move only the
    ctime). After a stat the filesystem's next timestamp is fine-grained (Linux 6.13+), so a
    write right after this call still moves the mtime. A bit that rots on the disk changes
    nothing: the scrub's."""
    return stat_stamp(os.stat(file))


def stat_stamp(st: os.stat_result) -> Stamp:
    """``file_stamp`` from a stat already taken."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def _version_of(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def fill_times(node: Node, st: os.stat_result) -> None:
    node.atime_ns, node.mtime_ns, node.ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
