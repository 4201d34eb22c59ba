"""The share's journals and sweep lease (kvfs/journal.py, kvfs/lease.py), on a plain directory:
the format read back, hostile lines skipped and counted, torn lines read again, compaction
followed by a reader that holds the old log and by one that starts afresh, the view's order,
and the lease taken, renewed, broken by exactly one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvfs import journal, lease
from kvfs.buffers import on_disk
from kvfs.journal import Record, Tail, View, Writer


def root_of(tmp_path: Path) -> bytes:
    (tmp_path / ".kvfs").mkdir(exist_ok=True)
    return os.fsencode(tmp_path)


def test_records_read_back_exactly() -> None:
    path = b"m_0123/abc/d_g0/\xff odd%name.bin"
    lines = [
        journal.published(path, 5, 1 << 20, 7),
        journal.evicted(path, 9),
        journal.read(path, 11, 3),
    ]
    assert [journal.parse(line[:-1]) for line in lines] == [
        Record("P", path, 5, 1 << 20, 7),
        Record("E", path, 9),
        Record("R", path, 11, 3),
    ]
    assert journal.parse(journal.header(4, "host-1")[:-1]) == Record(
        "H", stamp=4, size=1, host="host-1"
    )


def valid(body: str) -> bytes:
    """A line with a correct checksum around whatever body (the hostile case)."""
    return journal._line(body)[:-1]


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"garbage",
        b"00000000 P 1 2 3 a/b",  # wrong checksum
        journal.published(b"a/b", 1, 2, 3)[:-1].replace(b"a/b", b"a/c"),  # a flipped byte
        valid("X 1 a"),  # no such record
        valid("P 1 2 3"),  # too few fields
        valid("P 1 2 3 a/b c"),  # too many
        valid("P 1 2 3 ../etc/passwd"),
        valid("P 1 2 3 /etc/passwd"),
        valid("P 1 2 3 .kvfs/lock"),
        valid("P 1 2 3 a//b"),
        valid("P 1 2 3 a/./b"),
        valid("P 1 2 3 a%00b"),
        valid("P 1 2 3 " + "x" * 300),  # a name longer than NAME_MAX
        valid("P 1 -2 3 a/b"),
        valid("P 1 +2 3 a/b"),
        valid("P 1 2_0 3 a/b"),
        valid(f"P 1 {1 << 60} 3 a/b"),  # larger than any chunk
        valid("P 1 2 99999999999999999999999 a/b"),
        valid("E x a/b"),
        valid("R 1 a/b"),
        valid("H 1 1 ../x"),
        valid("H 0 1 a"),
        b"\xff\xfe 12",
    ],
)
def test_a_hostile_or_corrupt_line_is_refused(line: bytes) -> None:
    assert journal.parse(line) is None


def test_a_tail_skips_and_counts_bad_lines_and_rereads_a_torn_one(tmp_path: Path) -> None:
    root = root_of(tmp_path)
    writer = Writer(root, "a")
    writer.open()
    good = journal.published(b"ns/one", 1, 100, 1)
    writer.append(good + b"junk\n" + valid("P 1 2 3 ../x") + b"\n" + b"y" * 9000 + b"\n")
    tail = Tail("a")
    assert tail.poll(root) == [Record("P", b"ns/one", 1, 100, 1)]
    assert tail.skipped == 3
    second = journal.evicted(b"ns/one", 2)
    writer.append(second[:10])  # torn: the rest comes later
    assert tail.poll(root) == [] and tail.skipped == 3
    writer.append(second[10:])
    assert tail.poll(root) == [Record("E", b"ns/one", 2)]
    assert tail.skipped == 3 and tail.lines == 2


def test_a_restarted_writer_resumes_its_log_and_ends_a_torn_line(tmp_path: Path) -> None:
    root = root_of(tmp_path)
    writer = Writer(root, "a")
    writer.open()
    writer.append(journal.published(b"ns/one", 1, 100, 1))
    writer.append(journal.published(b"ns/two", 2, 100, 2)[:15])  # killed mid-write
    writer.close()
    before = (tmp_path / ".kvfs/journal/a.log").read_bytes()
    again = Writer(root, "a")
    again.open()
    assert again.generation == 1
    again.append(journal.published(b"ns/three", 3, 100, 3))
    after = (tmp_path / ".kvfs/journal/a.log").read_bytes()
    assert after.startswith(before)  # resumed, not started over
    tail = Tail("a")
    assert [r.path for r in tail.poll(root)] == [b"ns/one", b"ns/three"]
    assert tail.skipped == 1  # the torn line, ended by the restart


def test_compaction_is_followed_by_old_and_fresh_readers(tmp_path: Path) -> None:
    root = root_of(tmp_path)
    writer = Writer(root, "a")
    writer.open()
    view = View()
    follower = Tail("a")
    for i in range(5):
        line = journal.published(b"ns/%d" % i, i + 1, 4096, i + 1)
        writer.append(line)
        view.apply("a", journal.parse(line[:-1]))  # type: ignore[arg-type]
    assert len(follower.poll(root)) == 5
    writer.append(journal.evicted(b"ns/0", 10))  # written before the compaction...
    view.remove(b"ns/0", 10)
    writer.compact(view.snapshot("a"))
    writer.append(journal.published(b"ns/9", 11, 4096, 11))  # ... and after it
    assert writer.generation == 2
    followed = follower.poll(root)  # the old log drained, then the new one
    assert [(r.op, r.path) for r in followed] == [("E", b"ns/0"), ("P", b"ns/9")]
    fresh = Tail("a")
    records = fresh.poll(root)  # the snapshot, then the new log
    rebuilt = View()
    for rec in records:
        rebuilt.apply("a", rec)
    assert sorted(rebuilt.entries) == [b"ns/%d" % i for i in (1, 2, 3, 4, 9)]
    assert rebuilt.used == 5 * 4096 and fresh.skipped == 0


def test_a_snapshot_of_another_generation_is_ignored(tmp_path: Path) -> None:
    """A crash between the snapshot's rename and the new log's: the old log is complete."""
    root = root_of(tmp_path)
    writer = Writer(root, "a")
    writer.open()
    writer.append(journal.published(b"ns/1", 1, 10, 1))
    snapshot = journal.header(2, "a") + journal.published(b"ns/lie", 1, 10, 1)
    (tmp_path / ".kvfs/journal/a.snap").write_bytes(snapshot)
    assert [r.path for r in Tail("a").poll(root)] == [b"ns/1"]


def test_the_view_orders_by_global_recency_and_ignores_stale_records() -> None:
    view = View()
    for i, path in enumerate((b"a/1", b"a/2", b"a/3")):
        view.apply("a", Record("P", path, 10 + i, 5000, 10 + i))
    view.apply("b", Record("R", b"a/1", 50, 1))  # read on another host: now the newest
    assert view.used == 3 * on_disk(5000)
    assert view.pop_oldest() == b"a/2"
    view.requeue(b"a/2")
    assert view.remove(b"a/2", 20)
    assert not view.apply("a", Record("P", b"a/2", 15, 5000, 15))  # older than its eviction
    assert not view.remove(b"a/3", 5)  # an eviction of an older version than the live one
    assert [view.pop_oldest(), view.pop_oldest(), view.pop_oldest()] == [b"a/3", b"a/1", None]
    far = View()  # a record from far in the future is clamped to ``latest``
    far.apply("a", Record("P", b"x/1", 1 << 62, 1, 1 << 62), latest=100)
    assert far.entries[b"x/1"].stamp == 100 and far.entries[b"x/1"].last_read == 100


def test_the_lease_is_taken_once_renewed_and_broken_by_exactly_one(tmp_path: Path) -> None:
    root = root_of(tmp_path)
    for host in ("a", "b", "c"):
        (tmp_path / host).mkdir()
    a, b, c = (lease.Lease(root, h, h.encode(), ttl=30) for h in ("a", "b", "c"))
    assert a.step() and a.holding()
    assert not b.step() and b.holder == "a"
    assert a.step()  # renewed
    # a dies: its lease expires; b and c both see it expired, only one breaks it
    path = tmp_path / ".kvfs/sweep.lease"
    held = lease.decode(path.read_bytes())
    assert held is not None and held.host == "a"
    expired = lease.Holder("a", time.time_ns() - 1, held.nonce)
    path.write_bytes(lease.encode(expired))
    assert b._break(lease.encode(expired)) and not c._break(lease.encode(expired))
    assert b.step() and not c.step() and c.holder == "b"
    assert not a.step()  # a's renew finds the lease another's: a stops
    assert a.lost == 1 and not a.holding()
    b.release()
    assert c.step()
    assert sorted(os.listdir(tmp_path / "b") + os.listdir(tmp_path / "c")) == []  # no leftovers


def test_a_lease_moved_by_a_late_breaker_is_put_back(tmp_path: Path) -> None:
    root = root_of(tmp_path)
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
    a, b = lease.Lease(root, "a", b"a", ttl=30), lease.Lease(root, "b", b"b", ttl=30)
    assert a.step()
    stale = lease.encode(lease.Holder("old", 1, "0"))  # what b saw before a took it
    assert not b._break(stale)
    assert a.step() and a.holding()  # a's lease is back where it was


@pytest.mark.parametrize(
    "data",
    [b"", b"kvfs-lease 1 a 12\n", b"kvfs-lease 2 a 1 n\n", b"kvfs-lease 1 a -1 n\n", b"x" * 999],
)
def test_an_unreadable_lease_is_no_lease(data: bytes) -> None:
    assert lease.decode(data) is None
