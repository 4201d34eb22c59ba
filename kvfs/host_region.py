"""One shared host region of fixed-size chunk slots, mapped by every worker of an instance.

The region is a file in /dev/shm: a 4 KiB header (magic, slot size and count, the layout's
fingerprint), then the slots, each a multiple of 4 KiB and page-aligned, so secondary tiers can
do O_DIRECT I/O straight from it. The creator reserves the memory up front (fallocate), so a
full /dev/shm is a clear error at start and never a SIGBUS mid-transfer, and every process maps
it populated (MAP_POPULATE): the pages are zeroed and mapped at start, not one fault at a time
by the first copies into them, on the engine's critical path (pinning the region for CUDA
touches every page at start anyway).

Every process that maps the region holds a shared flock on it. Whoever closes it last (the
exclusive lock is then free) removes the file; a worker that crashes drops its lock with its
process, so the others clean up as usual. If every process dies, the next ``create`` in the same
directory finds the file with no lock held and removes it (``sweep_orphans``).

/dev/shm is world-writable and the region's name is predictable, so another user may plant a
symlink, a hard link, a FIFO or a file of their own there before we come. Nothing here follows a
symlink or truncates a file it did not create: a region is built in an unnamed O_TMPFILE and
linked into place (which fails if anything holds the name), every open uses O_NOFOLLOW, and a
file is used only once fstat shows a regular file of ours, private (no group or other bits),
with one link and the size its header promises. Anything else is refused with a RegionError.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
SHM_DIR = Path("/dev/shm")
PREFIX = "kvfs-"
SUFFIX = ".region"
_MAGIC = b"KVFSREG1"
_HEADER = struct.Struct("<8sQQ32s")  # magic, slot_bytes, num_slots, fingerprint (ascii)


class RegionError(RuntimeError):
    """The region cannot be created or attached; nothing was left behind."""


def region_path(name: str, directory: Path = SHM_DIR) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise RegionError(f"region name {name!r}: use letters, digits, '-' or '_'")
    return directory / f"{PREFIX}{name}{SUFFIX}"


# Never follow a symlink, never block on a FIFO, never leak the fd into a child process.
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_existing(path: Path) -> int:
    """Open a region someone else may have planted: never through a symlink, never a FIFO."""
    try:
        return os.open(path, _OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RegionError(f"{path} is a symbolic link: refusing to use it") from None
        raise


def _unsafe(st: os.stat_result) -> str | None:
    """Why a file at a region's name is not one of our regions, or None if it may be.

    A hard link means someone else holds a name for the same bytes (the planted-link attack);
    group or other bits mean someone else may have written into it.
    """
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_nlink > 1:
        return f"has {st.st_nlink} hard links"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    return None


def _why_not_ours(path: Path) -> str | None:
    """What is wrong with whatever holds a region's name, judged without opening it."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else _unsafe(st)


def _check(fd: int, path: Path) -> None:
    reason = _unsafe(os.fstat(fd))
    if reason is not None:
        raise RegionError(f"{path} {reason}: refusing to use it")


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced since)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def sweep_orphans(directory: Path = SHM_DIR) -> list[Path]:
    """Remove regions that no live process maps (all of their processes died).

    Only files that are our regions are touched: a planted symlink, FIFO or someone else's
    file is left where it is (creating under that name will say why it cannot).
    """
    removed = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        try:
            fd = _open_existing(path)
        except (OSError, RegionError):
            continue
        try:
            if _unsafe(os.fstat(fd)) is not None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # someone maps it
            with contextlib.suppress(OSError):
                if _same_file(path, fd):
                    os.unlink(path)
                    removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d orphan host regions: %s", len(removed), removed)
    return removed


def _create_unnamed(directory: Path) -> int:
    """A new, empty, private file in ``directory`` that has no name yet (O_TMPFILE).

    No name means nothing to plant in advance: no symlink to follow, no file to truncate, and
    the sweep never sees a region half made. tmpfs (/dev/shm) supports it.
    """
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise RegionError(
            f"cannot create a host region in {directory}: {err.strerror} "
            "(it needs a filesystem with O_TMPFILE, such as tmpfs)"
        ) from None
    os.fchmod(fd, 0o600)  # whatever the umask
    return fd


def _link_into_place(fd: int, path: Path, name: str) -> None:
    """Give the unnamed file its region name; never replaces anything already there.

    linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N is how an O_TMPFILE gets a name without
    CAP_DAC_READ_SEARCH. The descriptor of /proc/self/fd makes os.link call linkat: given two
    plain paths it calls link(2), which links the /proc symlink itself (EXDEV).
    """
    proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
    except FileExistsError:
        reason = _why_not_ours(path)
        if reason is not None:
            raise RegionError(f"{path} {reason}: refusing to use it") from None
        raise RegionError(f"{path} exists: another instance uses the name {name!r}") from None
    except OSError as err:
        raise RegionError(f"cannot create {path}: {err.strerror}") from None
    finally:
        os.close(proc_fds)


