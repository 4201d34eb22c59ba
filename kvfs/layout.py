"""Names in the backing directory.

The backing directory is exactly the visible tree (a valid vLLM ``root_dir`` without the mount),
plus one private directory at its root that the mount never shows:

    <backing>/.kvfs/tmp/         files being published (renamed into the tree when complete)
    <backing>/.kvfs/spare/       empty temp files opened ahead for passthrough writes
    <backing>/.kvfs/unlinked/    files unlinked or replaced while the kernel still knows them
                                 (an open() may still reach them); removed when it forgets
    <backing>/.kvfs/quarantine/  chunks whose bytes failed their checksum
    <backing>/.kvfs/lock         held by the daemon that serves this backing directory
                                 (shared: held in shared mode by every --shared daemon)
    <backing>/.kvfs/hosts/<id>/  a --shared daemon's own lock, tmp, spare and unlinked
                                 directories: each host empties only its own at mount
"""

from __future__ import annotations

PRIVATE_DIR = b".kvfs"
TMP_DIR = PRIVATE_DIR + b"/tmp"
SPARE_DIR = PRIVATE_DIR + b"/spare"
UNLINKED_DIR = PRIVATE_DIR + b"/unlinked"
QUARANTINE_DIR = PRIVATE_DIR + b"/quarantine"
LOCK_FILE = PRIVATE_DIR + b"/lock"
HOSTS_DIR = PRIVATE_DIR + b"/hosts"


def host_dir(host: str) -> bytes:
    """A --shared daemon's private area (host ids are checked: a plain directory name)."""
    return b"%s/%s" % (HOSTS_DIR, host.encode())


NAME_MAX = 255
PATH_MAX = 4096  # Linux's longest path (and symlink target), its NUL included


def is_reserved(parent_is_root: bool, name: bytes) -> bool:
    """Whether a visible name would collide with the backing directory's private area."""
    return parent_is_root and name == PRIVATE_DIR


def unlinked_path(ino: int) -> bytes:
    return b"%s/%d" % (UNLINKED_DIR, ino)
