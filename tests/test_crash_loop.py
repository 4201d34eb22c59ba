"""kill -9, over and over: no final name holds a partial or wrong chunk, nothing lands outside
the backing directory (the audit's acceptance check; tools/crash_loop.py runs it at full size)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import SESSION_OPTIONS, Mount
from tools import crash_loop, vllm_io

REPO = Path(__file__).resolve().parents[1]

SIZE = 4 << 20  # the chunk the killed writer meant to write
WRITTEN = 1 << 20  # what it had written when it died
PIECE = 256 << 10

# A client that writes a chunk straight to its final name in several write() calls and dies
# (SIGKILL, fd still open) a quarter of the way in: the kernel closes the fd for it, so the
# daemon sees FLUSH and RELEASE exactly as after a clean close(), minus the rest of the bytes.
DIES_MID_FILE = f"""
import os, signal, sys
from tools import vllm_io
path, key = sys.argv[1], int(sys.argv[2])
data = vllm_io.chunk_bytes(key, {SIZE})
os.makedirs(os.path.dirname(path), exist_ok=True)
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
for offset in range(0, {WRITTEN}, {PIECE}):
    assert os.write(fd, data[offset : offset + {PIECE}]) == {PIECE}
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_9_loop_leaves_no_partial_chunk_and_writes_nothing_outside_the_backing(
    tmp_path: Path,
) -> None:
    """15 rounds of the tool's loop, both kill orders, all three kinds of store: the daemon and
    the writers die at random points; every final name in the backing directory (after the
    crash) and in the mount (after the remount) is whole and right, every store a writer saw
    succeed before the daemon died is there (but those closed as it died, which a cache may
    drop), none succeeded after, and the directory under the mountpoint stays empty."""
    report = crash_loop.run(rounds=15, seed=15, workdir=tmp_path, mount_options=SESSION_OPTIONS)
    orders = {r.order for r in report.per_round}
    assert orders == {"daemon_first", "writers_first"}  # seed 15 draws 7 and 8 of them
    assert report.stores_acked > 100 and report.chunks_verified > report.stores_acked
    failures = {kind: n for kind, n in report.failures.items() if n}
    assert not failures, "\n".join(report.examples)


def _absent_or_whole(path: str, key: int) -> str:
    """'' if ``path`` is gone or holds the whole chunk; else what is wrong with it."""
    found = crash_loop.classify(path, key, SIZE)
    return "" if found is None or not found[0] else f"{path}: {found[0]}, {found[1]}"


def test_a_writer_killed_mid_file_leaves_no_partial_file_under_the_final_name(
    fresh_mount: Mount,
) -> None:
    """Not every client publishes by rename. One that writes the final name directly and is
    killed after 1 MiB of 4 MiB must leave the name absent: a partial file there would be
    served to every later reader, with a valid checksum (audit defect D10)."""
    key = 7
    path = vllm_io.chunk_path(str(fresh_mount.path), key)
    died = subprocess.run([sys.executable, "-c", DIES_MID_FILE, path, str(key)], cwd=REPO)
    assert died.returncode == -signal.SIGKILL

    # The kernel sends FLUSH and then RELEASE (asynchronously) for the dead writer's fd: give
    # the daemon a moment to take the name back, then it must be gone or whole.
    deadline = time.monotonic() + 5
    while _absent_or_whole(path, key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _absent_or_whole(path, key)

    # ... and so must it stay across a clean unmount (which publishes what is left to publish),
    # in the backing directory (a vLLM root without the mount) and in the next mount.
    fresh_mount.stop()
    backing = path.replace(str(fresh_mount.path), str(fresh_mount.backing), 1)
    assert not _absent_or_whole(backing, key)
    fresh_mount.start()
    assert not _absent_or_whole(path, key)
    assert not os.path.exists(path)  # whole is impossible: the rest was never written
