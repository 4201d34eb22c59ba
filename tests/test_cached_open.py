"""kvfs.cached_open: a file opened only where the kernel resolves its path from its caches."""

from __future__ import annotations

import os
from pathlib import Path

from kvfs.cached_open import open_cached
from tests.conftest import drop_dentries


def test_a_cached_path_opens_and_an_uncached_or_missing_one_does_not(tmp_path: Path) -> None:
    path = tmp_path / "d" / "f"
    path.parent.mkdir()
    path.write_bytes(b"bytes")
    fd = open_cached(bytes(path), os.O_RDONLY)
    assert fd is not None
    try:
        assert os.read(fd, 16) == b"bytes"
        assert os.get_inheritable(fd) is False  # O_CLOEXEC, as open_reader's
    finally:
        os.close(fd)
    assert open_cached(bytes(tmp_path / "d" / "missing"), os.O_RDONLY) is None
    if drop_dentries(path):  # a cold path
        assert open_cached(bytes(path), os.O_RDONLY) is None
    path.stat()  # resolved once, the long way: cached again
    fd = open_cached(bytes(path), os.O_RDONLY | os.O_DIRECT)
    assert fd is not None
    os.close(fd)
