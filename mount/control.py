"""The read-only `.kvfs/` directory at the root of the mount: reports from the running daemon.

    .kvfs/usage.json       capacity, usage, counters and per-namespace totals (no walk: cheap)
    .kvfs/namespaces.json  the same plus reads, oldest and newest read per namespace (walks)

They are generated when opened, so `cat` and `kvfs ls`/`kvfs du` see the daemon's state of that
moment. The name `.kvfs` cannot collide with vLLM's paths (they start with the model name), and
the backing directory's own `.kvfs/` is never shown, so this one is purely virtual.
"""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Callable
from typing import Any

import pyfuse3

DIR_INO = 1 << 62  # far above any inode the index hands out
FILES = {b"usage.json": DIR_INO + 1, b"namespaces.json": DIR_INO + 2}
NAME = b".kvfs"


def is_control(ino: int) -> bool:
    return DIR_INO <= ino <= DIR_INO + len(FILES)


def attrs(ino: int, timeout: float) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = ino
    attr.entry_timeout = attr.attr_timeout = timeout
    attr.st_mode = (stat.S_IFDIR | 0o555) if ino == DIR_INO else (stat.S_IFREG | 0o444)
    attr.st_nlink = 2 if ino == DIR_INO else 1
    attr.st_size = 0  # generated on open, read with direct I/O: the size is not known before
    now = time.time_ns()
    attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = now
    return attr


def render(ino: int, report: Callable[[bool], dict[str, Any]]) -> bytes:
    """The content of a control file; ``report(walk)`` builds the daemon's report."""
    walk = ino == FILES[b"namespaces.json"]
    return json.dumps(report(walk), indent=2).encode() + b"\n"
