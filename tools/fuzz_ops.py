"""Invariant fuzz of a mount: threads apply random operations with hostile names and values.

Each thread picks, over and over, one of creates, reads, O_DIRECT and appending writes,
renames (of files and directories), links, symlinks, unlinks, truncates, touches, chmods,
xattrs (kvfs's own, foreign, oversized), namespace ``config.json`` files of any content, the
control files, and vLLM-style chunk stores, on names drawn from a small hostile set (255
bytes, invalid UTF-8, a newline, ``.kvfs``, engine temp names...) so that they collide. Errors
are expected (most of these are refused); what must hold:

- no call hangs (every thread ends within a minute of the run's end);
- the daemon lives, and logs neither a traceback nor any warning or error (each is a defect:
  a false alarm, or a real one);
- after the unmount, ``kvfs verify`` finds every chunk of the backing directory whole, and a
  new daemon indexes it.

    python -m tools.fuzz_ops [--seconds 60] [--threads 4] [--seed 1] [--session kernel]

Exits 1 on any violation, printing it. The session of 2026-12-07 found three defects this way
(a touch taken for a change around the mount, recency written through a symlink, a scrub
warning on a file unlinked meanwhile) and, with kill -9 rounds added (``tools.crash_loop``),
a daemon that could not exit (``kvfs/watchdog.py``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvfs import config
from tools.scratch_mount import KVFS, temporary_mount

NAMES = [b"a", b"b.bin", b"c", b"0123456789abcdef.bin", b"x" * 255, b"\xff\xfe", b".kvfs"]
NAMES += [b"..a", b"config.json", b"-", b"a b", b"\n", b"f_1234.tmp", b"0123456789abcdef.bin_7.tmp"]
DIRS = [b"n0", b"n1", b"d"]
XATTRS = [b"user.kvfs.pin", b"user.kvfs.checksum", b"user.kvfs.pinned", b"user.x"]
XATTRS += [b"security.capability", b"trusted.x", b"user.kvfs.recency", b"user.kvfs." + b"z" * 200]
VALUES = [b"1", b"0", b"", b"xxh3-64:0000000000000000", b"\0" * 70000, b"yes", b"-1", b"9" * 40]
CONFIGS = [b"{}", b"[]", b"null", b'{"capacity": -1}', b'{"capacity": "9999999999T"}', b"\xff"]
CONFIGS += [b'{"a":' * 5000, b"{" + b"1" * 70000 + b"}", b'{"capacity": 1e308}', b'{"x": "50%"}']
CHUNK = 8192  # the chunks stored vLLM's way: one byte value repeated (checked by verify)


class Fuzz:
    def __init__(self, root: Path, seed: int) -> None:
        self.root = os.fsencode(root)
        self.seed = seed
        self.calls = self.refused = 0
        self.ops: list[Callable[[random.Random, bytes, bytes], object]] = [
            self.create,
            lambda r, p, q: Path(os.fsdecode(p)).read_bytes(),
            lambda r, p, q: os.rename(p, q),
            lambda r, p, q: os.unlink(p),
            lambda r, p, q: os.mkdir(p),
            lambda r, p, q: os.rmdir(p),
            lambda r, p, q: os.setxattr(p, r.choice(XATTRS), r.choice(VALUES)),
            lambda r, p, q: os.getxattr(p, r.choice(XATTRS)),
            lambda r, p, q: os.removexattr(p, r.choice(XATTRS)),
            lambda r, p, q: os.listxattr(p),
            lambda r, p, q: os.truncate(p, r.choice([0, 1, 4096, 1 << 20])),
            lambda r, p, q: os.chmod(p, r.choice([0o644, 0o4755, 0, 0o777])),
            lambda r, p, q: os.utime(p, ns=(r.getrandbits(62), r.getrandbits(62))),
            lambda r, p, q: os.link(p, q),
            lambda r, p, q: os.symlink(q, p),
            lambda r, p, q: os.listdir(os.path.dirname(p)),
            lambda r, p, q: (os.stat(p), os.statvfs(self.root)),
            self.pread,
            self.append,
            self.store_chunk,
            self.store_chunk,
            self.write_config,
            self.move_dir,
            self.control,
        ]

    def path(self, r: random.Random) -> bytes:
        parts = [r.choice(DIRS) for _ in range(r.randrange(3))]
        return os.path.join(self.root, *parts, r.choice(NAMES))

    def create(self, r: random.Random, p: bytes, q: bytes) -> None:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        flags = os.O_CREAT | os.O_WRONLY | r.choice([0, os.O_TRUNC, os.O_EXCL])
        fd = os.open(p, flags, 0o644)
        try:
            os.write(fd, r.randbytes(r.choice([0, 1, 4096, 70000])))
        finally:
            os.close(fd)

    def pread(self, r: random.Random, p: bytes, q: bytes) -> None:
        fd = os.open(p, os.O_RDONLY | r.choice([0, os.O_DIRECT]))
        try:
            os.pread(fd, r.choice([1, 4096, 1 << 20]), r.choice([0, 4096, 1 << 30]))
        finally:
            os.close(fd)

    def append(self, r: random.Random, p: bytes, q: bytes) -> None:
        fd = os.open(p, os.O_RDWR | os.O_APPEND)
        try:
            os.write(fd, b"q" * r.choice([1, 5000]))
            os.fsync(fd)
        finally:
            os.close(fd)

    def store_chunk(self, r: random.Random, p: bytes, q: bytes) -> None:
        """vLLM's store, O_DIRECT or not: temp name, one write, rename over the chunk name."""
        directory = os.path.join(self.root, b"d")
        os.makedirs(directory, exist_ok=True)
        final = os.path.join(directory, b"%016x.bin" % r.randrange(64))
        tmp = final + b"_%d.tmp" % r.getrandbits(40)
        data = mmap.mmap(-1, CHUNK)  # page-aligned, for O_DIRECT
        data.write(bytes([r.randrange(256)]) * CHUNK)
        direct = r.choice([0, os.O_DIRECT])
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | direct, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, final)

    def write_config(self, r: random.Random, p: bytes, q: bytes) -> None:
        top = os.path.join(self.root, r.choice(DIRS))
        os.makedirs(top, exist_ok=True)
        Path(os.fsdecode(os.path.join(top, b"config.json"))).write_bytes(r.choice(CONFIGS))

    def move_dir(self, r: random.Random, p: bytes, q: bytes) -> None:
        old, new = r.choice([b"n0", b"n1", b"d", b"n0/n1"]), r.choice([b"n0", b"n1/n0", b"x"])
        os.rename(os.path.join(self.root, old), os.path.join(self.root, new))

    def control(self, r: random.Random, p: bytes, q: bytes) -> None:
        control = os.path.join(self.root, b".kvfs")
        os.listdir(control)
        name = r.choice([b"usage.json", b"x", b"pins"])
        Path(os.fsdecode(os.path.join(control, name))).read_bytes()

    def worker(self, index: int, until: float) -> None:
        r = random.Random(self.seed * 1000 + index)
        while time.monotonic() < until:
            op = r.choice(self.ops)
            try:
                op(r, self.path(r), self.path(r))
            except (OSError, ValueError):  # refused: fine, as long as nothing else breaks
                self.refused += 1
            self.calls += 1


