"""The core pieces on their own: I/O queues, sizes, names, index, backing store."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvfs import checksum, vllm_layout
from kvfs.buffers import EXTENT, ChunkBuffer, ExtentPool
from kvfs.config import ConfigError, MountConfig, parse_size
from kvfs.eviction import S3FIFO, EvictionPolicy, make_policy
from kvfs.index import Index
from kvfs.io_queues import DualQueuePool, Queue
from kvfs.store import BackingBusy, BackingStore


def _completion_order(first: tuple[Queue, int], then: tuple[Queue, int]) -> list[str]:
    """Queue a backlog of one kind, then jobs of another, on 1 read + 1 write thread."""
    pool = DualQueuePool(read_threads=1, write_threads=1)
    order: list[str] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def job(name: str) -> None:
        time.sleep(0.01)  # long enough that the queue policy, not thread wake-ups, decides
        with lock:
            order.append(name)

    try:
        for queue, count in (first, then):
            for i in range(count):
                name = f"{queue.value}{i}"
                pool.submit(queue, lambda name=name: job(name), lambda r, e: done.release())
        for _ in range(first[1] + then[1]):
            assert done.acquire(timeout=10)
    finally:
        pool.shutdown()
    return order


def test_a_read_overtakes_a_backlog_of_writes() -> None:
    order = _completion_order((Queue.WRITE, 20), (Queue.READ, 1))
    assert order.index("read0") <= 3  # FIFO would put it last, at 20


def test_writes_progress_under_a_flood_of_reads() -> None:
    order = _completion_order((Queue.READ, 20), (Queue.WRITE, 5))
    assert max(order.index(f"write{i}") for i in range(5)) <= 12  # FIFO: 20 to 24


def test_pool_hands_results_and_errors_to_the_callback() -> None:
    pool = DualQueuePool(1, 1)
    got: list[tuple[object, object]] = []
    finished = threading.Event()

    def record(result: object, error: object) -> None:
        got.append((result, error))
        if len(got) == 2:
            finished.set()

    try:
        pool.submit(Queue.READ, lambda: 42, record)
        pool.submit(Queue.WRITE, lambda: 1 / 0, record)
        assert finished.wait(10)
    finally:
        pool.shutdown()
    assert (42, None) in got
    assert any(isinstance(error, ZeroDivisionError) for _, error in got)


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("512K", 512 << 10), ("1.5G", 3 << 29), ("2TiB", 2 << 40)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="--write-buffer"):
        parse_size("lots", "--write-buffer")
    with pytest.raises(ConfigError, match="io_timeout"):
        MountConfig(Path("/m"), Path("/b"), io_timeout=-1)
    with pytest.raises(ConfigError, match="read_threads"):
        MountConfig(Path("/m"), Path("/b"), read_threads=0)
    for wait in (-0.1, 11.0, float("nan")):
        with pytest.raises(ConfigError, match="rename_wait"):
            MountConfig(Path("/m"), Path("/b"), rename_wait=wait)


def test_engine_temp_names() -> None:
    assert vllm_layout.is_engine_temp(b"ab" * 32 + b".bin_123456789.tmp")
    assert vllm_layout.is_engine_temp(b".o_direct_probe_42.tmp")
    assert not vllm_layout.is_engine_temp(b"ab" * 32 + b".bin")
    assert not vllm_layout.is_engine_temp(b"notes.tmp")
    # a store's temp file waits for its rename (--rename-wait); a probe is never renamed
    assert vllm_layout.is_store_temp(b"ab" * 32 + b".bin_123456789.tmp")
    assert not vllm_layout.is_store_temp(b".o_direct_probe_42.tmp")
    assert not vllm_layout.is_store_temp(b"ab" * 32 + b".bin")


def test_index_keeps_totals_and_paths() -> None:
    index = Index()
    d = index.new_node(b"d", stat.S_IFDIR | 0o755)
    index.attach(index.root, b"d", d)
    f = index.new_node(b"f", stat.S_IFREG | 0o644)
    index.attach(d, b"f", f)
    index.set_published(f, 8192, 16)
    assert (index.files, index.dirs, index.bytes, index.charged) == (1, 1, 8192, 8192)
    assert Index.path(f) == b"d/f"
    index.move(f.parent, f.name, index.root, b"g")
    assert Index.path(f) == b"g" and index.bytes == 8192
    f.lookups = 1
    index.detach(f)
    assert index.files == 0 and index.bytes == 0 and index.get(f.ino) is f
    index.forget(f.ino, 1)
    assert index.get(f.ino) is None


def test_store_scan_rebuilds_the_index_and_drops_orphans(tmp_path: Path) -> None:
    store = BackingStore(os.fsencode(tmp_path))
    store.prepare()
    data = ChunkBuffer(ExtentPool(1 << 20))
    data.write(0, b"chunk" * 1000)
    pub = store.write_tmp(data, 0o644, os.geteuid(), os.getegid(), (0, 0), False)
    (tmp_path / "ns" / "abc").mkdir(parents=True)
    store.rename(pub.tmp, b"ns/abc/x.bin")
    (tmp_path / "ns" / "abc" / ("ab" * 32 + ".bin_77.tmp")).write_bytes(b"partial")
    (tmp_path / ".kvfs" / "tmp" / "left-by-a-crash").write_bytes(b"partial")
    (tmp_path / ".kvfs" / "spare" / "1-ab.spare").write_bytes(b"")  # opened ahead, never used
    store.close()

    again = BackingStore(os.fsencode(tmp_path))
    assert again.prepare() == 2
    assert not os.listdir(tmp_path / ".kvfs" / "spare")
    assert not again.hides_unlinked and not os.listdir(tmp_path / ".kvfs" / "tmp")  # its probe
    index = Index()
    assert again.scan(index) == 1
    assert (index.files, index.bytes) == (1, 5000)
    node = index.child(index.child(index.child(index.root, b"ns"), b"abc"), b"x.bin")
    assert node is not None and node.checksum == pub.checksum == checksum.checksum(b"chunk" * 1000)
    with pytest.raises(BackingBusy):
        BackingStore(os.fsencode(tmp_path)).prepare()
    again.close()


def test_read_verified_rejects_flipped_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"good bytes")
    good = checksum.checksum(b"good bytes")
    pool = ExtentPool(1 << 20)
    store = BackingStore(os.fsencode(tmp_path))
    fd = os.open(path, os.O_RDONLY)
    try:
        data, digest = store.read_verified(fd, good, pool)
        assert (bytes(data.read(0, 100)), digest) == (b"good bytes", good)
        os.pwrite(os.open(path, os.O_WRONLY), b"G", 0)
        with pytest.raises(checksum.ChecksumMismatch):
            store.read_verified(fd, good, pool)
    finally:
        os.close(fd)


def test_a_file_adopted_keeps_its_checksum_on_the_inode_read_or_in_memory(tmp_path: Path) -> None:
    """A file without a checksum gets one when read whole, stored with the very inode read
    (not by a name that may mean another file by then); where the xattr cannot be set (an
    immutable file here), the read still succeeds and the caller keeps the checksum."""
    store = BackingStore(os.fsencode(tmp_path))
    pool = ExtentPool(1 << 20)
    path = tmp_path / "f"
    path.write_bytes(b"adopt me")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(path, tmp_path / "g")  # another name by the time it is read
        path.write_bytes(b"another file")
        data, digest = store.read_verified(fd, None, pool)
        assert digest == checksum.checksum(b"adopt me") and bytes(data.read(0, 8)) == b"adopt me"
        assert checksum.read_xattr(os.fsencode(tmp_path / "g")) == digest
        assert checksum.read_xattr(os.fsencode(path)) is None
    finally:
        os.close(fd)
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable files")
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert store.recheck(fd, None) == (checksum.checksum(b"another file"), 12)
        finally:
            os.close(fd)
        assert checksum.read_xattr(os.fsencode(path)) is None and store.xattrs
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


def test_recency_and_pins_never_follow_a_symlink_out_of_the_backing_store(tmp_path: Path) -> None:
    """Recency is saved a second after the reads, by the path a file has then: a client that
    replaced the file with a symlink meanwhile (to anywhere: the mount itself, /etc) must not
    make the root daemon set an attribute there. Nothing is kept for the link, and no error."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"not kvfs's")
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "chunk.bin").symlink_to(victim)
    (backing / "dir").symlink_to(tmp_path)
    store = BackingStore(os.fsencode(backing))
    store.save_recency([(b"chunk.bin", 123, 4), (b"dir", 123, 4), (b"gone.bin", 1, 1)])
    with pytest.raises(OSError):  # a pin of a file that is no longer one: refused
        store.save_pinned(b"chunk.bin", True)
    store.save_pinned(b"chunk.bin", False)
    assert os.listxattr(victim) == [] and os.listxattr(tmp_path) == []