class HostRegion:
    """A mapped region. ``view`` is a memoryview of shape (num_slots, slot_bytes)."""

    def __init__(self, path: Path, fd: int, slot_bytes: int, num_slots: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._fd: int | None = fd
        # Populated: ~0.4 s a GiB here at start; faulted in by the copies instead, a store of
        # 48 chunks took 24,576 faults, which cost up to ~30 us each on a VM after a large free.
        self._mmap = mmap.mmap(
            fd, HEADER_BYTES + slot_bytes * num_slots, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE
        )
        self._bytes = memoryview(self._mmap)[HEADER_BYTES:]
        # vLLM's secondary tiers take this shape: a row per slot, strides[0] = slot size.
        self.view = self._bytes.cast("B", (num_slots, slot_bytes))
        atexit.register(self.close)

    @classmethod
    def create(
        cls,
        name: str,
        num_slots: int,
        slot_bytes: int,
        fingerprint: str,
        directory: Path = SHM_DIR,
    ) -> HostRegion:
        if slot_bytes <= 0 or slot_bytes % HEADER_BYTES:
            raise RegionError(f"slot_bytes {slot_bytes}: must be a positive multiple of 4096")
        if num_slots <= 0:
            raise RegionError(f"num_slots {num_slots}: the region must hold at least one chunk")
        path = region_path(name, directory)
        sweep_orphans(directory)
        total = HEADER_BYTES + slot_bytes * num_slots
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < total:
            raise RegionError(
                f"{directory} has {stats.f_bavail * stats.f_frsize} bytes free; "
                f"the region needs {total} (lower cpu_bytes_to_use)"
            )
        fd = _create_unnamed(directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, total)
            header = _HEADER.pack(_MAGIC, slot_bytes, num_slots, fingerprint.encode("ascii"))
            os.pwrite(fd, header, 0)
            _link_into_place(fd, path, name)
        except BaseException:
            os.close(fd)
            raise
        try:
            return cls(path, fd, slot_bytes, num_slots)
        except BaseException:  # could not map it: leave no name and no lock behind
            with contextlib.suppress(OSError):
                if _same_file(path, fd):
                    os.unlink(path)
            os.close(fd)
            raise

    @classmethod
    def attach(
        cls, name: str, fingerprint: str, directory: Path = SHM_DIR, timeout: float = 30.0
    ) -> HostRegion:
        """Map a region another process created, waiting up to ``timeout`` for it to appear."""
        path = region_path(name, directory)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = _open_existing(path)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise RegionError(f"no host region {path} after {timeout}s") from None
                time.sleep(0.01)
                continue
            except OSError as err:
                raise RegionError(f"cannot open {path}: {err.strerror}") from None
            try:
                if os.fstat(fd).st_nlink > 0:  # 0: its last user removed it as we opened it
                    _check(fd, path)
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    slot_bytes, num_slots = cls._read_header(fd, path, fingerprint)
                    if _same_file(path, fd):
                        return cls(path, fd, slot_bytes, num_slots)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @staticmethod
    def _read_header(fd: int, path: Path, fingerprint: str) -> tuple[int, int]:
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size:
            raise RegionError(f"{path} is not a kvfs host region")
        magic, slot_bytes, num_slots, stored = _HEADER.unpack(raw)
        if magic != _MAGIC:
            raise RegionError(f"{path} is not a kvfs host region")
        if os.fstat(fd).st_size < HEADER_BYTES + slot_bytes * num_slots:
            # mapping past the end would turn the first touch of a missing page into SIGBUS
            raise RegionError(f"{path} is shorter than its header says: refusing to map it")
        theirs = stored.rstrip(b"\0").decode("ascii", "replace")
        if theirs != fingerprint:
            raise RegionError(
                f"{path} holds another chunk layout (fingerprint {theirs}, this worker's "
                f"{fingerprint}): the workers of one instance must share one model geometry"
            )
        return slot_bytes, num_slots

    def slot(self, index: int) -> memoryview:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index}: the region has {self.num_slots}")
        return self._bytes[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def close(self) -> None:
        """Unmap; the last process to close removes the file. Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        atexit.unregister(self.close)
        self.view.release()
        self._bytes.release()
        with contextlib.suppress(BufferError):  # a view someone still holds keeps the map
            self._mmap.close()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # Others still map it. Unlock explicitly: a mapping we could not close holds a
            # duplicate of this fd, which would otherwise keep our lock for the process's life.
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            with contextlib.suppress(OSError):
                if _same_file(self.path, fd):
                    os.unlink(self.path)
        os.close(fd)

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
