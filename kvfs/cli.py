"""The ``kvfs`` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvfs import __version__, inspect, mount_options, mountctl, verify
from kvfs.config import ConfigError, MountConfig, default_backing_dir


def _cmd_mount(args: argparse.Namespace) -> int:
    settings, fuse = mount_options.split_o(args.option)
    values = mount_options.merged(args, settings)
    if values["supervise"] and values["foreground"]:
        raise ConfigError(
            "--supervise and --foreground: a foreground daemon is supervised by what runs it "
            "(systemd's Restart=)"
        )
    backing = args.backing or default_backing_dir(args.mountpoint)
    # validated here, so a bad option fails before anything starts
    cfg = mount_options.config(args.mountpoint, backing, values, fuse)
    started = mountctl.mount(
        args.mountpoint,
        backing,
        daemon_options(cfg, values["debug"]),
        values["foreground"],
        values["supervise"],
    )
    supervised = f", supervisor pid {started.supervisor}" if started.supervisor else ""
    print(
        f"kvfs: mounted {args.mountpoint.absolute()} "
        f"(backing {backing.absolute()}, pid {started.pid}{supervised})"
    )
    return 0


def daemon_options(cfg: MountConfig, debug: bool = False) -> list[str]:
    """The daemon's arguments for a validated config, each one token (``--key=value``)."""
    return mount_options.daemon_argv(cfg, debug)


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
    return FOUND if report.bad or report.errors else 0


def _emit(args: argparse.Namespace, result: tuple[Mapping[str, Any], str]) -> int:
    data, text = result
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    return _emit(args, inspect.ls(args.mountpoint))


def _cmd_du(args: argparse.Namespace) -> int:
    return _emit(args, inspect.du(args.mountpoint))


def _cmd_stat(args: argparse.Namespace) -> int:
    return _emit(args, inspect.stat(args.path))


def _cmd_evict(args: argparse.Namespace) -> int:
    older = parse_age(args.older_than) if args.older_than else None
    return _emit(args, inspect.evict(args.mountpoint, args.namespace, older, args.dry_run))


