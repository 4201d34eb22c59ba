"""The control protocol: the read-only `.kvfs/` directory and the `user.kvfs.*` xattrs.

    .kvfs/usage.json       capacity, usage, counters and per-namespace totals (no walk: cheap)
    .kvfs/namespaces.json  the same plus reads, oldest and newest read per namespace (walks)

They are generated when opened, so `cat` and `kvfs ls`/`kvfs du` see the daemon's state of that
moment. The name `.kvfs` cannot collide with vLLM's paths (they start with the model name), and
the backing directory's own `.kvfs/` is never shown, so this one is purely virtual.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

import pyfuse3

from kvfs import namespaces
from kvfs.index import ROOT_INO, Node
from kvfs.io_queues import Queue
from kvfs.mount.objects import Objects
from kvfs.mount.scrub import ScrubStats

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


def report(
    objects: Objects,
    scrub: ScrubStats,
    session: dict[str, object],
    lookups: dict[int, Counter[str]],
    walk: bool,
) -> dict[str, Any]:
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
        "evictions": dict(evictor.evictions),
        "counters": dict(objects.counters),
        "lookups": {
            "hit": sum(c["hit"] for c in lookups.values()),
            "miss": sum(c["miss"] for c in lookups.values()),
        },
        "checksum_failures": objects.checksum_failures,
        "deadline_expiries": objects.deadline_expiries,
        "scrub": dataclasses.asdict(scrub),
        "session": session,
        "queues": {
            q.value: {"waiting": objects.pool.depth(q), "running": objects.pool.busy[q]}
            for q in Queue
        },
        "write_buffer": {"used": objects.budget.used, "capacity": objects.budget.capacity},
        "namespaces": list(namespaces.namespaces(index, lookups, walk)),
    }


def xattrs(
    node: Node, objects: Objects, report: Callable[[bool], dict[str, Any]]
) -> dict[bytes, bytes]:
    """A node's ``user.kvfs.*`` attributes, answered from memory (the kernel never caches
    xattrs): its pin; a namespace's model and totals; a file's checksum and reads; the root's
    daemon-wide figures."""
    values = {  # pin: set on this node; pinned: in effect (it, or a directory above, is pinned)
        b"user.kvfs.pin": b"1" if node.pinned else b"0",
        b"user.kvfs.pinned": b"1" if objects.index.pinned(node) else b"0",
    }
    if node.is_dir and node.parent is not None and node.parent.ino == ROOT_INO:
        ns = namespaces.summary(objects.index, node)
        values[b"user.kvfs.model"] = str(ns["model"] or ns["namespace"]).encode()
        values[b"user.kvfs.chunks"] = b"%d" % ns["chunks"]
        values[b"user.kvfs.bytes"] = b"%d" % ns["bytes"]
        if ns["tokens"] is not None:
            values[b"user.kvfs.tokens"] = b"%d" % ns["tokens"]
    if node.is_file:
        if node.checksum is not None:
            values[b"user.kvfs.checksum"] = node.checksum.encode()
        values[b"user.kvfs.hits"] = b"%d" % node.hits
        if node.hits:  # a chunk never read has its write time as recency: not a read
            stamp = datetime.fromtimestamp(node.last_read_ns / 1e9, UTC)
            values[b"user.kvfs.last_read"] = stamp.isoformat(timespec="milliseconds").encode()
    if node.ino == ROOT_INO:
        state = report(False)
        values[b"user.kvfs.backing"] = objects.store.root
        for key in ("pid", "capacity", "used", "checksum_failures", "deadline_expiries"):
            values[b"user.kvfs." + key.encode()] = b"%d" % state[key]
        values[b"user.kvfs.evictions"] = b"%d" % sum(state["evictions"].values())
        # Files open for writing or closed but not yet published (their last release).
        values[b"user.kvfs.unpublished"] = b"%d" % objects.unpublished
    return values


async def set_xattr(objects: Objects, node: Node, name: bytes, value: bytes | None) -> None:
    """Set (``value``) or remove (None) an attribute: ``user.kvfs.pin`` = 1 exempts a file, or
    everything under a directory, from eviction, 0 or removing it undoes that (kept with the
    backing file: it survives a restart); ``user.kvfs.evict`` on the root evicts what
    ``kvfs evict`` asks; ``user.kvfs.verify`` on a file checks it (see `verify`). Raises OSError:
    ENOTSUP for any other name, EINVAL for another value."""
    if name == b"user.kvfs.evict" and node.ino == ROOT_INO and value is not None:
        await objects.evict_by_request(value.decode(errors="replace"))
        return
    if name == b"user.kvfs.verify" and value is not None:
        await verify(objects, node)
        return
    if name not in (b"user.kvfs.pin", b"user.kvfs.pinned"):
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))
    flag = b"0" if value is None else value.strip()
    if flag not in (b"0", b"1"):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    await objects.set_pinned(node, flag == b"1")


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