def test_chunk_buffer_writes_holes_truncates_and_reads_across_extents() -> None:
    pool = ExtentPool(8 << 20)
    buf = ChunkBuffer(pool)
    model = bytearray()

    def write(offset: int, data: bytes) -> None:
        buf.write(offset, data)
        if offset > len(model):
            model.extend(bytes(offset - len(model)))
        model[offset : offset + len(data)] = data

    write(0, os.urandom(EXTENT + 100))  # spans two extents
    write(3 * EXTENT - 5, b"0123456789")  # a hole, then a write across an extent boundary
    assert buf.size == len(model) and buf.capacity == 4 * EXTENT
    assert b"".join(buf.views()) == model
    assert bytes(buf.read(EXTENT - 10, 20)) == model[EXTENT - 10 : EXTENT + 10]
    assert isinstance(buf.read(EXTENT, 4096), memoryview)  # inside one extent: no copy
    assert buf.checksum() == checksum.checksum(bytes(model))
    buf.truncate(10)
    del model[10:]
    buf.write(EXTENT, b"x")  # reused extents must read back as zeros in the hole
    model.extend(bytes(EXTENT - 10) + b"x")
    assert b"".join(buf.views()) == model
    buf.release()
    assert buf.size == 0 and pool.free_bytes == 4 * EXTENT


