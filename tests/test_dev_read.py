"""The kernel session's calls in C (mount/_dev_read.c), on pipes: a /dev/fuse fd reads and
writes the same way, one message per call, EAGAIN when empty. The read of the next request
gives the same answers in C and in Python; a first-time miss answered in C writes exactly the
reply Python would, and leaves every other request to Python."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvfs.mount import _dev_read, receiver
from kvfs.mount import fuse_abi as abi
from kvfs.mount.fuse_abi import Opcode
from kvfs.mount.kernel_session import _negative_entry

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


# -- first-time misses --------------------------------------------------------------------------

DIR = 7  # a directory's inode
ENTRY = _negative_entry(3600.0)


def request(
    opcode: int, nodeid: int, body: bytes, unique: int = 42, extensions: int = 0
) -> bytearray:
    """A request as the kernel writes it, in a buffer larger than it (the session's)."""
    size = abi.IN_HEADER.size + len(body) + extensions * 8
    header = abi.IN_HEADER.pack(size, opcode, unique, nodeid, 0, 0, 1, extensions, 0)
    buf = bytearray(4096)
    buf[:size] = header + body + bytes(extensions * 8)
    return buf


def answer(
    buf: bytearray, children: dict[bytes, object], w: int
) -> tuple[int, list[tuple[int, bytes]]]:
    noted: list[tuple[int, bytes]] = []
    size = abi.IN_HEADER.unpack_from(buf)[0]
    return _dev_read.answer_miss(w, buf, size, {DIR: children}, noted, ENTRY), noted


def test_a_miss_is_answered_with_the_negative_entry_and_noted(pipe: tuple[int, int]) -> None:
    r, w = pipe
    took, noted = answer(request(Opcode.LOOKUP, DIR, b"abc.bin\0", unique=99), {b"x": 1}, w)
    assert took > 0  # ns before the reply's write
    assert noted == [(DIR, b"abc.bin")]
    reply = os.read(r, 4096)
    assert reply == abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(ENTRY), 0, 99) + ENTRY


def test_the_name_ends_before_the_request_extensions(pipe: tuple[int, int]) -> None:
    r, w = pipe
    took, noted = answer(request(Opcode.LOOKUP, DIR, b"abc\0", extensions=2), {}, w)
    assert took > 0 and noted == [(DIR, b"abc")]
    assert len(os.read(r, 4096)) == abi.OUT_HEADER.size + len(ENTRY)


@pytest.mark.parametrize(
    "opcode, nodeid, name",
    [
        (Opcode.LOOKUP, DIR, b"there"),  # a hit: Python builds its entry
        (Opcode.LOOKUP, DIR + 1, b"abc"),  # a directory Python has not answered a miss in
        (Opcode.LOOKUP, DIR, b"."),
        (Opcode.LOOKUP, DIR, b".."),
        (Opcode.LOOKUP, DIR, b""),
        (Opcode.LOOKUP, DIR, b"n" * 256),  # ENAMETOOLONG is Python's to answer
        (Opcode.GETATTR, DIR, b"abc"),
        (Opcode.MKDIR, DIR, b"abc"),
    ],
    ids=["hit", "unknown-dir", "dot", "dotdot", "empty", "too-long", "getattr", "mkdir"],
)
def test_any_other_request_is_left_to_python(
    opcode: int, nodeid: int, name: bytes, pipe: tuple[int, int]
) -> None:
    r, w = pipe
    buf = request(opcode, nodeid, name + b"\0")
    before = bytes(buf)
    noted: list[tuple[int, bytes]] = []
    size = abi.IN_HEADER.unpack_from(buf)[0]
    assert _dev_read.answer_miss(w, buf, size, {DIR: {b"there": 1}}, noted, ENTRY) == 0
    assert noted == [] and bytes(buf) == before
    with pytest.raises(BlockingIOError):
        os.read(r, 4096)  # nothing written


def test_a_short_or_truncated_request_is_left_to_python(pipe: tuple[int, int]) -> None:
    _, w = pipe
    buf = request(Opcode.LOOKUP, DIR, b"abc\0")
    noted: list[tuple[int, bytes]] = []
    for size in (0, abi.IN_HEADER.size - 1, abi.IN_HEADER.size, len(buf) + 1):
        assert _dev_read.answer_miss(w, buf, size, {DIR: {}}, noted, ENTRY) == 0
    assert noted == []


def test_a_reply_that_cannot_be_written_is_a_negative_errno(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(r)  # the other end gone: EPIPE (SIGPIPE is ignored in Python)
    took, noted = answer(request(Opcode.LOOKUP, DIR, b"abc\0"), {}, w)
    assert took == -errno.EPIPE
    assert noted == [(DIR, b"abc")]  # the lookup was asked all the same
