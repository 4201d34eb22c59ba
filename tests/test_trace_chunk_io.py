"""tools/trace_chunk_io.py times every system call of a chunk store and load, and changes none."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfs import chunk_io
from tools.trace_chunk_io import CallTimes, instrument


def test_every_call_of_a_chunk_store_and_load_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk_io, "os", chunk_io.os)  # put back after the test
    monkeypatch.setattr(chunk_io, "_load", chunk_io._load)
    monkeypatch.setattr(chunk_io, "_store", chunk_io._store)
    times = CallTimes()
    instrument(times, python_calls=True, raw_opens=True)
    data = bytes(range(256)) * 16
    path = str(tmp_path / "a" / "b" / "chunk.bin")
    assert chunk_io.store(path, data)
    loaded = bytearray(len(data))
    chunk_io.load_into(path, memoryview(loaded))
    with pytest.raises(FileNotFoundError):  # a failed call is timed and raised as it was
        chunk_io.load_into(str(tmp_path / "missing.bin"), memoryview(loaded))

    assert loaded == data
    assert {call: len(s) for call, s in times.seconds.items()} == {
        "exists": 2,  # one a try
        "store (whole)": 2,  # the first finds no directory
        "open (create)": 2,  # the first finds no directory
        "mkdir": 3,  # a/b (no a), a, a/b
        "write": 1,
        "close (create)": 1,
        "replace": 1,
        "load (whole)": 2,
        "open (load, raw)": 2,  # the system call alone: the GIL kept
        "lseek": 1,
        "preadv": 1,
        "close (load)": 1,
    }
    report = times.report().splitlines()
    assert report[0].split()[:2] == ["call", "n"] and len(report) == 13


def test_a_store_and_a_load_in_c_are_timed_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk_io, "os", chunk_io.os)
    monkeypatch.setattr(chunk_io, "_load", chunk_io._load)
    monkeypatch.setattr(chunk_io, "_store", chunk_io._store)
    times = CallTimes()
    instrument(times)
    path = str(tmp_path / "chunk.bin")
    assert chunk_io.store(path, b"x" * 4096)
    chunk_io.load_into(path, memoryview(bytearray(4096)))
    assert {call: len(s) for call, s in times.seconds.items()} == {
        "store (whole)": 1,  # the check for the name inside it
        "load (whole)": 1,
    }