def _fill(policy: EvictionPolicy, keys: range, size: int = 1) -> None:
    for key in keys:
        policy.insert(key, size)


def test_lru_evicts_the_least_recently_read_and_skips_exempt() -> None:
    lru = make_policy("lru")
    _fill(lru, range(5))
    lru.access(0)
    assert lru.evict(lambda k: k == 1) == 2
    assert [lru.evict(lambda k: False) for _ in range(4)] == [1, 3, 4, 0]
    assert lru.evict(lambda k: False) is None


def test_s3fifo_resists_a_scan_that_lru_does_not() -> None:
    """A hot set of 10, read again after every 14 one-time chunks, with room for 20."""

    def hot_hits(policy: EvictionPolicy) -> int:
        held: set[int] = set()
        hits = 0
        for step in range(300):
            for key in list(range(10)) if step % 15 == 0 else [1000 + step]:
                if key in held:
                    policy.access(key)
                    hits += key < 10
                    continue
                while len(held) >= 20:
                    victim = policy.evict(lambda k: False)
                    assert victim is not None
                    held.discard(victim)
                policy.insert(key, 1)
                held.add(key)
        return hits

    assert hot_hits(make_policy("lru")) == 0  # every scan flushes the hot set
    assert hot_hits(make_policy("s3fifo")) >= 170  # of 190: all but the second round


def test_s3fifo_exempt_entries_stay_and_ghosts_return_to_main() -> None:
    s3 = S3FIFO()
    _fill(s3, range(10))
    assert s3.evict(lambda k: k == 0) == 1  # 0 is exempt: the next oldest goes
    s3.insert(1, 1)  # 1 comes back: its ghost sends it to the main queue
    victims = [s3.evict(lambda k: k == 0) for _ in range(10)]
    assert victims == [*range(2, 10), 1, None]  # new ones first; 1 is in main; 0 never
    s3.remove(0)
    assert len(s3) == 0


