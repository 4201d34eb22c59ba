"""Where a conversation sweep's fs tier spends its time: each chunk store and load
(``kvfs/chunk_io.py``), and each of their system calls made from Python, timed as the calling
thread sees it.

    python -m tools.trace_chunk_io [--python-calls] [--raw-opens] -- [bench_conversations args]

A call that blocks lets the GIL go; when it returns, the calling I/O thread waits for the GIL
behind the engine's other threads. A FUSE round trip is such a call where the plain
directory's is not, so the same connector pays more for it on a mount than the round trip
costs. A load, and a store's create-write-close-rename, are one C call each
(``kvfs/_chunk_calls.c``, one GIL release); ``--python-calls`` makes their system calls from
Python instead, each timed. ``--raw-opens`` (implies ``--python-calls``) makes the loads' open()
calls through libc without letting the GIL go: the system call alone, to set beside what the
caller sees (it stalls the other threads meanwhile: a diagnosis, not a benchmark).

At exit it prints, per call, count, median, p90, p99, mean and total seconds (all threads).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from kvfs import chunk_io

_TIMED = ("write", "setxattr", "replace", "lseek", "preadv", "mkdir", "unlink")


class CallTimes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, list[float]] = {}

    def add(self, call: str, seconds: float) -> None:
        with self._lock:
            self.seconds.setdefault(call, []).append(seconds)

    def timed(self, call: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.add(call, time.perf_counter() - start)

        return run

    def report(self) -> str:
        heads = ("n", "p50 us", "p90 us", "p99 us", "mean us", "total s")
        lines = [f"{'call':<16}" + "".join(f"{h:>10}" for h in heads)]
        for call, seconds in sorted(self.seconds.items()):
            s, n = sorted(seconds), len(seconds)
            lines.append(
                f"{call:<16}{n:>10}{s[n // 2] * 1e6:>10.0f}{s[int(n * 0.9)] * 1e6:>10.0f}"
                f"{s[int(n * 0.99)] * 1e6:>10.0f}{sum(s) / n * 1e6:>10.0f}{sum(s):>10.2f}"
            )
        return "\n".join(lines)


def instrument(times: CallTimes, python_calls: bool = False, raw_opens: bool = False) -> None:
    """Replace chunk_io's ``os`` with one whose calls are timed (only chunk_io sees it), and
    time each load and store whole."""
    if python_calls or raw_opens:
        chunk_io._load, chunk_io._store = chunk_io._load_calls, chunk_io._store_calls
    chunk_io._load = times.timed("load (whole)", chunk_io._load)
    chunk_io._store = times.timed("store (whole)", chunk_io._store)
    traced = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    traced.path = types.SimpleNamespace(
        **{k: getattr(os.path, k) for k in dir(os.path) if not k.startswith("__")}
    )
    traced.path.exists = times.timed("exists", os.path.exists)
    for call in _TIMED:
        setattr(traced, call, times.timed(call, getattr(os, call)))
    kinds: dict[int, str] = {}  # fd -> "create" or "load"
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL is kept across the call
    libc.open.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def raw_open(path: str, flags: int) -> int:
        fd = libc.open(os.fsencode(path), flags)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(fd)

    def open_(path: str, flags: int, mode: int = 0o777) -> int:
        kind = "create" if flags & os.O_CREAT else "load"
        raw = raw_opens and kind == "load"
        start = time.perf_counter()
        try:  # (a create's first try fails where its directory is missing: timed too)
            fd = raw_open(path, flags) if raw else os.open(path, flags, mode)
        finally:
            times.add(f"open ({kind}{', raw' if raw else ''})", time.perf_counter() - start)
        kinds[fd] = kind
        return fd

    def close(fd: int) -> None:
        kind, start = kinds.pop(fd, "?"), time.perf_counter()
        try:
            os.close(fd)
        finally:
            times.add(f"close ({kind})", time.perf_counter() - start)

    traced.open, traced.close = open_, close
    chunk_io.os = traced  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python-calls", action="store_true")
    parser.add_argument("--raw-opens", action="store_true")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="tools.bench_conversations args")
    args = parser.parse_args()
    times = CallTimes()
    instrument(times, args.python_calls, args.raw_opens)
    atexit.register(lambda: print(times.report(), file=sys.stderr))
    from tools import bench_conversations

    bench = [a for a in args.bench if a != "--"]
    sys.argv = ["tools.bench_conversations", *bench]
    return bench_conversations.main()


if __name__ == "__main__":
    sys.exit(main())
