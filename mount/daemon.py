"""The daemon process: build the index, mount, tell the launcher we are up, serve, clean up."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path

import trio
import zmq

from kvfs import cpu_latency, mount_options, mountctl, watchdog
from kvfs.config import ConfigError, MountConfig, parse_capacity
from kvfs.eviction import make_policy
from kvfs.index import Index
from kvfs.mount import sessions, systemd
from kvfs.mount.kernel_session import FuseSession
from kvfs.mount.operations import KvfsOperations
from kvfs.mountctl import READY
from kvfs.store import BackingBusy, BackingStore

log = logging.getLogger("kvfs.mount")

READ_AHEAD_KB = 4096  # 1 MiB READ requests instead of 128 KiB (research/fuse.md §3.2)


def _mount_device(mountpoint: str) -> str | None:
    """The mount's major:minor, read from mountinfo (stat'ing the mount would deadlock us)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[4] == mountpoint and fields[sep + 1] == "fuse.kvfs":
                return fields[2]
    return None


def _raise_read_ahead(mountpoint: str) -> None:
    dev = _mount_device(mountpoint)
    try:
        Path(f"/sys/class/bdi/{dev}/read_ahead_kb").write_text(str(READ_AHEAD_KB))
    except OSError as err:
        log.info("could not raise read-ahead of %s: %s", mountpoint, err)


