"""``mount.fuse.kvfs``: what mount(8) runs for ``mount -t fuse.kvfs BACKING MOUNTPOINT -o ...``.

mount(8) looks for ``/sbin/mount.<type>`` (``make install`` links it there) and runs it
as ``mount.fuse.kvfs SOURCE TARGET [-sfnv] [-o OPTIONS]``; an fstab line of type ``fuse.kvfs``
goes the same way, at boot too. The source is the backing directory and the options are
``kvfs mount``'s, as NAME=VALUE (kvfs.mount_options); what mount(8) and fstab pass for
themselves (rw, nofail, _netdev, x-systemd.*...) is dropped. Like ``kvfs mount`` it returns
once the mount answers, so a unit ordered after the mount finds it serving.
"""

from __future__ import annotations

import argparse
import sys

from kvfs import cli, mount_options
from kvfs.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mount.fuse.kvfs",
        description="Mount a kvfs tier as mount(8) does: mount -t fuse.kvfs BACKING "
        "MOUNTPOINT -o capacity=50%%,session=kernel (the options of kvfs mount, as NAME=VALUE)",
    )
    parser.add_argument("backing", help="the backing directory (fstab's first field)")
    parser.add_argument("mountpoint")
    parser.add_argument("-o", dest="options", action="append", default=[], help="options")
    parser.add_argument("-t", dest="type", help="fuse.kvfs (when run through mount.fuse)")
    parser.add_argument("-f", dest="fake", action="store_true", help="check, mount nothing")
    parser.add_argument("-n", action="store_true", help="ignored (no mtab to write)")
    parser.add_argument("-s", action="store_true", help="ignored (sloppy)")
    parser.add_argument("-v", action="store_true", help="ignored (verbose)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.type not in (None, "fuse.kvfs", "kvfs"):
        print(f"mount.fuse.kvfs: -t {args.type}: this helper mounts fuse.kvfs", file=sys.stderr)
        return cli.FAILED
    try:
        settings, fuse = mount_options.split_o(args.options, mount8=True)
    except ConfigError as err:
        print(f"kvfs: {err}", file=sys.stderr)
        return cli.FAILED
    if args.fake:
        return 0
    ours = mount_options.join_o(settings, fuse)
    backing = ["--backing", args.backing]
    return cli.main(["mount", args.mountpoint, *backing, *(["-o", ours] if ours else [])])


if __name__ == "__main__":
    sys.exit(main())
