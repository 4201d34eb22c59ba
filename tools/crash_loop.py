"""kill -9 loop: the daemon and the engine's writers die at random points, over and over.

The audit's acceptance check for crash safety: a loop of at least 100 rounds, each of which
mounts kvfs over the same backing directory, starts 1-3 writer processes that store chunks the
way vLLM's fs tier does (and the way a client that writes straight to the final name does), and
then ``kill -9``s the daemon and the writers at random moments, in either order. After every
round it checks the two promises that a crash must never break:

- **no partial or wrong chunk under a final name**: every ``<hex>.bin`` in the backing directory
  (right after the crash, before any remount can tidy up) and in the mount (after the remount)
  holds exactly the bytes its key implies. A missing chunk is fine (a cache may drop data); a
  store the writer saw succeed must be there and exact, unless an eviction could have taken it
  or the death cut its publish short (its bytes still whole in a temp file of the backing store).
- **no byte outside the backing directory**: once the daemon is dead, nothing may land in the
  bare directory under the mountpoint (a writer that keeps going by path name would put it there
  if the kernel dropped the mount), and no store may succeed after the daemon died.

Chunk content comes from the key alone (``vllm_io.chunk_bytes``), so any file can be checked
from its name, whoever wrote it. Writers log each store they begin and each one that succeeds,
with CLOCK_MONOTONIC times (one clock for every process on the machine), so a success that came
after the daemon's death is caught even when its bytes went nowhere visible.

    python -m tools.crash_loop --rounds 100 --seed 1 [--json]

Exits 1 if any round found a failure. Each round takes about a second (mostly the remount).
The mount is driven through the ``kvfs`` command, as an operator would; nothing from tests/.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import mmap
import os
import random
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvfs import control_protocol, layout, mountctl, vllm_layout
from kvfs.config import parse_size
from tools import vllm_io

KVFS = [sys.executable, "-m", "kvfs.cli"]
REPO = Path(__file__).resolve().parents[1]

CHUNK = 128 << 10  # a small vLLM chunk: many stores per round, a cheap check of every byte
PIECES = 4  # the final-name writer's write() calls per chunk
CAPACITY = 256 << 20  # room for ~2000 chunks: eviction only if a round writes far more
FINAL = re.compile(r"^([0-9a-f]{64})\.bin$")
KINDS = ("rename", "rename_odirect", "final")
EXAMPLES = 5  # failures of each kind described one by one in the report (the rest counted)

# Failure kinds. Each is a count of files (or stores) that broke a promise.
PARTIAL = "partial"  # a final name holds a prefix of its chunk (a torn or early publish)
WRONG = "wrong"  # a final name holds bytes that are not its chunk's (or too many)
UNREADABLE = "unreadable"  # a final name that cannot be read (EIO: the mount found it corrupt)
LOST = "lost"  # a store acked before the death is gone, its bytes nowhere, and no eviction
# could take it. kvfs publishes a file at its last release, which the kernel sends just after
# close() has returned (for a temp file renamed to a free name, right after that rename has
# returned), one trip to the backing store later: a daemon killed before that trip ends drops
# the chunk (a miss, as a cache may), its bytes left whole in a temp file that the next mount
# removes. How long that trip takes is the disk's business (a loaded disk: a tenth of a second
# and more), so the check asks where the bytes are, not how long ago the store returned.
OUTSIDE = "outside_backing"  # files or directories found under the bare mountpoint
ACKED_DEAD = "acked_while_dead"  # a store that succeeded after the daemon had died
FAILURE_KINDS = (PARTIAL, WRONG, UNREADABLE, LOST, OUTSIDE, ACKED_DEAD)


# -- the writers (child processes) ----------------------------------------------------------


def chunk_key(seed: str, seq: int) -> int:
    """A 256-bit key like vLLM's block hashes: chunks spread over the hex directories."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{seq}".encode()).digest(), "big")


