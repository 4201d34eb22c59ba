"""What the daemon reads of a client from /proc: a thread's process, and whether a process
is being torn down by a signal (its partial file then is never published)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from kvfs import process


def test_a_thread_belongs_to_its_process() -> None:
    found: list[tuple[int, int]] = []

    def record() -> None:
        tid = threading.get_native_id()
        found.append((tid, process.thread_group(tid)))

    worker = threading.Thread(target=record)
    worker.start()
    worker.join()
    (tid, group), pid = found[0], os.getpid()
    assert tid != pid and group == pid
    assert process.thread_group(pid) == pid


def test_a_gone_thread_is_its_own_group() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    gone = int(done.stdout)
    assert process.thread_group(gone) == gone  # /proc does not tell: the id as given


def wait_zombie(pid: int) -> None:
    """Until ``pid`` has exited and is not reaped yet (its exit code still in /proc)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"{pid} did not exit")


def test_killed_by_a_signal_is_told_from_an_exit() -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exits = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert not process.killed_by_signal(alive.pid)  # alive and well
        os.kill(alive.pid, signal.SIGKILL)
        wait_zombie(alive.pid)
        wait_zombie(exits.pid)
        assert process.killed_by_signal(alive.pid)
        assert not process.killed_by_signal(exits.pid)  # an exit code is no signal
    finally:
        for child in (alive, exits):
            child.kill()
            child.wait()
