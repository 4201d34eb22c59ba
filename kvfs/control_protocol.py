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
from typing import Any, NotRequired, TypedDict

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


class NamespaceReport(TypedDict):
    """One namespace: a model's config directory with its ``_r<rank>`` data directories."""

    namespace: str
    directories: list[str]
    ranks: list[int]
    model: str | None
    dtype: str | None
    tokens_per_chunk: int | None
    chunks: int
    bytes: int
    tokens: int | None  # every rank holds its shard of the same tokens: counted once
    lookups: int  # hits + misses
    hit_rate: float | None
    # namespaces.json only (they need every file):
    reads: NotRequired[int]
    pinned_bytes: NotRequired[int]
    oldest_read: NotRequired[str | None]  # ISO 8601, of the chunks read at least once
    newest_read: NotRequired[str | None]


class QueueReport(TypedDict):
    waiting: int
    running: int


class Report(TypedDict):
    """usage.json and namespaces.json: the daemon's state at the moment the file was opened."""

    time: float  # seconds since the epoch
    pid: int
    backing: str
    capacity: int  # bytes
    used: int  # bytes held, in whole 4 KiB blocks
    reserved: int  # bytes promised to files being published
    pinned_bytes: int
    files: int
    bytes: int  # sum of the file sizes
    evictions: dict[str, int]  # files, by reason
    evicted_bytes: dict[str, int]
    counters: dict[str, Any]  # reads, bytes_read, publishes, ..., publish_failures by reason
    lookups: dict[str, int]  # hit, miss
    checksum_failures: int
    deadline_expiries: int
    scrub: dict[str, int]  # files, bytes, passes, failures
    session: dict[str, object]  # name, passthrough, opens by kind
    queues: dict[str, QueueReport]  # read, write
    write_buffer: dict[str, int]  # used, capacity
    namespaces: list[NamespaceReport]
