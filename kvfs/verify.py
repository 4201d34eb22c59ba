"""`kvfs verify PATH`: read every chunk, check it against its checksum, quarantine bad ones.

On a mount, the daemon checks each file on request (the xattr ``user.kvfs.verify``), as its
scrub does: it reads the backing file past the page cache, quarantines a mismatch, and counts no
read, so hits, recency and the eviction order stay the engines'. On a backing directory that no
daemon serves, the same check runs here, with the same quarantine area.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvfs import control_protocol as proto
from kvfs import layout, mountctl
from kvfs.buffers import ExtentPool
from kvfs.checksum import ChecksumMismatch, read_xattr
from kvfs.store import BackingStore


class VerifyError(RuntimeError):
    """Verification cannot start; the message says why."""


@dataclass
class Report:
    files: int = 0
    bytes: int = 0
    unverified: list[str] = field(default_factory=list)  # no checksum: written around kvfs
    bad: list[str] = field(default_factory=list)  # failed their checksum, now quarantined
    errors: list[str] = field(default_factory=list)  # could not be read (not a checksum)


def verify(path: Path, progress: bool = True) -> Report:
    target = path.absolute()
    if not target.exists():
        raise VerifyError(f"{target} does not exist")
    mount = next((m for m in mountctl.kvfs_mounts() if _within(target, Path(m))), None)
    files = list(_files(target))
    bar = tqdm(
        total=sum(size for _, size in files),
        unit="B",
        unit_scale=True,
        disable=not progress,
        desc="verify",
    )
    try:
        if mount is not None:
            return _through_mount(files, bar)
        return _backing(target, files, bar)
    finally:
        bar.close()


def _within(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


def _files(top: Path) -> Iterator[tuple[Path, int]]:
    if top.is_file():
        yield top, top.stat().st_size
        return
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == top:
            dirnames[:] = [d for d in dirnames if d != os.fsdecode(layout.PRIVATE_DIR)]
        for name in filenames:
            file = Path(dirpath, name)
            st = file.lstat()
            if stat.S_ISREG(st.st_mode):  # a fifo would block, a symlink is no chunk
                yield file, st.st_size


def _through_mount(files: list[tuple[Path, int]], bar: tqdm) -> Report:
    report = Report()
    for file, size in files:
        try:
            if proto.CHECKSUM not in os.listxattr(file):
                report.unverified.append(str(file))  # the check adopts what it reads
            os.setxattr(file, proto.VERIFY, b"1")
            report.files += 1
            report.bytes += size
        except FileNotFoundError:  # evicted meanwhile
            pass
        except OSError as err:
            (report.bad if err.errno == errno.EBADMSG else report.errors).append(str(file))
        bar.update(size)
    return report


def _backing(target: Path, files: list[tuple[Path, int]], bar: tqdm) -> Report:
    root = next((p for p in (target, *target.parents) if (p / ".kvfs" / "lock").exists()), None)
    if root is None:
        raise VerifyError(f"{target} is neither in a kvfs mount nor in a kvfs backing directory")
    lock = os.open(root / ".kvfs" / "lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise VerifyError(f"{root} is served by a kvfs daemon: verify through its mount") from None
    store = BackingStore(os.fsencode(root))
    pool = ExtentPool(16 << 20)
    report = Report()
    try:
        for file, size in files:
            rel = os.fsencode(file.relative_to(root))
            expected = read_xattr(os.fsencode(file))
            if expected is None:
                report.unverified.append(str(file))
                bar.update(size)
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                store.read_verified(fd, expected, pool)[0].release()
                report.files += 1
                report.bytes += size
            except ChecksumMismatch:
                store.quarantine(rel)
                report.bad.append(str(file))
            except OSError:
                report.errors.append(str(file))
            finally:
                os.close(fd)
            bar.update(size)
    finally:
        os.close(lock)
    return report
