"""A kvfs mount for the length of a tool's run, always unmounted after."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KVFS = [sys.executable, "-m", "kvfs.cli"]


@contextmanager
def temporary_mount(base: Path, *options: str) -> Iterator[Path]:
    """Mount ``base/mnt`` backed by ``base/backing`` (both created) and yield the mountpoint."""
    mnt, backing = base / "mnt", base / "backing"
    mnt.mkdir(parents=True)
    backing.mkdir()
    # kvfs reports on stdout; the tools keep stdout for their results (--json)
    mount = [*KVFS, "mount", str(mnt), "--backing", str(backing), *options]
    subprocess.run(mount, check=True, stdout=sys.stderr)
    try:
        yield mnt
    finally:
        umount = subprocess.run([*KVFS, "umount", str(mnt)], check=False, stdout=sys.stderr)
        if umount.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
