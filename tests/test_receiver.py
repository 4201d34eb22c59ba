"""The kernel session's read of its next request: in C and in Python, the same answers, on a
non-blocking pipe (a /dev/fuse fd reads the same way: one message per read, EAGAIN when empty)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvfs.mount import _dev_read, receiver

Read = Callable[[int, bytearray, int], int]
READS: dict[str, Read] = {"c": _dev_read.read_request, "python": receiver._read_calls}
MS = 1_000_000


def test_the_receiver_uses_the_c_call() -> None:
    assert receiver._read is _dev_read.read_request  # built with the package (pyproject.toml)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):  # (a test closed it)
            os.close(fd)


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_a_waiting_request_is_read_whole(read: Read, pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.write(w, b"request")
    buf = bytearray(64)
    assert read(r, buf, 0) == 7
    assert buf[:7] == b"request"


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_nothing_to_read_is_eagain_at_once_or_after_the_spin(
    read: Read, pipe: tuple[int, int]
) -> None:
    r, _ = pipe
    assert read(r, bytearray(64), 0) == -errno.EAGAIN
    start = time.perf_counter()
    assert read(r, bytearray(64), 20 * MS) == -errno.EAGAIN
    assert time.perf_counter() - start >= 0.02


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_a_request_that_comes_during_the_spin_is_read(read: Read, pipe: tuple[int, int]) -> None:
    r, w = pipe
    writer = threading.Timer(0.005, os.write, (w, b"late"))  # the spin lets the GIL go
    writer.start()
    buf = bytearray(64)
    try:
        assert read(r, buf, 10_000 * MS) == 4  # long before the spin would end
    finally:
        writer.join()
    assert buf[:4] == b"late"


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_failures_are_negative_errnos(read: Read, pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(w)
    assert read(r, bytearray(64), 0) == 0  # end of file: the caller's to judge
    os.close(r)
    assert read(r, bytearray(64), MS) == -errno.EBADF
