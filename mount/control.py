"""The daemon's side of the control protocol (kvfs/control_protocol.py names it): the
read-only `.kvfs/` directory and the `user.kvfs.*` xattrs.

The control files are generated when opened, so `cat` and `kvfs ls`/`kvfs du` see the
daemon's state of that moment. The name `.kvfs` cannot collide with vLLM's paths (they start
with the model name), and the backing directory's own `.kvfs/` is never shown, so this one is
purely virtual.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial

import pyfuse3

from kvfs import checksum, namespaces
from kvfs import control_protocol as proto
from kvfs.index import ROOT_INO, Node
from kvfs.io_queues import Queue
from kvfs.mount.objects import Objects
from kvfs.mount.scrub import ScrubStats

DIR_INO = 1 << 62  # far above any inode the index hands out
FILES = {
    proto.USAGE.encode(): DIR_INO + 1,
    proto.NAMESPACES.encode(): DIR_INO + 2,
    proto.LOOKUP.encode(): DIR_INO + 3,
}
LOOKUP_INO = FILES[proto.LOOKUP.encode()]
NAME = proto.CONTROL_DIR.encode()


def is_control(ino: int) -> bool:
    return DIR_INO <= ino <= DIR_INO + len(FILES)


def attrs(ino: int, timeout: float) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = ino
    attr.entry_timeout = attr.attr_timeout = timeout
    attr.st_mode = (stat.S_IFDIR | 0o555) if ino == DIR_INO else (stat.S_IFREG | 0o444)
    if ino == LOOKUP_INO:  # anyone may ask; each walk checks the asker's search permission
        attr.st_mode = stat.S_IFREG | 0o666
    attr.st_nlink = 2 if ino == DIR_INO else 1
    attr.st_size = 0  # generated on open, read with direct I/O: the size is not known before
    now = time.time_ns()
    attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = now
    return attr


def render(ino: int, report: Callable[[bool], proto.Report]) -> bytes:
    """The content of a control file; ``report(walk)`` builds the daemon's report."""
    walk = ino == FILES[proto.NAMESPACES.encode()]
    return json.dumps(report(walk), indent=2).encode() + b"\n"


def report(
    objects: Objects,
    scrub: ScrubStats,
    session: dict[str, object],
    lookups: dict[int, Counter[str]],
    walk: bool,
) -> proto.Report:
    """The daemon's state for `kvfs ls`/`du`/`top` (``walk`` adds what needs every file)."""
    index, evictor = objects.index, objects.evictor
    return {
        "time": time.time(),
        "pid": os.getpid(),
        "backing": os.fsdecode(objects.store.root),
        "capacity": evictor.capacity,
        "used": evictor.used,
        "reserved": evictor.reserved,
        "pinned_bytes": index.pinned_bytes(),
        "files": index.files,
        "bytes": index.bytes,
        "evictions": {str(why): n for why, n in evictor.evictions.items()},
        "evicted_bytes": {str(why): n for why, n in evictor.evicted_bytes.items()},
        "counters": objects.counters.report(),
        "lookups": {
            "hit": sum(c["hit"] for c in lookups.values()),
            "miss": sum(c["miss"] for c in lookups.values()),
        },
        "checksum_failures": objects.checksum_failures,
        "deadline_expiries": objects.deadline_expiries,
        "scrub": dataclasses.asdict(scrub),
        "checksum_backlog": dataclasses.asdict(objects.sealer.stats),
        "session": session,
        "queues": {
            q.value: {"waiting": objects.pool.depth(q), "running": objects.pool.busy[q]}
            for q in Queue
        },
        "write_buffer": {"used": objects.budget.used, "capacity": objects.budget.capacity},
        "namespaces": list(namespaces.namespaces(index, lookups, walk)),
        "share": objects.share.report() if objects.share is not None else None,
    }