def _store_rename(path: str, data: bytes, o_direct: bool) -> float:
    """vLLM 0.33.0's store, syscall for syscall (vllm_io.store), timed before its last syscall.

    Written out rather than calling vllm_io.store: the time before the rename is what tells
    whether the daemon can have served it (see ``acked_while_dead``).
    """
    if os.path.exists(path):
        raise FileExistsError(errno.EEXIST, "chunk already there", path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}_{random.randint(0, 2**63 - 1)}.tmp"
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | (os.O_DIRECT if o_direct else 0)
    buf = vllm_io.aligned(len(data)) if o_direct else data
    if isinstance(buf, mmap.mmap):
        buf[:] = data
    fd = os.open(tmp, flags, 0o644)
    try:
        written = os.write(fd, buf)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(errno.EIO, f"short write: {written} of {len(data)}", tmp)
    last = time.monotonic()
    os.replace(tmp, path)
    return last


def _store_final(path: str, data: bytes, pause: Callable[[], None]) -> float:
    """A client without temp names: the final name, several write() calls, then close.

    The pauses between writes stand for a client that streams a chunk as it produces it; they
    widen the window in which a kill lands mid-file, which is the case a FLUSH-publishes-all
    daemon gets wrong. Returns the time before close(), the call that publishes.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        step = len(data) // PIECES
        for offset in range(0, len(data), step):
            piece = data[offset : offset + step]
            if os.write(fd, piece) != len(piece):
                raise OSError(errno.EIO, "short write", path)
            pause()
    finally:
        last = time.monotonic()
        os.close(fd)
    return last


def run_writer(root: str, log_path: str, seed: str) -> None:
    """Store chunks under ``root`` by its path name (as vLLM does with ``root_dir``) until
    killed. Log lines: ``b KEY KIND`` before a store, ``ok KEY LAST DONE`` after a success
    (LAST: CLOCK_MONOTONIC before the store's last syscall), ``e KEY ERRNO`` after a failure.
    """
    rng = random.Random(seed)
    with open(log_path, "a", buffering=1) as log:
        for seq in range(1 << 62):
            key = chunk_key(seed, seq)
            kind = rng.choice(KINDS)
            path = vllm_io.chunk_path(root, key)
            data = vllm_io.chunk_bytes(key, CHUNK)
            log.write(f"b {key:064x} {kind}\n")
            try:
                if kind == "final":
                    last = _store_final(path, data, lambda: time.sleep(rng.uniform(0, 0.004)))
                else:
                    last = _store_rename(path, data, o_direct=kind == "rename_odirect")
            except OSError as err:
                log.write(f"e {key:064x} {errno.errorcode.get(err.errno or 0, 'EIO')}\n")
                time.sleep(0.001)  # a dead mount fails at once: do not spin
                continue
            log.write(f"ok {key:064x} {last:.6f} {time.monotonic():.6f}\n")
            time.sleep(rng.uniform(0, 0.002))  # some slack: fewer chunks to check per round


# -- checks ---------------------------------------------------------------------------------


@dataclass
class TreeCheck:
    """What one walk of a tree (the backing directory or the mount) found under final names."""

    exact: set[int] = field(default_factory=set)
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, path, detail)
    temps: int = 0  # engine temp names (a writer died before its rename)
    files: int = 0  # every file, whatever its name: what the capacity is charged for


def mount_table() -> list[tuple[str, str]]:
    """(mountpoint, filesystem type) of every mount, in the order /proc/self/mountinfo lists
    them (a mount stacked on another comes after it)."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            where = fields[4].encode().decode("unicode_escape")  # \040 for a space, etc.
            table.append((where, fields[fields.index("-") + 1]))
    return table


def mounts_at(path: str) -> list[str]:
    """The filesystem types mounted on ``path``, bottom first."""
    return [fstype for where, fstype in mount_table() if where == path]


def key_of(path: str) -> int:
    """The key a final chunk name stands for (-1 for any other name)."""
    match = FINAL.match(os.path.basename(path))
    return int(match.group(1), 16) if match else -1


def classify(path: str, key: int, size: int = CHUNK) -> tuple[str, str] | None:
    """None if ``path`` is gone; ("", "") if it holds exactly the ``size`` bytes of ``key``'s
    chunk; else (failure kind, what is wrong)."""
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        return UNREADABLE, err.strerror or str(err)
    expected = vllm_io.chunk_bytes(key, size)
    if data == expected:
        return "", ""
    if len(data) < size and expected.startswith(data):
        return PARTIAL, f"{len(data)} of {size} bytes, a prefix of the chunk"
    return WRONG, f"{len(data)} bytes, not the chunk's {size}"


def check_tree(top: Path) -> TreeCheck:
    """Check every final chunk name under ``top`` (``.kvfs`` at its root left out: the
    backing directory's private area, or the mount's control files)."""
    result = TreeCheck()
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == top and layout.PRIVATE_DIR.decode() in dirnames:
            dirnames.remove(layout.PRIVATE_DIR.decode())
        for name in filenames:
            result.files += 1
            match = FINAL.match(name)
            if match is None:
                result.temps += vllm_layout.is_engine_temp(name.encode())
                continue
            key = int(match.group(1), 16)
            found = classify(os.path.join(dirpath, name), key)
            if found is None:
                result.files -= 1
            elif found[0]:
                result.bad.append((found[0], os.path.join(dirpath, name), found[1]))
            else:
                result.exact.add(key)
    return result


def unpublished(top: Path, keys: Iterable[int], size: int = CHUNK) -> set[int]:
    """Those of ``keys`` whose whole chunk lies in a file under ``top`` (``.kvfs`` included)
    that is not its final name: stores whose publish a death cut short, bytes and all."""
    wanted = {vllm_io.chunk_bytes(key, size): key for key in keys}
    found: set[int] = set()
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            if not wanted:
                return found
            path = os.path.join(dirpath, name)
            if FINAL.match(name) or os.lstat(path).st_size != size:
                continue
            with open(path, "rb") as f:
                key = wanted.pop(f.read(), None)
            if key is not None:
                found.add(key)
    return found


@dataclass
class Spill:
    """What lies under the bare mountpoint directory: each entry a write that missed the
    backing directory."""

    files: int = 0
    dirs: int = 0
    bytes: int = 0
    keys: set[int] = field(default_factory=set)  # chunks published there under a final name


def spilled(under: str) -> Spill:
    """Walk the directory under the mountpoint: ``under`` names it through a descriptor opened
    before anything was mounted there (``/proc/self/fd/N``), so whatever is mounted on top (a
    dead mount, a guard) cannot hide what a writer put in it."""
    spill = Spill()
    for dirpath, dirnames, filenames in os.walk(under):
        spill.dirs += len(dirnames)
        spill.files += len(filenames)
        for name in filenames:
            with contextlib.suppress(OSError):
                spill.bytes += os.lstat(os.path.join(dirpath, name)).st_size
            if FINAL.match(name):
                spill.keys.add(key_of(name))
    return spill


def clear(directory: str) -> None:
    """Empty ``directory`` (the bare mountpoint, so that the next mount is allowed)."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def prune(backing: Path, keep: set[int]) -> None:
    """Delete, in the backing directory while nothing serves it, the chunks of earlier rounds
    (already checked twice): the walk stays small and no eviction is ever needed, so a store
    that succeeded and is gone is a loss, not an eviction."""
    for dirpath, _dirnames, filenames in os.walk(backing, topdown=False):
        if Path(dirpath) == backing:
            break
        if dirpath.startswith(str(backing / layout.PRIVATE_DIR.decode())):
            continue
        for name in filenames:
            match = FINAL.match(name)
            if match is not None and int(match.group(1), 16) not in keep:
                os.unlink(os.path.join(dirpath, name))
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)  # only if empty


# -- one round ------------------------------------------------------------------------------


@dataclass
class WriterLog:
    begun: dict[int, str] = field(default_factory=dict)  # key -> kind
    acked: dict[int, float] = field(default_factory=dict)  # key -> time before its last syscall
    errors: Counter[str] = field(default_factory=Counter)


def read_log(path: Path) -> WriterLog:
    """Parse a writer's log; the last line may be cut short by the kill."""
    log = WriterLog()
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            fields = line.split()
            try:
                if fields[0] == "b" and len(fields) == 3:
                    log.begun[int(fields[1], 16)] = fields[2]
                elif fields[0] == "ok" and len(fields) == 4:
                    log.acked[int(fields[1], 16)] = float(fields[2])
                elif fields[0] == "e" and len(fields) == 3:
                    log.errors[fields[2]] += 1
            except (ValueError, IndexError):
                continue
    return log


@dataclass
class RoundResult:
    round: int
    order: str  # "daemon_first" or "writers_first"
    writers: int
    seconds: float
    begun: int  # stores started
    acked: int  # stores the writers saw succeed
    verified: int  # final-name files found exact (backing after the crash + mount after remount)
    temps_left: int  # engine temp names visible after the remount (should be 0: orphans go)
    writer_errors: dict[str, int]
    failures: dict[str, int]


@dataclass
class Report:
    rounds: int
    seed: int
    seconds: float
    chunks_verified: int
    stores_acked: int
    stores_begun: int
    spilled_files: int
    spilled_bytes: int
    acked_missing_evictable: int  # gone, but an eviction was possible: not counted as lost
    dropped_at_death: int  # acked, its publish cut short by the death (bytes in a temp): a miss
    oldest_dropped: float  # seconds from the oldest such store's last syscall to the death
    temps_left: int  # engine temp names seen after remounts (the daemon should remove them)
    failures: dict[str, int]
    examples: list[str]
    per_round: list[RoundResult]

    @property
    def ok(self) -> bool:
        return not any(self.failures.values())


class CrashLoop:
    """One mountpoint and one backing directory, mounted, crashed and checked round after round."""

    def __init__(
        self, base: Path, seed: int, mount_options: Sequence[str] = (), capacity: int = CAPACITY
    ) -> None:
        self.mnt, self.backing = base / "mnt", base / "backing"
        self.mount_options = tuple(mount_options)
        self.capacity = capacity
        self.mnt.mkdir()
        self.backing.mkdir()
        # The directory under the mountpoint, as it is before anything is mounted on it.
        self.under_fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        self.under = f"/proc/self/fd/{self.under_fd}"
        self.base = base
        self.rng = random.Random(seed)
        self.seed = seed
        self.pid = 0
        self.writers: list[subprocess.Popen[bytes]] = []
        self.failures: Counter[str] = Counter({kind: 0 for kind in FAILURE_KINDS})
        self.examples: list[str] = []
        self.spilled_files = self.spilled_bytes = 0
        self.kinds: dict[int, str] = {}  # key -> how it was stored, this round and the last
        self.evictable_missing = 0
        self.dropped_at_death = 0
        self.oldest_dropped = 0.0
        self.files_at_start = 0
        self.last_begun: set[int] = set()
        self.seen: set[tuple[str, int]] = set()

    # mount handling

    def mount(self) -> None:
        args = ["mount", str(self.mnt), "--backing", str(self.backing)]
        done = subprocess.run(
            [*KVFS, *args, "--capacity", str(self.capacity), *self.mount_options],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"kvfs mount failed: {done.stderr.strip()}")
        self.pid = int(os.getxattr(self.mnt, control_protocol.PID))

    def kvfs_mounted(self) -> bool:
        """Whether a kvfs mount, alive or dead, is on the mountpoint (not counting anything a
        newer ``kvfs mount`` may keep under it, such as a read-only guard)."""
        try:
            os.stat(self.mnt)
        except OSError as err:
            if err.errno in mountctl.DEAD:  # a dead FUSE connection
                return True
            raise
        return "fuse.kvfs" in mounts_at(str(self.mnt))

    def drop_dead_mount(self) -> None:
        """After the daemon died: today ``auto_unmount`` has dropped the mount (or is about to);
        with a daemon that leaves the dead mount for the next ``kvfs mount``, it is still there
        (ENOTCONN). Either way, detach it lazily, as an operator would, before mounting again."""
        if self.kvfs_mounted():
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        deadline = time.monotonic() + 10
        while self.kvfs_mounted():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mnt} is still mounted after fusermount3 -u -z")
            time.sleep(0.01)

    def close(self) -> None:
        """Kill what is left of this loop's processes and unmount everything on the mountpoint
        (``kvfs umount`` first: it knows what ``kvfs mount`` put there), however things stand."""
        for proc in self.writers:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.writers = []
        for _ in range(5):
            stack = mounts_at(str(self.mnt))
            if not stack:
                break
            done = subprocess.run([*KVFS, "umount", str(self.mnt)], capture_output=True)
            if done.returncode != 0 and mounts_at(str(self.mnt)) == stack:
                lazy = (
                    ["fusermount3", "-u", "-z"]
                    if stack[-1].startswith("fuse")
                    else ["umount", "-l"]
                )
                subprocess.run([*lazy, str(self.mnt)], capture_output=True)
        if self.pid and mountctl.running(self.pid):
            os.kill(self.pid, signal.SIGKILL)  # the daemon this loop started, by its pid
        self.pid = 0

    # the round

    def kill_daemon(self) -> float:
        """kill -9 the daemon; returns a time just after its death (CLOCK_MONOTONIC).

        A pidfd says the moment it exits (the daemon is not our child: no waitpid), so a store
        that begins its last syscall after this time cannot have been served by it.
        """
        with contextlib.ExitStack() as stack:
            try:
                pidfd = os.pidfd_open(self.pid)
                stack.callback(os.close, pidfd)
            except OSError:
                pidfd = -1
            os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while mountctl.running(self.pid):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon {self.pid} survived kill -9")
                if pidfd >= 0:
                    select.select([pidfd], [], [], 1.0)
                else:
                    time.sleep(0.002)
        self.pid = 0
        return time.monotonic()

    def kill_writers(self, spread: float) -> None:
        """kill -9 each writer at its own random moment within ``spread`` seconds."""
        moments = sorted((self.rng.uniform(0, spread), i) for i in range(len(self.writers)))
        start = time.monotonic()
        for moment, i in moments:
            time.sleep(max(0.0, start + moment - time.monotonic()))
            self.writers[i].kill()
        for proc in self.writers:
            proc.wait(30)
        self.writers = []

    def start_writers(self, number: int, round_no: int) -> list[Path]:
        logs = []
        for i in range(number):
            log = self.base / f"writer-{round_no}-{i}.log"
            logs.append(log)
            args = ["writer", str(self.mnt), str(log), f"{self.seed}/{round_no}/{i}"]
            self.writers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tools.crash_loop", *args],
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 10  # until each has begun its first store
        while not all(log.exists() and log.stat().st_size for log in logs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.writers):
                raise RuntimeError("a writer did not start")
            time.sleep(0.005)
        return logs

    def writer_of(self, path_or_key: str | int) -> str:
        key = path_or_key if isinstance(path_or_key, int) else key_of(path_or_key)
        kind = self.kinds.get(key)
        return f"; stored by a {kind!r} store" if kind else ""

    def fail(
        self, round_no: int, kind: str, what: str, counts: Counter[str], n: int = 1, key: int = -1
    ) -> None:
        """Count a failure; a bad file is counted once, however many checks see it again."""
        if key >= 0:
            if (kind, key) in self.seen:
                return
            self.seen.add((kind, key))
        counts[kind] += n
        self.failures[kind] += n
        if sum(line.startswith(f"{kind}:") for line in self.examples) < EXAMPLES:
            self.examples.append(f"{kind}: round {round_no}: {what}")

    def round(self, round_no: int) -> RoundResult:
        started = time.monotonic()
        counts: Counter[str] = Counter()
        number = self.rng.randint(1, 3)
        logs = self.start_writers(number, round_no)
        time.sleep(self.rng.uniform(0, 0.4))  # a random moment in the write stream
        daemon_first = self.rng.random() < 0.6
        if daemon_first:
            dead_at = self.kill_daemon()
            self.kill_writers(spread=0.15)  # they keep writing at the dead mount meanwhile
        else:
            self.kill_writers(spread=0.1)
            time.sleep(self.rng.uniform(0, 0.05))  # the daemon may be mid-publish
            dead_at = self.kill_daemon()
        self.drop_dead_mount()

        # Nothing may have landed under the bare mountpoint.
        spill = spilled(self.under)
        if spill.files or spill.dirs:
            self.spilled_files += spill.files
            self.spilled_bytes += spill.bytes
            what = (
                f"{spill.files} files ({spill.bytes} bytes) and {spill.dirs} directories "
                f"under the bare {self.mnt}"
            )
            self.fail(round_no, OUTSIDE, what, counts, n=spill.files + spill.dirs)
            clear(self.under)

        writer_logs = [read_log(log) for log in logs]
        begun = {key for log in writer_logs for key in log.begun}
        self.kinds = {key: self.kinds[key] for key in self.kinds.keys() & self.last_begun}
        self.kinds.update((key, kind) for log in writer_logs for key, kind in log.begun.items())
        acked = {key: last for log in writer_logs for key, last in log.acked.items()}
        errors: Counter[str] = sum((log.errors for log in writer_logs), Counter())
        # A success after the death, or one whose chunk is under the bare mountpoint (its last
        # syscall can precede the moment the death was seen by a hair), was not the daemon's.
        for key, last in acked.items():
            if last > dead_at:
                what = f"{key:064x}: its last syscall {last - dead_at:.3f}s after the death"
                self.fail(round_no, ACKED_DEAD, what, counts, key=key)
            elif key in spill.keys:
                what = f"{key:064x}: published under the bare mountpoint"
                self.fail(round_no, ACKED_DEAD, what, counts, key=key)

        # The backing directory right after the crash: what vLLM would read with no mount.
        after_crash = check_tree(self.backing)
        for kind, path, detail in after_crash.bad:
            what = f"{path} (backing, after the crash): {detail}{self.writer_of(path)}"
            self.fail(round_no, kind, what, counts, key=key_of(path))
        cut_short = unpublished(self.backing, acked.keys() - after_crash.exact)
        prune(self.backing, keep=begun)

        self.mount()
        remounted = check_tree(self.mnt)
        for kind, path, detail in remounted.bad:
            what = f"{path} (mount, after the remount): {detail}{self.writer_of(path)}"
            self.fail(round_no, kind, what, counts, key=key_of(path))
        # Eviction only starts past the low watermark: below it, a vanished store was lost.
        could_evict = (self.files_at_start + len(begun)) * CHUNK > 0.9 * self.capacity
        for key in acked.keys() - remounted.exact:
            if (ACKED_DEAD, key) in self.seen:
                continue  # counted already: it never reached the daemon
            if key in cut_short:
                self.dropped_at_death += 1
                self.oldest_dropped = max(self.oldest_dropped, dead_at - acked[key])
            elif could_evict:
                self.evictable_missing += 1
            else:
                what = f"{key:064x}: acked, missing after the remount{self.writer_of(key)}"
                self.fail(round_no, LOST, what, counts, key=key)
        self.files_at_start = remounted.files
        self.last_begun = begun

        result = RoundResult(
            round=round_no,
            order="daemon_first" if daemon_first else "writers_first",
            writers=number,
            seconds=round(time.monotonic() - started, 3),
            begun=len(begun),
            acked=len(acked),
            verified=len(after_crash.exact) + len(remounted.exact),
            temps_left=remounted.temps,
            writer_errors=dict(errors),
            failures={kind: counts[kind] for kind in FAILURE_KINDS if counts[kind]},
        )
        for log in logs:
            log.unlink()
        return result


