"""Which FUSE session serves a mount: pyfuse3 (libfuse) or kvfs's own kernel session.

Both drive the same operations and object layer. The kernel session speaks the protocol on
/dev/fuse itself, so it can ask for FUSE_PASSTHROUGH: the kernel writes new chunks into their
backing files itself and, where the daemon need not see every read (``--verify
first-read``), reads published chunks straight from theirs. It also answers first-time
misses without a thread hop and uses less CPU a byte served (docs/benchmarks.md, session
30): ``auto`` takes it wherever it may, as root on a backing store that cannot hang (a
passthrough write or read of a hung NFS server hangs in the kernel, past any deadline the
daemon keeps).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyfuse3

from kvfs.config import MountConfig
from kvfs.mount.kernel_session import FuseSession, KernelSession

# Backing filesystems whose reads can stall indefinitely (a server or a daemon behind them).
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "9p", "lustre", "afs")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    best, kind = "", "unknown"
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[fields.index("-") + 1]
    return kind


def may_hang(kind: str) -> bool:
    """Whether reads of a filesystem of type ``kind`` can stall on a server or a daemon. A
    FUSE filesystem that does not pass through itself (sshfs) has stack depth 0: the kernel
    accepts its files as passthrough backing files, and such a read would hang in the kernel."""
    return kind in NETWORK_FILESYSTEMS or kind.startswith("fuse")


def choose(cfg: MountConfig) -> tuple[FuseSession, str]:
    """The session for ``cfg``, and why (for the log)."""
    io_uring = cfg.io_uring == "auto"
    if cfg.session == "pyfuse3":
        return pyfuse3, "asked for"
    if cfg.session == "kernel":
        kind = filesystem_type(cfg.backing)
        if may_hang(kind):  # the kernel would take an sshfs or NFS file as a backing file
            why = f"asked for; backing store on {kind}: no passthrough, reads keep the deadline"
            return KernelSession(passthrough=False, io_uring=io_uring), why
        return KernelSession(io_uring=io_uring), "asked for"
    if os.geteuid() != 0:
        return pyfuse3, "not root: a /dev/fuse mount and passthrough need CAP_SYS_ADMIN"
    kind = filesystem_type(cfg.backing)
    if may_hang(kind):
        return pyfuse3, f"backing store on {kind}: a passthrough read could hang past any deadline"
    return KernelSession(io_uring=io_uring), f"root, backing store on {kind}"


def name(session: FuseSession) -> str:
    return "kernel" if isinstance(session, KernelSession) else "pyfuse3"


def passthrough(session: FuseSession) -> bool:
    """Whether the kernel granted this session passthrough (known once it is mounted)."""
    return isinstance(session, KernelSession) and session.passthrough


def names_flush_caller(session: FuseSession) -> bool:
    """Whether the session's FLUSH names the thread that closes the file (kvfs's own does;
    pyfuse3 gives ``flush()`` no request context)."""
    return isinstance(session, KernelSession)


def holds_backing(session: FuseSession, ino: int) -> bool:
    """Whether the session can pass an open of ``ino`` through to a backing file it still
    holds (the kernel session keeps those of recent opens)."""
    return isinstance(session, KernelSession) and session.holds_backing(ino)


def report(session: FuseSession) -> dict[str, object]:
    """Which session serves the mount and, for kvfs's own, how its opens went."""
    if not isinstance(session, KernelSession):
        return {"name": "pyfuse3", "passthrough": False}
    session.time_ring_misses()  # (the report is made on the loop)
    stats = session.stats
    return {
        "name": "kernel",
        "passthrough": session.passthrough,
        "io_uring": session.io_uring,
        "ring_misses": stats.ring_misses,
        "passthrough_opens": stats.passthrough_opens,
        "served_opens": stats.served_opens,
        "backing_reused": stats.backing_reused,
        "backing_refused": stats.backing_refused,
    }


def describe(session: FuseSession, cfg: MountConfig) -> str:
    if cfg.verify == "first-read" and passthrough(session):
        return "reads pass through to the backing files once a chunk is verified"
    if cfg.verify == "first-read":
        return "reads served by the daemon (no passthrough from this kernel or session)"
    if passthrough(session):
        return "new chunks written in passthrough; every read served by the daemon and verified"
    return "every read served by the daemon and verified"