def test_sparse_regions_take_no_memory_and_read_as_zeros() -> None:
    """truncate -s 1G or a write at a 1 GiB offset must not materialise a gigabyte (D7)."""
    pool = ExtentPool(8 << 20)
    buf = ChunkBuffer(pool)
    buf.write(0, b"head")
    buf.truncate(1 << 30)
    assert buf.size == 1 << 30 and buf.capacity == EXTENT
    assert buf.extents_to_add(1 << 30, (1 << 30) + 3) == 1
    buf.write(1 << 30, b"end")
    assert buf.capacity == 2 * EXTENT
    assert bytes(buf.read(0, 8)) == b"head" + bytes(4)
    assert bytes(buf.read(512 << 20, 4096)) == bytes(4096)
    assert bytes(buf.read((1 << 30) - 2, 10)) == b"\0\0end"
    holes = [hole for _, _, hole in buf.segments()]
    assert holes.count(False) == 2 and len(holes) == 1025
    buf.release()


def test_a_file_that_cannot_be_mapped_is_checksummed_by_reading() -> None:
    """A filesystem without mmap (sshfs -o direct_io: ENODEV; sysfs here) is read instead."""
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(path):
        pytest.skip(f"no {path} to stand in for a filesystem without mmap")
    assert_checksums_as_read(path)


def assert_checksums_as_read(path: str | Path) -> None:
    """``checksum.of_file`` agrees with the checksum of the bytes a read returns."""
    with open(path, "rb") as f:
        data = f.read()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert checksum.of_file(fd) == (checksum.checksum(data), len(data))
    finally:
        os.close(fd)


@pytest.mark.parametrize("checked", [True, False], ids=["at_the_publish", "at_an_fsync"])
def test_a_write_during_a_seal_is_never_hidden_behind_its_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """A passthrough file is sealed (checksum, mode, times) while its writer may still hold a
    descriptor. A write that lands while the checksum is taken must not vanish behind the
    utimens of the seal: the seal then returns nothing (checked against the version its
    close left) or a version the file no longer has, so the publish seals it again."""
    store = BackingStore(os.fsencode(tmp_path))
    store.prepare()
    rel, fd = store.open_tmp(0o600)
    os.pwrite(fd, b"a" * 8192, 0)
    writer = os.open(store.abs(rel), os.O_WRONLY)
    taking = checksum.of_file

    def of_file_as_the_writer_writes(reading: int) -> tuple[str, int]:
        taken = taking(reading)
        os.pwrite(writer, b"b", 0)  # the writer's dup, between the checksum and the times
        return taken

    monkeypatch.setattr(checksum, "of_file", of_file_as_the_writer_writes)
    try:
        unchanged = store.version(fd) if checked else None
        times = (1_000_000_000, 2_000_000_000)
        sealed = store.seal_tmp(
            rel, fd, 0o644, os.geteuid(), os.getegid(), times, not checked, False, unchanged
        )
        if checked:
            assert sealed is None
        else:
            assert sealed is not None and sealed[1] != store.version(fd)
    finally:
        os.close(writer)
        os.close(fd)
    store.close()


@pytest.mark.parametrize(
    "layout",
    [
        [],  # empty
        [(0, b"dense" * 2000)],
        [(0, b"x" * 5000), (None, 4 << 20)],  # a hole to the end
        [(None, 4 << 20), ((4 << 20) - 3, b"end")],  # a hole first
        [(0, b"a" * 4096), (2 << 20, b"b" * 9000), (None, 3 << 20)],  # data, hole, data, hole
        [(None, 123457)],  # all hole, an odd size
    ],
    ids=["empty", "dense", "hole-to-end", "hole-first", "holes-between", "all-hole"],
)
def test_a_sparse_file_checksums_as_its_bytes_read(
    tmp_path: Path, layout: list[tuple[int | None, object]]
) -> None:
    """Holes are hashed as zeros rather than mapped: the same checksum as the bytes read."""
    path = tmp_path / "f"
    with open(path, "wb") as f:
        for offset, what in layout:
            if offset is None:
                assert isinstance(what, int)
                f.truncate(what)
            else:
                assert isinstance(what, bytes)
                f.seek(offset)
                f.write(what)
    assert_checksums_as_read(path)