@contextlib.contextmanager
def _workdir(base: Path | None) -> Iterator[Path]:
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="kvfs-crash-", dir=base))
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            if not any(m == str(path) or m.startswith(f"{path}/") for m, _ in mount_table()):
                shutil.rmtree(path)  # never through something still mounted


def run(
    rounds: int,
    seed: int,
    workdir: Path | None = None,
    say: Callable[[str], None] | None = None,
    mount_options: Sequence[str] = (),
    capacity: int = CAPACITY,
) -> Report:
    """Run the loop (``kvfs mount`` given ``mount_options`` too, a session for one); never
    leaves a mount or a process of its own behind."""
    say = say or (lambda line: None)
    started = time.monotonic()
    per_round: list[RoundResult] = []
    with _workdir(workdir) as base:
        loop = CrashLoop(base, seed, mount_options, capacity)
        try:
            loop.mount()
            for round_no in range(rounds):
                result = loop.round(round_no)
                per_round.append(result)
                say(
                    f"round {round_no}: {result.order}, {result.writers} writers, "
                    f"{result.acked}/{result.begun} stores acked, {result.verified} verified, "
                    f"failures {result.failures or 0} ({result.seconds:.2f}s)"
                )
            loop.close()  # a clean unmount: then the bare mountpoint must be empty too
            spill = spilled(loop.under)
            if spill.files or spill.dirs:
                loop.spilled_files += spill.files
                loop.spilled_bytes += spill.bytes
                what = f"{spill.files} files, {spill.dirs} directories after the last unmount"
                loop.fail(rounds, OUTSIDE, what, Counter(), n=spill.files + spill.dirs)
        finally:
            loop.close()
            os.close(loop.under_fd)
    return Report(
        rounds=rounds,
        seed=seed,
        seconds=round(time.monotonic() - started, 2),
        chunks_verified=sum(r.verified for r in per_round),
        stores_acked=sum(r.acked for r in per_round),
        stores_begun=sum(r.begun for r in per_round),
        spilled_files=loop.spilled_files,
        spilled_bytes=loop.spilled_bytes,
        acked_missing_evictable=loop.evictable_missing,
        dropped_at_death=loop.dropped_at_death,
        oldest_dropped=round(loop.oldest_dropped, 3),
        temps_left=sum(r.temps_left for r in per_round),
        failures=dict(loop.failures),
        examples=loop.examples,
        per_round=per_round,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["writer"]:  # a writer process of the loop (not for operators)
        run_writer(*argv[1:4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where the temp directory goes (/tmp)")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    parser.add_argument(
        "--mount-options", default="", help="more kvfs mount options, e.g. '--session kernel'"
    )
    parser.add_argument(
        "--capacity",
        type=parse_size,
        default=CAPACITY,
        help="the tier's capacity (256M: eviction only if a round writes far more; 8M evicts"
        " in every round, so kills land amid evictions and the kernel invalidations they send)",
    )
    args = parser.parse_args(argv)
    report = run(
        args.rounds,
        args.seed,
        args.workdir,
        say=lambda line: print(line, file=sys.stderr),
        mount_options=shlex.split(args.mount_options),
        capacity=args.capacity,
    )
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        per = report.seconds / max(1, report.rounds)
        print(
            f"{report.rounds} rounds in {report.seconds:.1f}s ({per:.2f}s each), "
            f"seed {report.seed}: "
            f"{report.stores_acked} of {report.stores_begun} stores acked, "
            f"{report.chunks_verified} chunk checks exact, "
            f"{report.acked_missing_evictable} acked but evictable and gone, "
            f"{report.dropped_at_death} publishes cut short by the death and dropped "
            f"(the oldest acked {report.oldest_dropped:.3f}s before it), "
            f"{report.spilled_files} files ({report.spilled_bytes} bytes) spilled, "
            f"{report.temps_left} temp names left after remounts"
        )
        print("failures: " + ", ".join(f"{k} {v}" for k, v in report.failures.items()))
        for line in report.examples:
            print(f"  {line}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
