"""One shared host region of fixed-size chunk slots, mapped by every worker of an instance.

The region is a file in /dev/shm: a 4 KiB header (magic, slot size and count, the layout's
fingerprint), then the slots, each a multiple of 4 KiB and page-aligned, so secondary tiers can
do O_DIRECT I/O straight from it. The creator reserves the memory up front (fallocate), so a
full /dev/shm is a clear error at start and never a SIGBUS mid-transfer.

Every process that maps the region holds a shared flock on it. Whoever closes it last (the
exclusive lock is then free) removes the file; a worker that crashes drops its lock with its
process, so the others clean up as usual. If every process dies, the next ``create`` in the same
directory finds the file with no lock held and removes it (``sweep_orphans``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import mmap
import os
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


def sweep_orphans(directory: Path = SHM_DIR) -> list[Path]:
    """Remove regions that no live process maps (all of their processes died)."""
    removed = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # someone maps it
            continue
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed.append(path)
        os.close(fd)
    if removed:
        log.info("removed %d orphan host regions: %s", len(removed), removed)
    return removed


class HostRegion:
    """A mapped region. ``view`` is a memoryview of shape (num_slots, slot_bytes)."""

    def __init__(self, path: Path, fd: int, slot_bytes: int, num_slots: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._fd: int | None = fd
        self._mmap = mmap.mmap(fd, HEADER_BYTES + slot_bytes * num_slots)
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
        # Built under a private name and linked into place whole: no one ever attaches to a
        # region without its header, and the sweep never sees one half made.
        building = directory / f".{path.name}.{os.getpid()}"
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, total)
            header = _HEADER.pack(_MAGIC, slot_bytes, num_slots, fingerprint.encode("ascii"))
            os.pwrite(fd, header, 0)
            os.link(building, path)
        except FileExistsError:
            os.close(fd)
            raise RegionError(f"{path} exists: another instance uses the name {name!r}") from None
        except OSError as err:
            os.close(fd)
            raise RegionError(f"cannot create {path}: {err.strerror}") from err
        finally:
            os.unlink(building)
        try:
            return cls(path, fd, slot_bytes, num_slots)
        except BaseException:  # could not map it: leave no name and no lock behind
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
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise RegionError(f"no host region {path} after {timeout}s") from None
                time.sleep(0.01)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                slot_bytes, num_slots = cls._read_header(fd, path, fingerprint)
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return cls(path, fd, slot_bytes, num_slots)
            except FileNotFoundError:
                pass  # its last user removed it as we opened it: wait for a new one
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @staticmethod
    def _read_header(fd: int, path: Path, fingerprint: str) -> tuple[int, int]:
        magic, slot_bytes, num_slots, stored = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise RegionError(f"{path} is not a kvfs host region")
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
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(self.path)
        os.close(fd)

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
