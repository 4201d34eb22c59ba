"""A chunk's load and store system calls: in C (one GIL release each) and in Python, the same
answers, and nothing left behind by a store that failed."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfs import _chunk_calls, checksum, chunk_io
from tests.conftest import small_filesystem

SIZE = 2 * mmap.PAGESIZE
LOADS: dict[str, Callable[[str, mmap.mmap, int], tuple[int, int]]] = {
    "c": _chunk_calls.load,
    "python": chunk_io._load_calls,
}
Store = Callable[..., int | None]
STORES: dict[str, Store] = {"c": _chunk_calls.store, "python": chunk_io._store_calls}
CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC


def test_chunk_io_uses_the_c_calls() -> None:
    # built with the package (pyproject.toml)
    assert (chunk_io._load, chunk_io._store) == (_chunk_calls.load, _chunk_calls.store)


@pytest.fixture
def buffer() -> mmap.mmap:
    return mmap.mmap(-1, SIZE)  # page-aligned, as the host region's slots are (O_DIRECT)


@pytest.mark.parametrize("load", LOADS.values(), ids=LOADS.keys())
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_chunk_of_the_buffers_size_is_read_whole(
    load: Callable[[str, mmap.mmap, int], tuple[int, int]],
    o_direct: bool,
    tmp_path: Path,
    buffer: mmap.mmap,
) -> None:
    if o_direct and not chunk_io.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    data = os.urandom(SIZE)
    path = tmp_path / "chunk.bin"
    path.write_bytes(data)
    assert load(str(path), buffer, chunk_io.O_DIRECT if o_direct else 0) == (SIZE, SIZE)
    assert buffer[:] == data


@pytest.mark.parametrize("load", LOADS.values(), ids=LOADS.keys())
@pytest.mark.parametrize("size", [0, SIZE - 1, SIZE + 1])
def test_a_file_of_another_size_is_not_read(
    load: Callable[[str, mmap.mmap, int], tuple[int, int]],
    size: int,
    tmp_path: Path,
    buffer: mmap.mmap,
) -> None:
    path = tmp_path / "chunk.bin"
    path.write_bytes(b"x" * size)
    assert load(str(path), buffer, 0) == (size, -1)
    assert buffer[:] == bytes(SIZE)  # untouched


@pytest.mark.parametrize("load", LOADS.values(), ids=LOADS.keys())
def test_a_missing_chunk_raises_what_open_raises_naming_the_path(
    load: Callable[[str, mmap.mmap, int], tuple[int, int]], tmp_path: Path, buffer: mmap.mmap
) -> None:
    path = str(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError) as raised:
        load(path, buffer, 0)
    assert raised.value.filename == path


def test_load_into_removes_a_short_file_and_leaves_a_long_one(
    tmp_path: Path, buffer: mmap.mmap
) -> None:
    short, long = tmp_path / "short.bin", tmp_path / "long.bin"
    short.write_bytes(b"x" * (SIZE - 1))
    long.write_bytes(b"x" * (SIZE + 1))
    with pytest.raises(chunk_io.ChunkError, match="a chunk is"):
        chunk_io.load_into(str(short), buffer)
    with pytest.raises(chunk_io.ChunkError, match="a chunk is"):
        chunk_io.load_into(str(long), buffer)
    assert not short.exists() and long.exists()


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_store_writes_the_temp_file_and_renames_it_over_the_name(
    store: Store, tmp_path: Path
) -> None:
    tmp, path = str(tmp_path / "c.bin_1.tmp"), str(tmp_path / "c.bin")
    assert store(tmp, path, b"chunk", CREATE, 0o640) == 5
    assert Path(path).read_bytes() == b"chunk" and not os.path.exists(tmp)
    assert os.stat(path).st_mode & 0o777 == 0o640


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_store_to_a_name_that_is_there_writes_nothing(store: Store, tmp_path: Path) -> None:
    """Content-addressed: the file there holds the same bytes, so nothing is written (the check
    is inside the call: one GIL release a store, not two)."""
    tmp, path = str(tmp_path / "c.bin_1.tmp"), str(tmp_path / "c.bin")
    Path(path).write_bytes(b"old")
    with pytest.raises(FileExistsError) as raised:
        store(tmp, path, b"chunk", CREATE, 0o644)
    assert raised.value.filename == path
    assert Path(path).read_bytes() == b"old" and not os.path.exists(tmp)


def test_a_temp_name_someone_holds_fails_the_store_and_stays_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 63-bit draws that meet: the store fails (not "already there") and leaves the other
    writer's temp file alone."""
    path, taken = tmp_path / "c.bin", tmp_path / "c.bin_7.tmp"
    taken.write_bytes(b"theirs")
    monkeypatch.setattr(chunk_io.vllm_layout, "temp_name", lambda _: str(taken))
    with pytest.raises(FileExistsError):
        chunk_io.store(str(path), b"chunk")
    assert not path.exists() and taken.read_bytes() == b"theirs"


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_declared_checksum_goes_with_the_file_where_the_filesystem_keeps_it(
    store: Store, tmp_path: Path
) -> None:
    """Set on the temp file before its close (a kvfs mount keeps it, ext4 too), the value
    kvfs.checksum gives (C hashes with the system's xxHash); a filesystem without user xattrs
    (ramfs) stores the chunk without it."""
    data = os.urandom((3 << 20) + 5)  # the hash's long path, and a tail
    ext4, ramfs = tmp_path / "ext4", tmp_path / "ramfs"
    ext4.mkdir()
    with small_filesystem(ramfs, "ramfs"):
        for directory in (ext4, ramfs):
            tmp, path = str(directory / "c.tmp"), str(directory / "c.bin")
            assert store(tmp, path, data, CREATE, 0o644, True) == len(data)
            assert Path(path).read_bytes() == data and not os.path.exists(tmp)
        declared = os.getxattr(ext4 / "c.bin", checksum.XATTR)
        assert declared == checksum.checksum(data).encode()
        assert checksum.XATTR not in os.listxattr(ramfs / "c.bin")


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_store_into_a_missing_directory_makes_nothing(store: Store, tmp_path: Path) -> None:
    tmp, path = str(tmp_path / "no" / "c.bin_1.tmp"), str(tmp_path / "no" / "c.bin")
    assert store(tmp, path, b"chunk", CREATE, 0o644) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_temp_name_taken_is_left_to_its_owner(store: Store, tmp_path: Path) -> None:
    tmp, path = tmp_path / "c.bin_1.tmp", tmp_path / "c.bin"
    tmp.write_bytes(b"theirs")
    with pytest.raises(FileExistsError) as raised:
        store(str(tmp), str(path), b"chunk", CREATE, 0o644)
    assert raised.value.filename == str(tmp)
    assert tmp.read_bytes() == b"theirs" and not path.exists()


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_failed_rename_names_both_paths_and_removes_the_temp_file(
    store: Store, tmp_path: Path
) -> None:
    tmp, path = tmp_path / "c.bin_1.tmp", tmp_path / ("c" * 256)  # a name too long to take
    with pytest.raises(OSError) as raised:
        store(str(tmp), str(path), b"chunk", CREATE, 0o644)
    assert raised.value.errno == errno.ENAMETOOLONG
    assert (raised.value.filename, raised.value.filename2) == (str(tmp), str(path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("store", STORES.values(), ids=STORES.keys())
def test_a_failed_write_removes_the_temp_file(store: Store, tmp_path: Path) -> None:
    if not chunk_io.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    tmp, path = tmp_path / "c.bin_1.tmp", tmp_path / "c.bin"
    with pytest.raises(OSError) as raised:  # O_DIRECT refuses an unaligned length
        store(str(tmp), str(path), b"x" * 1000, CREATE | chunk_io.O_DIRECT, 0o644)
    assert raised.value.errno == errno.EINVAL
    assert list(tmp_path.iterdir()) == []


def test_store_makes_the_missing_directories_and_skips_a_chunk_already_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a" / "b" / "c.bin"
    assert chunk_io.store(str(path), b"chunk")
    assert not chunk_io.store(str(path), b"other")  # content-addressed: the same bytes
    assert path.read_bytes() == b"chunk" and os.listdir(path.parent) == ["c.bin"]


def test_store_blocks_stores_each_block_of_a_buffer_under_its_path(tmp_path: Path) -> None:
    region = mmap.mmap(-1, 4 * SIZE)  # a host region of four page-aligned slots
    region.write(os.urandom(4 * SIZE))
    paths = [str(tmp_path / "x" / f"{i}.bin") for i in range(3)]
    assert chunk_io.store_blocks(paths, memoryview(region), [3 * SIZE, 0, SIZE], SIZE) == 3
    for path, slot in zip(paths, (3, 0, 1), strict=True):
        assert Path(path).read_bytes() == region[slot * SIZE : (slot + 1) * SIZE]
    assert chunk_io.store_blocks(paths[:1], memoryview(region), [2 * SIZE], SIZE) == 0  # there


def test_store_blocks_checks_every_block_before_it_stores_one(tmp_path: Path) -> None:
    region = memoryview(bytearray(2 * SIZE))
    paths = [str(tmp_path / f"{i}.bin") for i in range(2)]
    with pytest.raises(ValueError, match="overrun"):
        chunk_io.store_blocks(paths, region, [0, SIZE + 1], SIZE)
    with pytest.raises(ValueError, match="2 paths for 1 blocks"):
        chunk_io.store_blocks(paths, region, [0], SIZE)
    assert list(tmp_path.iterdir()) == []


def test_store_blocks_stops_at_the_first_failure_keeping_the_blocks_before_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_bytes(b"")  # a file where the second block's directory would be
    region = memoryview(bytearray(os.urandom(3 * SIZE)))
    paths = [str(tmp_path / "a.bin"), str(tmp_path / "file" / "b.bin"), str(tmp_path / "c.bin")]
    with pytest.raises(NotADirectoryError):
        chunk_io.store_blocks(paths, region, [0, SIZE, 2 * SIZE], SIZE)
    assert (tmp_path / "a.bin").read_bytes() == region[:SIZE]
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "file"]