def _cmd_top(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live view ends
        inspect.top(args.mountpoint, args.interval, args.count, args.json)
    return 0


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number above zero, or a usage error naming the value."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
        return value

    return parse


def parse_age(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``7d``, ``1w`` into seconds. The unit is required: ``5``
    could mean seconds or days, and the wrong guess evicts everything."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    try:
        age = float(text[:-1]) * units[text[-1]]
    except (ValueError, IndexError, KeyError):
        age = -1
    if not age > 0:
        raise ConfigError(
            f"--older-than: {text!r} is not an age with a unit (90s, 15m, 2h, 7d, 1w)"
        )
    return age


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
        "once the mount answers; the daemon keeps running detached. "
        "`mount -t fuse.kvfs BACKING MOUNTPOINT -o NAME=VALUE,...` and fstab take the same "
        "options (docs/deployment.md).",
    )
    mount.add_argument("mountpoint", type=Path, help="an empty directory to mount on")
    mount.add_argument("--backing", type=Path, metavar="DIR", help=mount_options.BACKING_HELP)
    mount_options.add_arguments(mount, daemon=False)
    mount.add_argument(
        "-o",
        dest="option",
        metavar="OPTION[,OPTION]",
        action="append",
        default=[],
        help=mount_options.O_HELP,
    )
    mount.set_defaults(run=_cmd_mount)

    umount = commands.add_parser(
        "umount",
        help="unmount a kvfs tier",
        description="Unmount MOUNTPOINT and wait for its daemon to exit; also stops its "
        "supervisor and removes its read-only guard. A dead mount is unmounted lazily.",
    )
    umount.add_argument("mountpoint", type=Path, help="a kvfs mount")
    umount.set_defaults(run=_cmd_umount)

    check = commands.add_parser(
        "verify",
        help="check every chunk against its checksum",
        description="Read every file under PATH (a mount, or a backing directory no daemon "
        "serves) and check it against its checksum. Bad files are moved to the quarantine "
        "(.kvfs/quarantine in the backing directory). Exit status 1 if any was bad or "
        "unreadable, 2 if the check could not run.",
    )
    check.add_argument(
        "path", type=Path, help="a mount (or in one), or a backing directory no daemon serves"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(run=_cmd_verify)

    for name, run, help_text in (
        (
            "ls",
            _cmd_ls,
            "a table per namespace: ranks, chunks, size, pinned, tokens, reads, hit rate, "
            "last read",
        ),
        ("du", _cmd_du, "usage against the capacity, per namespace"),
    ):
        report = commands.add_parser(
            name, help=help_text, description=help_text.capitalize() + ", from the running daemon."
        )
        report.add_argument("mountpoint", type=Path, help="a kvfs mount")
        report.add_argument("--json", action="store_true", help="print the report as JSON")
        report.set_defaults(run=run)

    show = commands.add_parser(
        "stat",
        help="size, checksum, hits, last read, pin of a path",
        description="What the daemon knows of one file or directory.",
    )
    show.add_argument("path", type=Path, help="a file or directory in a kvfs mount")
    show.add_argument("--json", action="store_true", help="print the report as JSON")
    show.set_defaults(run=_cmd_stat)

    live = commands.add_parser(
        "top",
        help="a live view of reads, writes, hits and queues",
        description="Print, every INTERVAL seconds, the rates of reads, "
        "writes, lookup hits and misses, evictions, the I/O queue depths "
        "and the usage. Ctrl-C stops it.",
    )
    live.add_argument("mountpoint", type=Path, help="a kvfs mount")
    live.add_argument(
        "--interval",
        type=positive(float),
        default=1.0,
        help="seconds between lines (default %(default)s)",
    )
    live.add_argument(
        "--count", type=positive(int), help="stop after this many lines (default: at Ctrl-C)"
    )
    live.add_argument("--json", action="store_true", help="one JSON object per line")
    live.set_defaults(run=_cmd_top)

    drop = commands.add_parser(
        "evict",
        help="evict a namespace, or chunks not read for a while",
        description="Evict (delete) chunks now: all of a namespace, or "
        "all not read for AGE. Pinned chunks and files being written stay.",
    )
    drop.add_argument("mountpoint", type=Path, help="a kvfs mount")
    what = drop.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--namespace",
        help="a model's config directory (all its ranks), or one directory at the root, by "
        "name or path (`kvfs ls` lists them)",
    )
    what.add_argument(
        "--older-than",
        metavar="AGE",
        help="not read for AGE: 90s, 15m, 2h, 7d, 1w (the unit is required)",
    )
    drop.add_argument(
        "--dry-run", action="store_true", help="say what would be evicted; evict nothing"
    )
    drop.add_argument("--json", action="store_true", help="print the result as JSON")
    drop.set_defaults(run=_cmd_evict)
    return parser


# Exit statuses: 0 done (nothing bad found); 1 done, and `kvfs verify` found bad or unreadable
# chunks; 2 the command failed (bad arguments, nothing mounted there, the daemon refused...).
FOUND = 1
FAILED = 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 too (argparse)
    try:
        return int(args.run(args))
    except (mountctl.MountError, ConfigError, verify.VerifyError, inspect.InspectError) as err:
        print(f"kvfs: {err}", file=sys.stderr)
    except BrokenPipeError:  # `kvfs ls | head -1`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 128 + signal.SIGPIPE  # what the shell reports for a writer killed by SIGPIPE
    except OSError as err:  # a path that is not there, a daemon that is gone...
        where = f"{err.filename}: " if err.filename else ""
        print(f"kvfs: {where}{err.strerror or err}", file=sys.stderr)
    return FAILED


if __name__ == "__main__":
    sys.exit(main())
