"""The mount's control protocol, one definition for the daemon and its clients (the kvfs CLI,
tools, operators' scripts): a read-only directory at the mount's root and ``user.kvfs.*``
extended attributes.

    MOUNT/.kvfs/usage.json       capacity, usage, counters, per-namespace totals (cheap)
    MOUNT/.kvfs/namespaces.json  the same plus what needs every file (reads, pinned, last read)
    MOUNT/.kvfs/lookup           a batched lookup: write a request, read one byte per name

Read on any node: ``pin`` (set on it), ``pinned`` (in effect: it or a directory above).
On a file: ``checksum``, ``hits``, ``last_read`` (only once read).
On a namespace directory: ``model``, ``chunks``, ``bytes``, ``tokens``.
On the root: ``pid``, ``backing``, ``capacity``, ``used``, ``evictions``, ``checksum_failures``,
``deadline_expiries``, ``unpublished``, ``unsealed`` (published files whose checksum is not
taken yet) and ``evicted.<id>`` (an evict request's outcome).
Written: ``pin`` (0/1, anywhere), ``evict`` (JSON, on the root), ``verify`` (on a file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

CONTROL_DIR = ".kvfs"
USAGE = "usage.json"
NAMESPACES = "namespaces.json"
LOOKUP = "lookup"

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
UNSEALED = PREFIX + "unsealed"
RootCount = Literal["pid", "capacity", "used", "checksum_failures", "deadline_expiries"]
ROOT_COUNTS: tuple[RootCount, ...] = (
    "pid",
    "capacity",
    "used",
    "checksum_failures",
    "deadline_expiries",
)
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
    checksum_backlog: dict[str, int]  # deferred, sealed, waiting, waiting_bytes
    session: dict[str, object]  # name, passthrough, opens by kind
    queues: dict[str, QueueReport]  # read, write
    write_buffer: dict[str, int]  # used, capacity
    namespaces: list[NamespaceReport]
    # --shared only (else None): the share as the journals tell it (mount/share.py): used,
    # files, lease_holder, holder, journal_lag_seconds, skipped_lines, hosts (per-host tails)...
    share: dict[str, Any] | None


# -- the batched lookup ---------------------------------------------------------------------
#
# One request answers many names from the daemon's index, instead of one FUSE LOOKUP per path
# component of each. On one handle of MOUNT/.kvfs/lookup (opened O_RDWR), a client writes
#
#     BASE "\n" NAME ("\n" NAME)* ["\n"]
#
# at offset 0 (a request larger than one WRITE continues at the offset where the last ended),
# then reads at offset 0 one byte per NAME: HIT ("1", a regular file by that name) or MISS
# ("0"). BASE is a directory relative to the mount's root ("" for the root itself), each NAME a
# path relative to BASE. Components are never empty, ".", ".." or longer than NAME_MAX; no
# symlink is followed; the caller needs search permission on every directory walked (else
# EACCES). A malformed request fails its read with EINVAL and counts nothing; one over
# LOOKUP_MAX_REQUEST bytes fails its write with EFBIG. A miss counts in the namespace's hit
# rate as a LOOKUP's does (the final name asked in an existing directory); a hit counts when
# the chunk is opened, as always.
LOOKUP_MAX_REQUEST = 16 << 20
LOOKUP_HIT = ord("1")
LOOKUP_MISS = ord("0")


def lookup_requests(base: str, names: Iterable[str]) -> Iterable[bytes]:
    """The requests that ask for ``names`` under ``base``: one unless they exceed the limit."""
    head = os.fsencode(base) + b"\n"
    names = names if isinstance(names, list) else list(names)
    body = os.fsencode("\n".join(names))
    # The usual case, in a few C passes: it fits, and no name holds a newline (the joined
    # body would hold more than one between each two names).
    if len(head) + len(body) <= LOOKUP_MAX_REQUEST and body.count(b"\n") == len(names) - 1:
        yield head + body
        return
    batch: list[bytes] = []
    size = len(head)
    for name in names:
        line = os.fsencode(name)
        if b"\n" in line:
            raise ValueError(f"a name with a newline cannot be asked: {name!r}")
        if batch and size + len(line) + 1 > LOOKUP_MAX_REQUEST:
            yield head + b"\n".join(batch)
            batch, size = [], len(head)
        batch.append(line)
        size += len(line) + 1
    if batch:
        yield head + b"\n".join(batch)


def ask(fd: int, base: str, names: list[str]) -> list[bool]:
    """Whether each of ``names`` is a file on the mount, asked on ``fd``, an O_RDWR handle of
    ``.kvfs/lookup`` (kept open across requests: no open per request)."""
    found: list[bool] = []
    for request in lookup_requests(base, names):
        written = 0
        while written < len(request):  # a short count past the first piece: write on
            written += os.pwrite(fd, memoryview(request)[written:], written)
        asked = request.count(b"\n")
        answer = bytearray()
        while len(answer) < asked:
            part = os.pread(fd, asked - len(answer), len(answer))
            if not part:
                raise OSError(f"batched lookup: {len(answer)} answers of {asked}")
            answer += part
        found.extend(map(LOOKUP_HIT.__eq__, answer))
    return found


def lookup_mount(path: str) -> Path | None:
    """The kvfs mount that holds ``path`` (the nearest mount point above it that answers
    batched lookups), or None: a plain directory."""
    here = Path(os.path.realpath(path))
    for candidate in (here, *here.parents):
        if os.path.ismount(candidate) and (candidate / CONTROL_DIR / LOOKUP).is_file():
            return candidate
    return None


class LookupClient:
    """Batched lookups of one client thread after another, on one handle of ``.kvfs/lookup``
    kept open (no open per request), reopened once if the daemon was remounted since."""

    def __init__(self, mount: Path) -> None:
        self.file = mount / CONTROL_DIR / LOOKUP
        self._fd: int | None = None
        self._lock = threading.Lock()  # one request at a time on the handle; close() races

    def ask(self, base: str, names: list[str]) -> list[bool]:
        with self._lock:
            for attempt in (0, 1):
                if self._fd is None:
                    self._fd = os.open(self.file, os.O_RDWR | os.O_CLOEXEC)
                try:
                    return ask(self._fd, base, names)
                except OSError:
                    # A remounted daemon (--supervise) answers a new handle only: once more.
                    os.close(self._fd)
                    self._fd = None
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def batch_lookup(mount: Path, base: str, names: list[str]) -> list[bool]:
    """`ask` on a handle of its own: ``names`` relative to ``base``, itself relative to the
    mount's root."""
    fd = os.open(mount / CONTROL_DIR / LOOKUP, os.O_RDWR)
    try:
        return ask(fd, base, names)
    finally:
        os.close(fd)
