"""The mount's control protocol, one definition for the daemon and its clients (the kvfs CLI,
tools, operators' scripts): a read-only directory at the mount's root and ``user.kvfs.*``
extended attributes.

    MOUNT/.kvfs/usage.json       capacity, usage, counters, per-namespace totals (cheap)
    MOUNT/.kvfs/namespaces.json  the same plus what needs every file (reads, pinned, last read)

Read on any node: ``pin`` (set on it), ``pinned`` (in effect: it or a directory above).
On a file: ``checksum``, ``hits``, ``last_read`` (only once read).
On a namespace directory: ``model``, ``chunks``, ``bytes``, ``tokens``.
On the root: ``pid``, ``backing``, ``capacity``, ``used``, ``evictions``, ``checksum_failures``,
``deadline_expiries``, ``unpublished``, and ``evicted.<id>`` (an evict request's outcome).
Written: ``pin`` (0/1, anywhere), ``evict`` (JSON, on the root), ``verify`` (on a file).
"""

from __future__ import annotations

from pathlib import Path

CONTROL_DIR = ".kvfs"
USAGE = "usage.json"
NAMESPACES = "namespaces.json"

PREFIX = "user.kvfs."
PIN = PREFIX + "pin"
PINNED = PREFIX + "pinned"
CHECKSUM = PREFIX + "checksum"
HITS = PREFIX + "hits"
LAST_READ = PREFIX + "last_read"
MODEL = PREFIX + "model"
CHUNKS = PREFIX + "chunks"
BYTES = PREFIX + "bytes"
TOKENS = PREFIX + "tokens"
PID = PREFIX + "pid"
BACKING = PREFIX + "backing"
EVICTIONS = PREFIX + "evictions"
UNPUBLISHED = PREFIX + "unpublished"
ROOT_COUNTS = ("pid", "capacity", "used", "checksum_failures", "deadline_expiries")
EVICT = PREFIX + "evict"
EVICTED = PREFIX + "evicted."  # + the request's id
VERIFY = PREFIX + "verify"


def report_path(mount: Path, walk: bool) -> Path:
    """The control file with the daemon's report; ``walk``: the one that needs every file."""
    return mount / CONTROL_DIR / (NAMESPACES if walk else USAGE)