def _keep_freed_memory() -> None:
    """Make glibc reuse freed chunk buffers instead of returning them to the kernel.

    Every file passes through a buffer of its size. By default glibc serves blocks over 128 KiB
    with fresh mmaps and unmaps them on free, so each buffer pays page faults and zeroing on
    every touch: measured here 0.68 GB/s to fill a fresh 2 MiB bytearray, against 15 GB/s once
    freed memory is kept in the arenas (up to the 32 MiB mmap threshold glibc allows).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: keep its defaults
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def fuse_options(cfg: MountConfig) -> set[str]:
    """The FUSE mount options: kvfs's own, and only the ones the operator asked for (-o).

    No ``auto_unmount``: when the daemon dies the mount must stay, answering ENOTCONN, rather
    than vanish and leave the bare directory on the root disk for engines to fill. No
    ``allow_other`` unless asked: other users' processes cannot reach the chunks by default.
    The backing directory is the source ``df`` and ``findmnt`` show (the type says fuse.kvfs).
    """
    own = {f"fsname={fsname(cfg.backing)}", "subtype=kvfs", "noatime"}
    if os.geteuid() != 0 or "allow_other" in cfg.fuse_options:
        own.add("default_permissions")  # the kernel checks mode bits: pyfuse3's default
    # Else only root's processes reach the mount, and mode bits do not restrict root: without
    # default_permissions the kernel skips the attribute round trips it would make to check
    # them (a GETATTR of the directory after each create or rename, of a file after its
    # publish), and an engine's access() of a chunk it stored is answered from the kernel's
    # cache. access() itself answers ENOSYS: the kernel then stops asking (ACCESS).
    return own | set(cfg.fuse_options)


def fsname(backing: Path) -> str:
    """The mount's source: its backing directory, unless the path holds what an option list
    cannot carry (libfuse splits at commas and takes backslashes as escapes)."""
    text = str(backing)
    return "kvfs" if "," in text or "\\" in text else text


def serve(cfg: MountConfig, ready_fd: int | None) -> int:
    def tell(message: str) -> None:
        if message != READY:
            log.error("%s", message.removeprefix("error: "))
        if ready_fd is not None:
            os.write(ready_fd, message.encode() + b"\n")

    if cfg.cpu_latency_us is not None:
        try:  # held until this process ends, whichever way: the kernel drops it with the fd
            cpu_latency.hold(cfg.cpu_latency_us)
        except OSError as err:  # asked for by name: refused, not served slower
            tell(f"error: --cpu-latency: {cpu_latency.DEVICE}: {err.strerror}")
            return 1
    _keep_freed_memory()
    store = BackingStore(os.fsencode(cfg.backing), cfg.shared)
    try:
        orphans = store.prepare()
        index = Index(policy=make_policy(cfg.eviction))
        engine_temps = store.scan(index)
    except (BackingBusy, OSError) as err:
        tell(f"error: {err}")
        return 1
    log.info(
        "indexed %s: %d files, %d bytes, %d directories; removed %d orphan temp files",
        cfg.backing,
        index.files,
        index.bytes,
        index.dirs,
        orphans + engine_temps,
    )
    kind = sessions.filesystem_type(cfg.backing)
    if store.hides_unlinked:
        log.info(
            "backing directory on %s hides a file unlinked while open (.fuse_hidden*, .nfs*)"
            " until it is closed, and may keep it when the close races the unlink: names are"
            " unlinked from this daemon's .kvfs/ temp directory, emptied at each mount",
            kind,
        )
    if kind.startswith("fuse"):  # sshfs and its kin answer flock in this host's kernel only
        log.warning(
            "backing directory on %s: its locks hold on this host only, so kvfs cannot refuse"
            " a daemon on another host that serves it with the same --shared id, or without"
            " --shared; give every host its own id and mount it --shared everywhere",
            kind,
        )
    try:
        # A percentage is of what the tier may have of the disk: what kvfs holds there already
        # and what is free (a shared disk's other data is not kvfs's to count on).
        disk = store.statvfs()
        usable = min(disk.f_blocks, disk.f_bavail) * disk.f_frsize + index.charged
        capacity = parse_capacity(cfg.capacity, min(usable, disk.f_blocks * disk.f_frsize))
    except ConfigError as err:
        tell(f"error: {err}")
        return 1
    session, why = sessions.choose(cfg)
    try:  # the ports first: a busy one fails the mount, not the daemon after it answered
        ops = KvfsOperations(cfg, store, index, capacity, session)
    except zmq.ZMQError as err:
        tell(f"error: --events {cfg.events}: {err}")
        return 1
    except OSError as err:  # --shared: the share's journals could not be read or resumed
        tell(f"error: {cfg.backing}: the share's journals: {err}")
        return 1
    if cfg.metrics_port is not None:
        try:
            ops.metrics.serve(cfg.metrics_port, cfg.metrics_address)
        except OSError as err:
            tell(f"error: --metrics-port {cfg.metrics_address}:{cfg.metrics_port}: {err.strerror}")
            ops.close()
            return 1
    mountpoint = str(cfg.mountpoint)
    try:
        guarded = mountctl.prepare_mountpoint(mountpoint)
    except (mountctl.MountError, OSError) as err:
        tell(f"error: {err}")
        ops.close()
        return 1
    try:
        session.init(ops, mountpoint, fuse_options(cfg))
    except RuntimeError as err:
        tell(f"error: cannot mount {mountpoint}: {err}")
        if guarded:
            mountctl.remove_guard(mountpoint)
        ops.close()
        return 1
    _raise_read_ahead(mountpoint)
    watchdog.start(mountpoint, os.getpid())
    log.info(
        "mounted %s (backing %s, capacity %d bytes, %d used, eviction %s, pid %d)",
        mountpoint,
        cfg.backing,
        capacity,
        index.charged,
        cfg.eviction,
        os.getpid(),
    )
    log.info("session: %s (%s); %s", sessions.name(session), why, sessions.describe(session, cfg))
    if cfg.cpu_latency_us is not None:
        log.info(
            "holding a CPU latency request of %d us (the machine's bound now: %d us)",
            cfg.cpu_latency_us,
            cpu_latency.current(),
        )
    tell(READY)
    if ready_fd is not None:
        os.close(ready_fd)
    else:  # in the foreground: under systemd, Type=notify waits for this
        systemd.notify(
            "READY=1",
            f"MAINPID={os.getpid()}",
            f"STATUS=serving {mountpoint} (backing {cfg.backing}, capacity {capacity} bytes)",
        )
    try:
        trio.run(serve_requests, ops)
    finally:
        if ready_fd is None:
            systemd.notify("STOPPING=1", f"STATUS=unmounting {mountpoint}")
        session.close(unmount=True)
        ops.close()
        store.close()
        log.info("unmounted %s", mountpoint)
    return 0


async def serve_requests(ops: KvfsOperations) -> None:
    """Serve until the mount goes away or SIGTERM/SIGINT asks us to stop; beside the FUSE
    session run the object layer's sweep, the scrub, the KV events and /metrics."""
    cfg = ops.cfg
    async with trio.open_nursery() as nursery:
        ops.objects.start(nursery)
        nursery.start_soon(ops.scrub.run_forever)
        nursery.start_soon(_stop_on_signal, ops.session)
        if ops.listener.events is not None:
            nursery.start_soon(ops.listener.events.flush_forever)
        if cfg.metrics_port is not None:  # serving since before the mount
            nursery.start_soon(ops.metrics.refresh_forever, partial(ops.report, False))
        await ops.session.main(min_tasks=4, max_tasks=128)
        nursery.cancel_scope.cancel()


async def _stop_on_signal(session: FuseSession) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            session.terminate()
            return


def build_parser() -> argparse.ArgumentParser:
    """The daemon's arguments: those of ``kvfs mount`` (kvfs.mount_options) that reach it."""
    parser = argparse.ArgumentParser(
        prog="python -m kvfs.mount", description="kvfs FUSE daemon (started by `kvfs mount`)"
    )
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--backing", type=Path, required=True)
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--fuse-option", action="append", default=[])
    mount_options.add_arguments(parser, daemon=True)
    return parser


def config_from(args: argparse.Namespace) -> MountConfig:
    """The daemon's MountConfig from its arguments; raises ConfigError."""
    return mount_options.config(
        args.mountpoint.resolve(), args.backing.resolve(), vars(args), args.fuse_option
    )


def parse_config(argv: list[str]) -> MountConfig:
    return config_from(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        cfg = config_from(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return serve(cfg, args.ready_fd)
