"""Deadlines: a stalled backing store never hangs a client past --io-timeout.

The stalled store is real: the backing directory is itself a kvfs mount whose daemon gets
SIGSTOP, so every call the outer daemon makes on it blocks until SIGCONT.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs import vllm_layout
from tests.conftest import Mount, wait_gone
from tests.test_shared import counters
from tools import vllm_io

TIMEOUT = 1.0
CHUNK = 256 << 10


@pytest.fixture
def stacked(tmp_path: Path) -> Iterator[tuple[Mount, Mount]]:
    """An outer kvfs whose backing directory is an inner kvfs mount."""
    for name in ("inner-backing", "inner", "outer"):
        (tmp_path / name).mkdir()
    inner = Mount(tmp_path / "inner", tmp_path / "inner-backing")
    # Below the inner root: there `.kvfs` is the inner daemon's own reserved name.
    outer = Mount(tmp_path / "outer", tmp_path / "inner" / "store", ("--io-timeout", str(TIMEOUT)))
    inner.start()
    try:
        outer.backing.mkdir()
        outer.start()
        try:
            yield outer, inner
        finally:
            os.kill(inner.pid, signal.SIGCONT)
            outer.stop()
    finally:
        inner.stop()


@pytest.mark.timeout(60)
def test_a_read_from_a_stalled_store_fails_within_the_deadline_and_others_are_served(
    stacked: tuple[Mount, Mount],
) -> None:
    outer, inner = stacked
    paths = [vllm_io.chunk_path(str(outer.path), k) for k in range(2)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk(key, CHUNK), o_direct=True)
    outer.settle()  # published (after their renames) and checksummed
    os.kill(inner.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(OSError) as err:
        vllm_io.load(paths[0], CHUNK, o_direct=True)
    elapsed = time.monotonic() - start
    assert err.value.errno == errno.EIO
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 1.0
    # Meanwhile the daemon keeps serving what needs no backing I/O, at once.
    start = time.monotonic()
    assert os.access(paths[1], os.F_OK) and not os.access(paths[1] + "x", os.F_OK)
    assert os.stat(paths[1]).st_size == CHUNK
    assert os.getxattr(paths[1], "user.kvfs.checksum").startswith(b"xxh3-64:")
    assert sorted(os.listdir(os.path.dirname(paths[1]))) == sorted(
        os.path.basename(p) for p in paths
    )
    assert time.monotonic() - start < 0.5
    # Nor does the reader's open, still waiting on the store, hold up names only the index
    # has: a new file is created, renamed while open and removed at once.
    start = time.monotonic()
    fd = os.open(outer.path / "new.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.rename(outer.path / "new.tmp", outer.path / "new.bin")
        os.unlink(outer.path / "new.bin")
        assert time.monotonic() - start < 0.5
    finally:
        with contextlib.suppress(OSError):  # its (empty) bytes may meet the stall
            os.close(fd)
    # A write is buffered, then its publish meets the stall: close() fails within the deadline.
    start = time.monotonic()
    with pytest.raises(OSError) as err:
        vllm_io.store(vllm_io.chunk_path(str(outer.path), 9), vllm_io.chunk_bytes(9, CHUNK))
    assert err.value.errno == errno.EIO and time.monotonic() - start < TIMEOUT + 1.0
    assert int(os.getxattr(outer.path, "user.kvfs.deadline_expiries")) >= 2
    os.kill(inner.pid, signal.SIGCONT)
    # Once the store answers again, so does the mount, with the right bytes.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert vllm_io.load(paths[1], CHUNK, o_direct=True) == vllm_io.chunk_bytes(1, CHUNK)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.timeout(60)
def test_a_close_that_stalls_on_the_store_holds_up_no_other_request(
    stacked: tuple[Mount, Mount],
) -> None:
    outer, inner = stacked
    path = vllm_io.chunk_path(str(outer.path), 0)
    vllm_io.store(path, vllm_io.chunk(0, CHUNK), o_direct=True)
    outer.settle()
    # Should the daemon block on a close, the store wakes up after a while: the test ends.
    wake = threading.Timer(8, os.kill, (inner.pid, signal.SIGCONT))
    wake.start()
    try:
        with open(path, "rb") as reader:
            assert reader.read() == vllm_io.chunk_bytes(0, CHUNK)
            os.kill(inner.pid, signal.SIGSTOP)
        # The kernel now releases the reader: the daemon closes its backing file, which
        # waits on the stalled store. Requests that need no backing I/O answer at once.
        time.sleep(0.2)
        start = time.monotonic()
        assert not os.access(path + "x", os.F_OK)
        assert os.getxattr(outer.path, "user.kvfs.pid")
        assert os.stat(path).st_size == CHUNK
        assert time.monotonic() - start < 0.5
        # And one that does fails within the deadline, never later.
        assert_load_fails_within_the_deadline(path)
    finally:
        wake.cancel()
        os.kill(inner.pid, signal.SIGCONT)


def assert_load_fails_within_the_deadline(path: str) -> None:
    start = time.monotonic()
    with pytest.raises(OSError) as err:
        vllm_io.load(path, CHUNK)
    assert err.value.errno == errno.EIO
    assert time.monotonic() - start < TIMEOUT + 1.0


def closed_temp(path: str, key: int) -> tuple[str, int]:
    """The engine's store up to its rename: a temp file written and closed. The kernel sends
    the RELEASE, which would publish it, as close() returns; the descriptor returned (a dup)
    holds it back, so the rename surely comes first (as it mostly does anyway)."""
    tmp = vllm_layout.temp_name(path)
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY)
    os.write(fd, vllm_io.chunk_bytes(key, CHUNK))
    held = os.dup(fd)
    os.close(fd)
    return tmp, held


@pytest.mark.timeout(60)
def test_a_store_renamed_while_the_store_stalls_returns_at_once_and_is_published_whole_or_dropped(
    stacked: tuple[Mount, Mount],
) -> None:
    """The rename of a closed temp file to the chunk's (free) name answers once the name has
    moved, without waiting on the backing store: with the store stalled it returns at once
    (had it waited for the publish, it would have failed at the deadline). The chunk is
    published once the store answers again; a daemon killed before that drops it (a miss),
    and never leaves part of it under the name."""
    outer, inner = stacked
    kept, dropped = (vllm_io.chunk_path(str(outer.path), key) for key in (3, 4))
    os.makedirs(os.path.dirname(kept))
    for key, path in ((3, kept), (4, dropped)):
        tmp, held = closed_temp(path, key)
        os.kill(inner.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            os.rename(tmp, path)
            assert time.monotonic() - start < TIMEOUT / 2
            assert os.path.exists(path) and not os.path.exists(tmp)
            if path == dropped:
                os.kill(outer.pid, signal.SIGKILL)  # the store still stalled: no publish yet
        finally:
            os.kill(inner.pid, signal.SIGCONT)  # a daemon waiting on a FUSE store dies now
            with contextlib.suppress(OSError):
                os.close(held)
        if path == kept:
            outer.settle()
            assert vllm_io.load(kept, CHUNK) == vllm_io.chunk_bytes(3, CHUNK)
    wait_gone(outer.pid)
    outer.stop()
    outer.start()
    assert vllm_io.load(kept, CHUNK) == vllm_io.chunk_bytes(3, CHUNK)
    if os.path.exists(dropped):  # its publish ended before the kill: whole, or not at all
        assert vllm_io.load(dropped, CHUNK) == vllm_io.chunk_bytes(4, CHUNK)


@pytest.mark.timeout(60)
def test_a_chunk_opened_while_its_rename_publishes_it_is_read_as_published(
    stacked: tuple[Mount, Mount],
) -> None:
    """A reader that opens a chunk between its rename's answer and the publish that follows
    (here held up by the stalled store) waits for that publish and reads the chunk as
    published: counted as a read (eviction's recency, the hit rate), not served from the
    temp file. The store answering within the deadline, the reader gets every byte; past it,
    EIO, as for any wait on the store."""
    outer, inner = stacked
    path = vllm_io.chunk_path(str(outer.path), 5)
    os.makedirs(os.path.dirname(path))
    tmp, held = closed_temp(path, 5)
    reads_before = counters(outer)["reads"]
    os.kill(inner.pid, signal.SIGSTOP)
    try:
        os.rename(tmp, path)  # answered at once; its publish waits on the store
        loaded: list[bytes] = []
        reader = threading.Thread(target=lambda: loaded.append(vllm_io.load(path, CHUNK)))
        reader.start()
        reader.join(TIMEOUT / 4)
        assert reader.is_alive()  # its open waits for the publish
    finally:
        os.kill(inner.pid, signal.SIGCONT)
        os.close(held)
    reader.join(TIMEOUT * 5)
    assert loaded == [vllm_io.chunk_bytes(5, CHUNK)]
    assert counters(outer)["reads"] == reads_before + 1
    # A publish the stalled store holds up past the deadline: the open fails with EIO in it.
    path = vllm_io.chunk_path(str(outer.path), 6)
    tmp, held = closed_temp(path, 6)
    os.kill(inner.pid, signal.SIGSTOP)
    try:
        os.rename(tmp, path)
        assert_load_fails_within_the_deadline(path)
    finally:
        os.kill(inner.pid, signal.SIGCONT)
        os.close(held)
