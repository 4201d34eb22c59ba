"""The batched lookup (``.kvfs/lookup``): many names answered from the daemon's index in one
request, exactly as stat would answer them, counted as LOOKUPs are, and hostile requests
refused without a trace."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs import control_protocol as proto
from tests.conftest import NOBODY, Mount, make_mount

LOOKUP = f"{proto.CONTROL_DIR}/{proto.LOOKUP}"


def chunk(key: int, group: int = 0) -> str:
    """A vLLM chunk path under its data directory."""
    h = f"{key:064x}"
    return f"{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def store(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"kv")


def lookups(mount: Mount) -> dict[str, int]:
    report = json.loads((mount.path / proto.CONTROL_DIR / proto.USAGE).read_text())
    return dict(report["lookups"])


def ask(mount: Mount, request: bytes) -> bytes:
    """One raw request on a fresh handle; the answer (or the OSError of its read)."""
    fd = os.open(mount.path / LOOKUP, os.O_RDWR)
    try:
        os.pwrite(fd, request, 0)
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


@pytest.fixture
def data_dir(kv_mount: Mount) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir=kv_mount.path, prefix="model_0123456789ab_r"))
    yield path
    shutil.rmtree(path)


def test_answers_as_stat_does(kv_mount: Mount, data_dir: Path) -> None:
    stored = [chunk(k) for k in range(0, 400, 2)]
    store(data_dir, stored)
    (data_dir / chunk(1)).mkdir(parents=True)  # a directory by a chunk's name: not a chunk
    (data_dir / "link.bin").symlink_to(data_dir / stored[0])  # never followed
    (data_dir / "linkdir").symlink_to(data_dir / stored[0][:3])
    names = [chunk(k) for k in range(400)] + ["link.bin", f"linkdir/{stored[0][4:]}"]
    random.Random(3).shuffle(names)
    base = str(data_dir.relative_to(kv_mount.path))
    found = proto.batch_lookup(kv_mount.path, base, names)
    assert found == [n in stored for n in names]  # the symlinks' targets are files: not hits
    assert (data_dir / "link.bin").is_file()
    # From the root, with the base in every name; and a base that does not exist.
    assert proto.batch_lookup(kv_mount.path, "", [f"{base}/{stored[1]}"]) == [True]
    assert proto.batch_lookup(kv_mount.path, f"{base}/nothing", stored[:3]) == [False] * 3
    assert proto.batch_lookup(kv_mount.path, proto.CONTROL_DIR, [proto.USAGE]) == [False]


def test_a_hundred_thousand_names_in_one_request(kv_mount: Mount, data_dir: Path) -> None:
    store(data_dir, [chunk(k) for k in range(0, 100_000, 997)])
    names = [chunk(k) for k in range(100_000)]
    found = proto.batch_lookup(kv_mount.path, str(data_dir.relative_to(kv_mount.path)), names)
    assert [k for k, hit in enumerate(found) if hit] == list(range(0, 100_000, 997))


def test_the_handle_serves_one_request_after_another(kv_mount: Mount, data_dir: Path) -> None:
    store(data_dir, [chunk(1)])
    base = str(data_dir.relative_to(kv_mount.path)).encode()
    fd = os.open(kv_mount.path / LOOKUP, os.O_RDWR)
    try:
        request = base + b"\n" + chunk(1).encode() + b"\n" + chunk(2).encode()
        # In pieces, as the kernel splits a large write; the answer read twice, in parts.
        os.pwrite(fd, request[:10], 0)
        os.pwrite(fd, request[10:], 10)
        assert os.pread(fd, 1, 0) == b"1"
        assert os.pread(fd, 10, 1) == b"0"
        assert os.pread(fd, 10, 0) == b"10"
        os.pwrite(fd, base + b"\n" + chunk(2).encode() + b"\n", 0)  # a new request
        assert os.pread(fd, 10, 0) == b"0"
    finally:
        os.close(fd)


def test_misses_count_as_lookups_do(kv_mount: Mount, data_dir: Path) -> None:
    store(data_dir, [chunk(0)])
    # Published (at its last release, after close() returned: on a loaded disk, later than
    # the steps below): a read of it counts as a hit.
    kv_mount.settle(sealed=False)
    base = str(data_dir.relative_to(kv_mount.path))
    before = lookups(kv_mount)
    # Missing chunks in an existing directory count (a LOOKUP of their names would); under a
    # missing directory, or with a name that is no chunk's, they do not (no LOOKUP asks it).
    sibling = chunk(0).rsplit("/", 1)[0] + "/" + chunk(7).rsplit("/", 1)[1]
    names = [chunk(0), sibling, chunk(0xABC << 244), "not-a-chunk.txt"]
    assert proto.batch_lookup(kv_mount.path, base, names) == [True, False, False, False]
    after = lookups(kv_mount)
    assert after == {"hit": before["hit"], "miss": before["miss"] + 1}
    store(data_dir, [sibling])  # a store of the missed name takes the miss back, as for LOOKUP
    assert lookups(kv_mount) == before
    (data_dir / chunk(0)).read_bytes()  # a hit is a chunk opened for reading
    assert lookups(kv_mount)["hit"] == before["hit"] + 1


@pytest.mark.parametrize(
    "request_",
    [
        b"base-only\n",
        b"\nchunk\n\nother",  # an empty name
        b"\n/etc/passwd",  # absolute
        b"/\nx",
        b"\n../x",
        b"..\nx",
        b"\na/../x",
        b"\n./x",
        b"\na//x",
        b"\nx/",
        b"\nx\0y",
        b"\n" + b"x" * 256,  # longer than NAME_MAX
        b"\n" + b"d/" * 2100 + b"x",  # longer than PATH_MAX
        b"no-such-base\nx/../y",  # checked even where nothing would be found
        b"\n.\n",
    ],
)
def test_malformed_requests_get_einval_and_count_nothing(
    kv_mount: Mount, data_dir: Path, request_: bytes
) -> None:
    store(data_dir, [chunk(0)])
    base = str(data_dir.relative_to(kv_mount.path)).encode()
    before = lookups(kv_mount)
    # Valid names first: a request fails as a whole, before any of it counts.
    valid = b"\n".join(chunk(k).encode() for k in range(3)) + b"\n"
    if request_.startswith(b"\n"):
        request_ = base + b"\n" + valid + request_[1:]
    with pytest.raises(OSError) as failed:
        ask(kv_mount, request_)
    assert failed.value.errno == errno.EINVAL
    assert lookups(kv_mount) == before


def test_a_deep_name_is_a_miss(kv_mount: Mount, data_dir: Path) -> None:
    deep = "d/" * 1500 + "x"  # 1501 components, within PATH_MAX
    (data_dir / "d" / "d").mkdir(parents=True)
    base = str(data_dir.relative_to(kv_mount.path))
    assert proto.batch_lookup(kv_mount.path, base, [deep, ".hidden", "a.b/..c"]) == [False] * 3


def test_writes_out_of_order_or_too_large_are_refused(kv_mount: Mount) -> None:
    fd = os.open(kv_mount.path / LOOKUP, os.O_RDWR)
    try:
        with pytest.raises(OSError) as gap:
            os.pwrite(fd, b"x\ny", 5)  # not where the request ends
        assert gap.value.errno == errno.EINVAL
        big = b"\n" + b"x" * (proto.LOOKUP_MAX_REQUEST + 1)
        with pytest.raises(OSError) as too_big:
            written = 0
            while written < len(big):  # the kernel reports the first refused piece as a
                written += os.pwrite(fd, big[written:], written)  # short count: write on
        assert too_big.value.errno == errno.EFBIG
        with pytest.raises(OSError) as still:  # the refused request is gone, nothing answered
            os.pread(fd, 10, 0)
        assert still.value.errno == errno.EFBIG
        os.pwrite(fd, b"\nnothing.bin", 0)  # a new request: the handle serves again
        assert os.pread(fd, 10, 0) == b"0"
    finally:
        os.close(fd)


def test_other_control_files_stay_read_only(kv_mount: Mount) -> None:
    with pytest.raises(OSError) as denied:
        os.open(kv_mount.path / proto.CONTROL_DIR / proto.USAGE, os.O_RDWR)
    assert denied.value.errno == errno.EROFS
    assert (kv_mount.path / LOOKUP).stat().st_mode & 0o777 == 0o666


def test_concurrent_clients_get_their_own_answers(kv_mount: Mount, data_dir: Path) -> None:
    base = str(data_dir.relative_to(kv_mount.path))
    store(data_dir, [chunk(k) for k in range(0, 3000, 3)])
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(20):
                keys = rng.sample(range(3000), 500)
                found = proto.batch_lookup(kv_mount.path, base, [chunk(k) for k in keys])
                assert found == [k % 3 == 0 for k in keys]
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    store(data_dir, [chunk(k) for k in range(3000, 3300)])  # the index changes meanwhile
    for thread in threads:
        thread.join()
    assert not errors, errors


@pytest.fixture
def public_mount() -> Iterator[Mount]:
    """A mount other users may enter (allow_other), in a directory they can traverse."""
    base = Path(tempfile.mkdtemp(prefix="kvfs-lookup-"))
    base.chmod(0o755)
    mount = make_mount(base, "-o", "allow_other")
    mount.path.chmod(0o755)
    try:
        yield mount.start()
    finally:
        mount.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_caller_needs_search_permission_on_every_directory(public_mount: Mount) -> None:
    (public_mount.path / "open" / "d").mkdir(parents=True)
    (public_mount.path / "open" / "d" / "a.bin").write_bytes(b"kv")
    (public_mount.path / "open").chmod(0o755)
    (public_mount.path / "open" / "d").chmod(0o755)
    (public_mount.path / "private" / "d").mkdir(parents=True)
    (public_mount.path / "private" / "d" / "a.bin").write_bytes(b"kv")
    (public_mount.path / "private").chmod(0o700)

    def as_other(base: str, names: tuple[str, ...] | list[str] = ("d/a.bin", "d/b.bin")) -> str:
        """batch_lookup in a child that became user nobody (no exec: the interpreter lies
        under root's private home)."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            try:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                try:
                    out = str(proto.batch_lookup(public_mount.path, base, list(names)))
                except OSError as err:
                    out = str(err.errno)
                os.write(write_end, out.encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer:
            out = answer.read().decode()
        os.waitpid(pid, 0)
        return out

    assert as_other("open") == "[True, False]"
    assert as_other("private") == str(errno.EACCES)
    assert as_other("") == "[False, False]"  # "d" is not in the root
    # A directory inside the names is searched as the base is: EACCES, not a miss.
    assert as_other("", ["open/d/a.bin", "private/d/a.bin"]) == str(errno.EACCES)
    assert as_other("", ["open/d/a.bin", "open/e/a.bin"]) == "[True, False]"
    # The owner (root) walks anywhere, as the kernel would let it.
    assert proto.batch_lookup(public_mount.path, "private", ["d/a.bin"]) == [True]


def test_requests_split_under_the_limit_and_refuse_a_newline_in_a_name() -> None:
    names = [f"{i:03x}/{i % 256:02x}_g0/{'ab' * 32}{i}.bin" for i in range(300_000)]
    requests = list(proto.lookup_requests("ns_r0", names))
    assert len(requests) > 1
    assert all(len(r) <= proto.LOOKUP_MAX_REQUEST for r in requests)
    assert all(r.startswith(b"ns_r0\n") for r in requests)
    assert [n for r in requests for n in r.split(b"\n")[1:]] == [n.encode() for n in names]
    assert list(proto.lookup_requests("", ["a.bin"])) == [b"\na.bin"]
    for bad in (["a.bin", "b\nc.bin"], ["a.bin\n"], ["\n"]):
        with pytest.raises(ValueError, match="newline"):
            list(proto.lookup_requests("ns_r0", bad))


def test_on_a_shared_directory_another_hosts_chunks_are_hits(tmp_path: Path) -> None:
    """--shared: a batched lookup finds what another host published, in folders this host
    never saw (one trip to the backing directory for all the request's unknown names), as a
    LOOKUP of each would; the rest stay misses."""
    from tests.test_shared import counters, shared_mount

    (tmp_path / "backing").mkdir()
    a, b = (shared_mount(tmp_path, tmp_path / "backing", host) for host in ("a", "b"))
    a.start()
    try:
        b.start()
        try:
            base = "model_0123456789ab_r0"
            theirs = [chunk(k) for k in range(8)]
            store(a.path / base, theirs)
            a.settle()
            names = [*theirs, chunk(100), chunk(101)]  # two nobody stored
            before = counters(b)["fell_through"]
            answer = ask(b, ("\n".join([base, *names]) + "\n").encode())
            assert answer == bytes([proto.LOOKUP_HIT] * 8 + [proto.LOOKUP_MISS] * 2)
            assert counters(b)["fell_through"] > before  # the folders and the chunks joined
            assert ask(b, f"{base}\n{theirs[0]}\n".encode()) == bytes([proto.LOOKUP_HIT])  # indexed
            assert (b.path / base / theirs[3]).read_bytes() == b"kv"
        finally:
            b.stop()
    finally:
        a.stop()
