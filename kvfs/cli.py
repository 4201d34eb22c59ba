"""The ``kvfs`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvfs import __version__, mountctl, verify
from kvfs.config import ConfigError, MountConfig, default_backing_dir, parse_size
from kvfs.eviction import POLICIES


def _cmd_mount(args: argparse.Namespace) -> int:
    backing = args.backing or default_backing_dir(args.mountpoint)
    cfg = MountConfig(  # validated here, so a bad option fails before anything starts
        mountpoint=args.mountpoint,
        backing=backing,
        write_buffer_bytes=parse_size(args.write_buffer, "--write-buffer"),
        io_timeout=args.io_timeout or None,
        capacity=args.capacity,
        eviction=args.eviction,
    )
    options = [
        f"--write-buffer={cfg.write_buffer_bytes}",
        f"--io-timeout={args.io_timeout}",
        f"--capacity={cfg.capacity}",
        f"--eviction={cfg.eviction}",
        *(["--debug"] if args.debug else []),
    ]
    pid = mountctl.mount(args.mountpoint, backing, options, args.foreground)
    print(f"kvfs: mounted {args.mountpoint.absolute()} (backing {backing.absolute()}, pid {pid})")
    return 0


def _cmd_umount(args: argparse.Namespace) -> int:
    mountctl.unmount(args.mountpoint)
    print(f"kvfs: unmounted {Path(args.mountpoint).absolute()}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    report = verify.verify(args.path, progress=not args.json and sys.stderr.isatty())
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(
            f"kvfs: verified {report.files} files ({report.bytes} bytes): "
            f"{len(report.bad)} bad (quarantined), {len(report.errors)} unreadable, "
            f"{len(report.unverified)} without a checksum"
        )
        for path in report.bad:
            print(f"bad: {path}")
        for path in report.errors:
            print(f"unreadable: {path}")
    return 1 if report.bad or report.errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfs", description="KV-cache chunks on a filesystem tier"
    )
    parser.add_argument("--version", action="version", version=f"kvfs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    mount = commands.add_parser(
        "mount",
        help="mount a kvfs tier",
        description="Mount a kvfs tier at MOUNTPOINT. The command returns "
        "once the mount answers; the daemon keeps running detached.",
    )
    mount.add_argument("mountpoint", type=Path)
    mount.add_argument(
        "--backing",
        type=Path,
        help="directory that holds the chunks (default: /var/cache/kvfs/<mountpoint>)",
    )
    mount.add_argument(
        "--foreground",
        action="store_true",
        help="run the daemon in this process instead of detaching",
    )
    mount.add_argument(
        "--write-buffer",
        default="1G",
        help="memory for files being written; writers wait beyond it (default 1G)",
    )
    mount.add_argument(
        "--io-timeout",
        type=float,
        default=MountConfig.io_timeout,
        help="seconds a request may wait on the backing store before EIO "
        "(default %(default)s; 0 waits forever)",
    )
    mount.add_argument(
        "--capacity",
        default=MountConfig.capacity,
        help="bytes the tier may hold, with K/M/G/T, or a percentage of the backing "
        "filesystem (default %(default)s); past it the least valuable chunks are evicted",
    )
    mount.add_argument(
        "--eviction",
        choices=sorted(POLICIES),
        default=MountConfig.eviction,
        help="lru: least recently read first (default); s3fifo: scan-resistant",
    )
    mount.add_argument("--debug", action="store_true", help="log every request")
    mount.set_defaults(run=_cmd_mount)

    umount = commands.add_parser(
        "umount",
        help="unmount a kvfs tier",
        description="Unmount MOUNTPOINT and wait for its daemon to exit.",
    )
    umount.add_argument("mountpoint", type=Path)
    umount.set_defaults(run=_cmd_umount)

    check = commands.add_parser(
        "verify",
        help="check every chunk against its checksum",
        description="Read every file under PATH (a mount, or a backing directory no daemon "
        "serves) and check it against its checksum. Bad files are moved to the quarantine "
        "(.kvfs/quarantine in the backing directory). Exit status 1 if any was bad.",
    )
    check.add_argument("path", type=Path)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(run=_cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (mountctl.MountError, ConfigError, verify.VerifyError) as err:
        print(f"kvfs: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