def daemon_complaints(mountpoint: Path) -> list[str]:
    """The daemon log's tracebacks, warnings and errors."""
    log = config.daemon_log(mountpoint)
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line] + [
        "a traceback" for _ in range(text.count("Traceback"))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--session", default="auto", help="kvfs mount --session")
    args = parser.parse_args(argv)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvfs-fuzz-", dir="/var/tmp") as base:
        options = ("--session", args.session, "--capacity", "64M")
        with temporary_mount(Path(base), *options) as mnt:
            pid = int(os.getxattr(mnt, "user.kvfs.pid"))
            fuzz = Fuzz(mnt, args.seed)
            until = time.monotonic() + args.seconds
            threads = [
                threading.Thread(target=fuzz.worker, args=(i, until), daemon=True)
                for i in range(args.threads)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(args.seconds + 60)
            if any(thread.is_alive() for thread in threads):
                problems.append("a call hung (threads still waiting a minute after the end)")
                return report(fuzz, problems)  # (the mount stays: look at it)
            if not os.path.exists(f"/proc/{pid}"):
                problems.append(f"the daemon {pid} died")
        problems += daemon_complaints(mnt)
        backing = Path(base) / "backing"
        verify = subprocess.run([*KVFS, "verify", str(backing)], capture_output=True, text=True)
        if verify.returncode != 0:
            problems.append(f"kvfs verify: {verify.stdout.strip() or verify.stderr.strip()}")
        again = subprocess.run(
            [*KVFS, "mount", str(mnt), "--backing", str(backing)], capture_output=True, text=True
        )  # a new daemon indexes what the fuzz left
        if again.returncode != 0:
            problems.append(f"mounting it again: {again.stderr.strip()}")
        subprocess.run([*KVFS, "umount", str(mnt)], capture_output=True, check=False)
    return report(fuzz, problems)


def report(fuzz: Fuzz, problems: list[str]) -> int:
    print(f"{fuzz.calls} calls ({fuzz.refused} refused), seed {fuzz.seed}")
    for problem in problems:
        print(f"  {problem}")
    if not problems:
        print("no hang, no daemon complaint, every chunk verified")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