def xattrs(
    node: Node, objects: Objects, report: Callable[[bool], proto.Report]
) -> dict[bytes, bytes]:
    """A node's ``user.kvfs.*`` attributes, answered from memory (the kernel never caches
    xattrs): its pin; a namespace's model and totals; a file's checksum and reads; the root's
    daemon-wide figures."""
    values: dict[str, bytes] = {
        proto.PIN: b"1" if node.pinned else b"0",
        proto.PINNED: b"1" if objects.index.pinned(node) else b"0",
    }
    if node.is_dir and node.parent is not None and node.parent.ino == ROOT_INO:
        ns = namespaces.summary(objects.index, node)
        values[proto.MODEL] = str(ns["model"] or ns["namespace"]).encode()
        values[proto.CHUNKS] = b"%d" % ns["chunks"]
        values[proto.BYTES] = b"%d" % ns["bytes"]
        if ns["tokens"] is not None:
            values[proto.TOKENS] = b"%d" % ns["tokens"]
    if node.is_file:
        if node.checksum is not None:
            values[proto.CHECKSUM] = node.checksum.encode()
        values[proto.HITS] = b"%d" % node.hits
        if node.hits:  # a chunk never read has its write time as recency: not a read
            stamp = datetime.fromtimestamp(node.last_read_ns / 1e9, UTC)
            values[proto.LAST_READ] = stamp.isoformat(timespec="milliseconds").encode()
    if node.ino == ROOT_INO:
        state = report(False)
        values[proto.BACKING] = objects.store.root
        for key in proto.ROOT_COUNTS:
            values[proto.PREFIX + key] = b"%d" % state[key]
        values[proto.EVICTIONS] = b"%d" % sum(state["evictions"].values())
        # Files open for writing or closed but not yet published (their last release).
        values[proto.UNPUBLISHED] = b"%d" % objects.unpublished
        values[proto.UNSEALED] = b"%d" % objects.sealer.stats.waiting
        for request_id, result in EVICT_RESULTS.items():
            values[proto.EVICTED + request_id] = result
    return {name.encode(): value for name, value in values.items()}


async def set_xattr(objects: Objects, node: Node, name: bytes, value: bytes | None) -> None:
    """Set (``value``) or remove (None) an attribute: ``user.kvfs.pin`` = 1 exempts a file, or
    everything under a directory, from eviction, 0 or removing it undoes that (kept with the
    backing file: it survives a restart); ``user.kvfs.evict`` on the root evicts what
    ``kvfs evict`` asks (see `evict`); ``user.kvfs.verify`` on a file checks it (see
    `verify`); ``user.kvfs.checksum`` on a file being written declares its checksum (see
    `declare_checksum`). Raises OSError: ENOTSUP for any other name, EINVAL for another
    value."""
    if name == proto.EVICT.encode() and node.ino == ROOT_INO and value is not None:
        await evict(objects, value)
        return
    if name == proto.VERIFY.encode() and value is not None:
        await verify(objects, node)
        return
    if name == proto.CHECKSUM.encode():
        declare_checksum(objects, node, value)
        return
    if name not in (proto.PIN.encode(), proto.PINNED.encode()):
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))
    flag = b"0" if value is None else value.strip()
    if flag not in (b"0", b"1"):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    await objects.set_pinned(node, flag == b"1")


def declare_checksum(objects: Objects, node: Node, value: bytes | None) -> None:
    """``user.kvfs.checksum`` set on a file being written: its writer's checksum of the bytes
    (``xxh3-64:<16 hex>``, as the attribute reads), so that a passthrough file is published
    without reading it back from the disk (``Objects.declare_checksum``); removed: taken back.
    EINVAL for another value; EPERM on a file no one is writing (its checksum is the
    daemon's)."""
    declared = None
    if value is not None:
        try:
            declared = checksum.parse(value)
        except ValueError:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL)) from None
    objects.declare_checksum(node, declared)


async def verify(objects: Objects, node: Node) -> None:
    """Check a file's bytes on the backing store against its checksum, as the scrub does, for
    `kvfs verify`: no read is counted, so hits, recency and the eviction order stay the
    engines'. A mismatch quarantines the file and fails with EBADMSG; a file being written
    (its publish checksums it) with EBUSY; a directory with EISDIR."""
    if not node.is_file:
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
    outcome = await objects.bounded(partial(objects.recheck, node))
    if outcome is None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
    if not outcome[1]:
        raise OSError(errno.EBADMSG, os.strerror(errno.EBADMSG))


# The outcomes of the last `kvfs evict` requests, by the id each request names: setxattr
# cannot answer, so the command reads its own outcome back from the root's xattrs.
EVICT_RESULTS: OrderedDict[str, bytes] = OrderedDict()
EVICT_RESULTS_KEPT = 16
_REQUEST_ID = re.compile(r"^[0-9a-f]{1,32}$")


async def evict(objects: Objects, value: bytes) -> None:
    """``{"request": "namespace=NAME" | "older-than=SECONDS", "id": HEX, "dry_run": BOOL}``
    (JSON, from `kvfs evict`): evict (or count, dry run) and keep the outcome under
    ``user.kvfs.evicted.<id>``. EINVAL for anything else."""
    try:
        asked = json.loads(value)
        request, request_id = asked["request"], asked["id"]
        dry_run = asked.get("dry_run", False)
        valid = (
            isinstance(request, str)
            and isinstance(request_id, str)
            and _REQUEST_ID.match(request_id)
            and dry_run in (0, 1)
        )
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        valid = False
    if not valid:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    files, size = await objects.evict_by_request(request, dry_run=bool(dry_run))
    EVICT_RESULTS[request_id] = json.dumps({"files": files, "bytes": size}).encode()
    while len(EVICT_RESULTS) > EVICT_RESULTS_KEPT:
        EVICT_RESULTS.popitem(last=False)
