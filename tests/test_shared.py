"""Two daemons (hosts a and b), two mountpoints, one backing directory (``--shared``): what one
host publishes is a hit on the other, what one removes is a miss (never EIO) on the other, and
two publishes of one name keep one whole file."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SESSION_OPTIONS, Mount, kvfs
from tests.test_cli import assert_refused


def counters(mount: Mount) -> dict[str, int]:
    usage = json.loads((mount.path / ".kvfs" / "usage.json").read_bytes())
    return dict(usage["counters"])


def shared_mount(tmp: Path, backing: Path, host: str) -> Mount:
    (tmp / host).mkdir()
    return Mount(tmp / host, backing, (*SESSION_OPTIONS, "--shared", host))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, Mount]]:
    tmp = tmp_path_factory.mktemp("shared")
    (tmp / "backing").mkdir()
    a, b = (shared_mount(tmp, tmp / "backing", host) for host in ("a", "b"))
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        b.stop()
        a.stop()


def write(mount: Mount, rel: str, data: bytes) -> None:
    path = mount.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    mount.settle()


def test_a_chunk_published_by_one_host_is_a_byte_exact_hit_on_the_other(
    hosts: tuple[Mount, Mount],
) -> None:
    a, b = hosts
    data = os.urandom((1 << 20) + 123)
    write(a, "hit/layer0/c1.bin", data)  # directories b has never seen, too
    before = counters(b)["fell_through"]
    assert (b.path / "hit/layer0/c1.bin").read_bytes() == data
    assert counters(b)["fell_through"] == before + 3  # hit, hit/layer0, the chunk


def test_a_miss_is_cached_briefly_then_another_hosts_publish_is_found(
    hosts: tuple[Mount, Mount],
) -> None:
    a, b = hosts
    write(a, "late/x.bin", b"first")
    late = b.path / "late" / "y.bin"
    assert not late.exists()  # a negative entry in b's kernel, for a second
    write(a, "late/y.bin", b"published meanwhile")
    start = time.monotonic()
    while not late.exists():
        assert time.monotonic() - start < 3, "the miss was cached too long"
        time.sleep(0.05)
    assert late.read_bytes() == b"published meanwhile"


def test_a_chunk_another_host_removed_is_a_miss_never_eio(hosts: tuple[Mount, Mount]) -> None:
    a, b = hosts
    for name in ("gone/u.bin", "gone/e.bin"):
        write(a, name, os.urandom(8192))
        assert (b.path / name).read_bytes() == (a.path / name).read_bytes()  # b indexed it
    before = counters(b)["gone_elsewhere"]
    (a.path / "gone/u.bin").unlink()  # unlinked through a
    kvfs("evict", str(a.path), "--namespace", "gone")  # and evicted through a
    for name in ("gone/u.bin", "gone/e.bin"):
        with pytest.raises(FileNotFoundError):
            (b.path / name).read_bytes()
        assert not (b.path / name).exists()
    assert counters(b)["gone_elsewhere"] == before + 2


def test_one_name_published_by_both_hosts_keeps_one_whole_file(
    hosts: tuple[Mount, Mount],
) -> None:
    a, b = hosts
    (a.path / "race").mkdir()
    ours, theirs = os.urandom(300_000), os.urandom(200_000)
    before = counters(b)["publish_conflicts"]
    for name, b_bytes in (("same.bin", ours), ("other.bin", theirs)):
        with open(a.path / "race" / name, "wb") as fa, open(b.path / "race" / name, "wb") as fb:
            fa.write(ours)
            fb.write(b_bytes)
            fa.close()
            a.settle()  # a publishes first; b's publish then finds the name taken
        b.settle()
        assert (a.backing / "race" / name).read_bytes() == ours
        assert (b.path / "race" / name).read_bytes() == ours
        assert (a.path / "race" / name).read_bytes() == ours
    assert counters(b)["publish_conflicts"] == before + 1  # the same bytes are no conflict
    assert counters(a)["publish_conflicts"] == 0


def test_a_rename_onto_a_name_another_host_took_keeps_theirs(hosts: tuple[Mount, Mount]) -> None:
    a, b = hosts
    write(a, "ren/seen.bin", b"x")
    write(b, "ren/tmp.part", b"b's other bytes")
    before = counters(b)["publish_conflicts"]
    final = b.path / "ren" / "final.bin"
    write(a, "ren/final.bin", b"a's bytes")
    os.rename(b.path / "ren" / "tmp.part", final)  # b's lookup of the target finds a's
    assert (a.backing / "ren" / "final.bin").read_bytes() == b"a's bytes"
    assert final.read_bytes() == b"a's bytes"
    assert not (a.backing / "ren" / "tmp.part").exists()
    assert counters(b)["publish_conflicts"] == before + 1
    write(b, "ren/again.part", b"a's bytes")  # the same bytes: a plain rename, no conflict
    os.rename(b.path / "ren" / "again.part", final)
    assert final.read_bytes() == b"a's bytes"
    assert counters(b)["publish_conflicts"] == before + 1


def test_each_host_empties_only_its_own_private_area(hosts: tuple[Mount, Mount]) -> None:
    a, b = hosts
    marker = b.backing / ".kvfs" / "hosts" / "b" / "tmp" / "in-use"
    marker.write_bytes(b"b's")
    a.restart()
    assert marker.exists()
    marker.unlink()


def test_one_host_id_twice_and_owners_and_sharers_refuse_each_other(
    hosts: tuple[Mount, Mount], tmp_path: Path
) -> None:
    a, _ = hosts
    other = tmp_path / "other"
    other.mkdir()
    same = kvfs("mount", str(other), "--backing", str(a.backing), "--shared", "a", check=False)
    assert_refused(same, "served as host a by another kvfs daemon", other)
    owner = kvfs("mount", str(other), "--backing", str(a.backing), check=False)
    assert_refused(owner, "shared by --shared kvfs daemons", other)
    alone = Mount(tmp_path / "alone", tmp_path / "alone-backing", SESSION_OPTIONS)
    alone.path.mkdir()
    alone.backing.mkdir()
    try:
        alone.start()
        args = ("--backing", str(alone.backing), "--shared", "c")
        assert_refused(kvfs("mount", str(other), *args, check=False), "without --shared", other)
    finally:
        alone.stop()


@pytest.mark.parametrize("host", ["a/b", "", "x" * 65, "..", "a b"])
def test_a_bad_host_id_is_refused_in_one_line(tmp_path: Path, host: str) -> None:
    args = ("mount", str(tmp_path), "--backing", str(tmp_path / "b"), "--shared", host)
    assert_refused(kvfs(*args, check=False), "is not a host id", tmp_path)
