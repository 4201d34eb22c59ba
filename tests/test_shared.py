"""Two daemons (hosts a and b), two mountpoints, one backing directory (``--shared``): what one
host publishes is a hit on the other, what one removes is a miss (never EIO) on the other, and
two publishes of one name keep one whole file."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfs import journal
from kvfs.buffers import on_disk
from kvfs.config import daemon_log
from tests.conftest import SESSION_OPTIONS, Mount, free_port, kvfs
from tests.test_cli import assert_refused


def counters(mount: Mount) -> dict[str, int]:
    return dict(mount.usage()["counters"])


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


@pytest.fixture
def lag() -> float:
    """Seconds another host's publish or removal may take to show past what each test allows
    (0 on one local directory; tests/test_shared_sshfs.py runs the cross-host tests below
    again over sshfs, with its own ``hosts`` and ``lag``)."""
    return 0.0


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
    hosts: tuple[Mount, Mount], lag: float
) -> None:
    a, b = hosts
    write(a, "late/x.bin", b"first")
    late = b.path / "late" / "y.bin"
    assert not late.exists()  # a negative entry in b's kernel, for a second
    write(a, "late/y.bin", b"published meanwhile")
    wait_for("another host's publish, once the miss lapses", late.exists, timeout=3 + lag)
    assert late.read_bytes() == b"published meanwhile"


def test_a_chunk_another_host_removed_is_a_miss_never_eio(
    hosts: tuple[Mount, Mount], lag: float
) -> None:
    a, b = hosts
    for name in ("gone/u.bin", "gone/e.bin"):
        write(a, name, os.urandom(8192))
        assert (b.path / name).read_bytes() == (a.path / name).read_bytes()  # b indexed it

    def gone() -> int:  # found gone at an open, or dropped when a's journal said so
        return counters(b)["gone_elsewhere"] + share(b)["dropped"]

    def a_miss(name: str) -> bool:
        """b's read of ``name``: a miss (over a network share b may serve the whole chunk it
        holds until a's journal is read, within ``lag``: never wrong bytes); never EIO."""
        try:
            data = (b.path / name).read_bytes()
        except FileNotFoundError:
            return True
        assert len(data) == 8192
        return False

    before = gone()
    (a.path / "gone/u.bin").unlink()  # unlinked through a
    kvfs("evict", str(a.path), "--namespace", "gone")  # and evicted through a
    for name in ("gone/u.bin", "gone/e.bin"):
        wait_for(f"{name} a miss on b", lambda: a_miss(name), timeout=lag)  # noqa: B023
        assert not (b.path / name).exists()
    assert gone() == before + 2


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
    assert "another host published other bytes" in daemon_log(b.path).read_text()


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


# -- one capacity for the share: journals, the sweep lease, takeover -------------------------

TTL = 1.5  # --lease-ttl for these tests: a takeover within TTL + TTL/3
CHUNK = 256 << 10
SMALL = 64 << 10


def share(mount: Mount) -> dict[str, Any]:
    usage = mount.usage()
    state = usage["share"]
    assert state is not None
    return dict(state)


def wait_for(
    what: str,
    condition: Callable[[], bool],
    timeout: float = 60,
    explain: Callable[[], str] = lambda: "",
) -> float:
    """Poll until ``condition()``; returns the seconds it took. ``explain``: what the
    failure message adds (the state that never came right)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s{explain()}"
        time.sleep(0.02)
    return time.monotonic() - start


def share_bytes(backing: Path | str) -> int:
    """What the share holds on disk, as the capacity counts it (whole 4 KiB blocks)."""
    total = 0
    for top, dirs, files in os.walk(str(backing)):
        if top == str(backing):
            dirs[:] = [d for d in dirs if d != ".kvfs"]
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += on_disk(os.lstat(os.path.join(top, name)).st_size)
    return total


# Samples the share's bytes on disk in a process of its own (the test's writer threads would
# hold its thread up mid-walk), keeping only walks that took under 20 ms: a walk is no
# snapshot, and what the share does while a slow one runs would be counted twice.
SAMPLER = """
import os, sys, time
from tests.test_shared import share_bytes
peak = samples = 0
while not os.path.exists(sys.argv[2]):
    start = time.monotonic()
    now = share_bytes(sys.argv[1])
    if time.monotonic() - start < 0.02:
        peak, samples = max(peak, now), samples + 1
    time.sleep(0.005)
print(peak, samples)
"""


class Sampler:
    def __init__(self, backing: Path) -> None:
        self.stop_file = backing.parent / "stop-sampling"
        self.process = subprocess.Popen(
            [sys.executable, "-c", SAMPLER, str(backing), str(self.stop_file)],
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> tuple[int, int]:
        """The peak and how many samples it is of."""
        self.stop_file.touch()
        out, _ = self.process.communicate(timeout=60)
        peak, samples = out.split()
        return int(peak), int(samples)


@contextlib.contextmanager
def fleet(
    tmp: Path,
    names: tuple[str, ...],
    *options: str,
    first: tuple[str, ...] = (),
    backings: list[Path] | None = None,
) -> Iterator[list[Mount]]:
    """Daemons for ``names`` on one backing directory (``first``: options of the first
    alone; ``backings``: each host's path to it), always unmounted."""
    if backings is None:
        (tmp / "backing").mkdir()
        backings = [tmp / "backing"] * len(names)
    mounts = [
        shared_mount(tmp, backing, name) for name, backing in zip(names, backings, strict=True)
    ]
    for i, mount in enumerate(mounts):
        own = first if i == 0 else ()
        mount.options = (*mount.options, "--lease-ttl", str(TTL), *options, *own)
    try:
        for mount in mounts:
            mount.start()
        yield mounts
    finally:
        for mount in mounts:
            mount.stop()


def holder_of(mounts: list[Mount]) -> Mount:
    found: list[Mount] = []

    def one_holds() -> bool:
        found[:] = [m for m in mounts if share(m)["lease_holder"]]
        return len(found) == 1

    wait_for("one lease holder", one_holds)
    return found[0]


def write_chunks(
    mount: Mount, prefix: str, count: int, failures: list[OSError], size: int = CHUNK
) -> None:
    for i in range(count):
        path = mount.path / f"{prefix}{i:03d}.bin"
        try:
            path.write_bytes(os.urandom(size))
        except OSError as err:  # ENOSPC: the share stayed full past the wait (a cache may drop)
            failures.append(err)


def caught_up(mounts: list[Mount]) -> bool:
    """Every host has read every other host's journal to its end, and counts the same."""
    states = [share(m) for m in mounts]
    journals = mounts[0].backing / ".kvfs" / "journal"
    for state, mount in zip(states, mounts, strict=True):
        if state["pending_lines"]:
            return False
        name = mount.path.name
        size = (journals / f"{name}.log").stat().st_size
        for other in states:
            if other["host"] != name and other["hosts"].get(name, {}).get("offset") != size:
                return False
    return len({s["used"] for s in states}) == 1


def disagreement(mounts: list[Mount], served: Path) -> str:
    """For a failure message: what each host counts, what the share holds, and each log's end."""
    lines = [f"\non disk: {share_bytes(served)} bytes in {sorted_files(served)}"]
    for mount in mounts:
        state = share(mount)
        del state["hosts"]
        lines.append(f"{mount.path.name}: {state}")
        lines.extend(daemon_log(mount.path).read_text().splitlines()[-15:])
    return "\n".join(lines)


def sorted_files(backing: Path) -> list[str]:
    return sorted(
        str(p.relative_to(backing))
        for p in backing.rglob("*")
        if p.is_file() and p.relative_to(backing).parts[0] != ".kvfs"
    )


def test_one_capacity_holds_for_the_share_under_writers_on_every_host(tmp_path: Path) -> None:
    capacity = 16 << 20
    with fleet(tmp_path, ("a", "b", "c"), "--capacity", "16M") as mounts:
        backing = mounts[0].backing
        for mount in mounts:
            (mount.path / f"ns-{mount.path.name}").mkdir()
        failures: list[OSError] = []
        writers = [
            threading.Thread(
                target=write_chunks, args=(m, f"ns-{m.path.name}/w{j}-", 100, failures, SMALL)
            )
            for m in mounts
            for j in range(2)
        ]
        sampler = Sampler(backing)
        try:
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
            for mount in mounts:
                mount.settle()
            wait_for(
                "the hosts agree with the disk",
                lambda: caught_up(mounts) and share(mounts[0])["used"] == share_bytes(backing),
                explain=lambda: disagreement(mounts, backing),
            )
        finally:
            peak, samples = sampler.stop()
        written = 3 * 2 * 100 * SMALL  # more than twice the capacity
        assert len(failures) < 3 * 2 * 100 / 2, failures[:3]
        final = share_bytes(backing)
        print(
            f"peak {peak / capacity:.3f} of the capacity ({samples} samples), final "
            f"{final / capacity:.3f}; {written >> 20} MiB written, {len(failures)} refused"
        )
        assert samples >= 10
        # The design bounds the peak by 95 % + 1 % per other host; the issue asks within 5 %.
        # (1.1-1.3 were seen while a host that joined stayed unknown to the others for a
        # second: test_a_host_that_joins_counts_at_the_next_publish_of_the_others.)
        assert peak <= 1.05 * capacity
        assert final <= capacity  # and back under it once the writers stop; every host agrees
        assert all(share(m)["used"] == final for m in mounts)  # one view of the share
        evicted = sum(share(m)["swept"] for m in mounts)
        assert evicted * SMALL >= written - final - len(failures) * SMALL


def test_a_host_that_joins_counts_at_the_next_publish_of_the_others(tmp_path: Path) -> None:
    """A host that joins while the others write is room none of them keeps until they read
    its journal: each host looks for new journals at its next publish (one stat of the journal
    directory), not at the next periodic listing a second later (peaks of 1.1-1.3 before)."""
    with fleet(tmp_path, ("a",)) as (a,):
        (a.path / "ns").mkdir()
        write(a, "ns/before.bin", os.urandom(SMALL))
        b = shared_mount(tmp_path, a.backing, "b")
        b.options = (*b.options, "--lease-ttl", str(TTL))
        try:
            b.start()
            write(a, "ns/after.bin", os.urandom(SMALL))
            assert "b" in share(a)["hosts"]
        finally:
            b.stop()


def journal_has(backing: Path, host: str, op: str, paths: set[bytes]) -> bool:
    data = (backing / ".kvfs" / "journal" / f"{host}.log").read_bytes()
    records = [journal.parse(line) for line in data.split(b"\n")]
    return paths <= {r.path for r in records if r is not None and r.op == op}


def read_by(mount: Mount, host: str) -> bool:
    """``mount`` has read ``host``'s journal to its end."""
    size = (mount.backing / ".kvfs" / "journal" / f"{host}.log").stat().st_size
    return bool(share(mount)["hosts"].get(host, {}).get("offset") == size)


def test_the_globally_least_recently_read_go_first(tmp_path: Path) -> None:
    """Chunks written through a, the oldest of them read through b: a sweep (whoever holds
    the lease) evicts the oldest that nobody read, never those b read."""
    with fleet(tmp_path, ("a", "b"), "--capacity", "4M") as (a, b):
        (a.path / "ns").mkdir()
        old = [f"ns/c{i:02d}.bin" for i in range(12)]  # 12 of 16 chunks of room
        for rel in old:
            write(a, rel, os.urandom(CHUNK))
        for rel in old[:4]:  # the four oldest become the share's newest
            assert (b.path / rel).read_bytes() == (a.backing / rel).read_bytes()
        wanted = {rel.encode() for rel in old[:4]}
        wait_for("b journals its reads", lambda: journal_has(a.backing, "b", "R", wanted))
        wait_for("a reads b's journal", lambda: read_by(a, "b"))
        for i in range(6):  # 18 chunks: past the high watermark
            write(a, f"ns/n{i}.bin", os.urandom(CHUNK))
        wait_for("the sweep", lambda: share_bytes(a.backing) <= 0.9 * (4 << 20))
        present = {rel for rel in old if (a.backing / rel).exists()}
        gone = [rel for rel in old if rel not in present]
        assert set(old[:4]) <= present  # read on b: the newest of all
        assert gone and gone == old[4 : 4 + len(gone)]  # the oldest unread, in order
        assert all((a.backing / f"ns/n{i}.bin").exists() for i in range(6))
        for rel in gone:  # a miss on both hosts, never EIO
            for host in (a, b):
                # Whoever swept, the other may not have read its journal yet (on a loaded
                # machine a still listed a chunk b evicted): its open finds the file gone,
                # answers a miss and forgets the name.
                with pytest.raises(FileNotFoundError):
                    (host.path / rel).read_bytes()
                assert not (host.path / rel).exists()


def test_a_killed_lease_holder_is_replaced_within_the_bound(tmp_path: Path) -> None:
    """kill -9 of the holder while the other host writes (so mid-sweep, as a rule): the other
    takes the lease within TTL + TTL/3, and the share is back under its capacity."""
    capacity = 4 << 20
    with fleet(tmp_path, ("a", "b"), "--capacity", "4M") as mounts:
        holder = holder_of(mounts)
        other = next(m for m in mounts if m is not holder)
        (other.path / "ns").mkdir()
        write_chunks(other, "ns/before-", 15, [])  # near the high watermark
        failures: list[OSError] = []
        writer = threading.Thread(target=write_chunks, args=(other, "ns/after-", 32, failures))
        writer.start()
        try:
            wait_for("a sweep", lambda: share(holder)["swept"] > 0)
            killed = time.monotonic()
            holder.kill()  # kill -9 (it renews no more, releases nothing); dead mount cleared
            wait_for("the takeover", lambda: share(other)["lease_holder"], timeout=30)
            took = time.monotonic() - killed
        finally:
            writer.join()
        print(f"takeover {took:.2f}s after kill -9 (TTL {TTL}s)")
        # TTL + one poll period (TTL/3) is the design's bound; a loaded machine adds its
        # scheduling delay, so allow a second more.
        assert took <= TTL + TTL / 3 + 1.0
        assert share(other)["leases_broken"] == 1
        other.settle()
        wait_for("the sweep", lambda: share_bytes(other.backing) <= capacity)
        assert not failures  # the writes waited for the new sweeper, none was refused
        assert share(other)["swept"] > 0


def test_hostile_and_corrupt_journal_lines_are_skipped_and_counted(
    hosts: tuple[Mount, Mount],
) -> None:
    a, _ = hosts
    journals = a.backing / ".kvfs" / "journal"
    write(a, "hostile/real.bin", b"r" * 5000)
    before = share(a)["used"]
    lines = [
        journal.header(1, "evil"),
        b"not a record\n",
        b"00000000 P 1 2 3 hostile/x.bin\n",  # wrong checksum
        journal._line("P 1 5000 1 ../../etc/passwd"),
        journal._line("P 1 5000 1 .kvfs/lock"),
        journal._line("E 1 /etc/passwd"),
        journal._line(f"P 1 {1 << 60} 1 hostile/huge.bin"),
        journal._line("R -1 1 hostile/real.bin"),
        b"\xff\xfe\x00\x01\n",
        b"x" * 20000 + b"\n",  # longer than any line
        journal.header(1, "evil"),  # a header in the middle
        journal.read(b"hostile/real.bin", time.time_ns(), 1),  # valid: applied
    ]
    (journals / "evil.log").write_bytes(b"".join(lines))
    (journals / "evil2.log").write_bytes(
        b"garbage header\n" + journal.evicted(b"hostile/real.bin", 1)
    )
    bad = len(lines) - 2

    def skipped(host: str) -> int:
        return int(share(a)["hosts"].get(host, {}).get("skipped", -1))

    wait_for("a reads the hostile journals", lambda: read_by(a, "evil") and read_by(a, "evil2"))
    assert skipped("evil") == bad and skipped("evil2") == 1
    assert share(a)["hosts"]["evil"]["lines"] == 1
    # A torn last line is not skipped: it is read again, whole, once its writer ends it.
    torn = journal.read(b"hostile/real.bin", time.time_ns(), 2)
    with open(journals / "evil.log", "ab") as f:
        f.write(journal.read(b"hostile/real.bin", time.time_ns(), 2) + torn[:12])
    wait_for("one more line", lambda: share(a)["hosts"]["evil"]["lines"] == 2)
    with open(journals / "evil.log", "ab") as f:
        f.write(torn[12:])
    wait_for("the torn line, whole", lambda: share(a)["hosts"]["evil"]["lines"] == 3)
    assert skipped("evil") == bad
    # Nothing of it counted, the daemon serves on, and the metrics say it.
    assert share(a)["used"] == before  # evil2's E (after its bad header): older than x
    assert (a.path / "hostile/real.bin").read_bytes() == b"r" * 5000
    assert share(a)["skipped_lines"] >= bad + 1
    (journals / "evil.log").unlink()
    (journals / "evil2.log").unlink()


def test_a_host_that_restarts_resumes_its_journal(hosts: tuple[Mount, Mount]) -> None:
    a, b = hosts
    journals = a.backing / ".kvfs" / "journal"
    write(a, "resume/x.bin", os.urandom(10000))
    wait_for("a journals x", lambda: journal_has(a.backing, "a", "P", {b"resume/x.bin"}))
    wait_for("b reads it", lambda: read_by(b, "a"))
    used, log = share(b)["used"], (journals / "a.log").read_bytes()
    a.kill()  # kill -9, then a torn line as a crash mid-write could leave
    with open(journals / "a.log", "ab") as f:
        f.write(journal.published(b"resume/torn.bin", 1, 1, 1)[:20])
    skipped = share(b)["hosts"]["a"]["skipped"]
    a.start()
    assert (journals / "a.log").read_bytes().startswith(log)  # resumed, not started over
    assert share(a)["used"] == used  # x counted once, from a's own journal
    write(a, "resume/y.bin", os.urandom(10000))
    wait_for("a journals y", lambda: journal_has(a.backing, "a", "P", {b"resume/y.bin"}))
    wait_for("b reads on", lambda: read_by(b, "a"))
    assert share(b)["hosts"]["a"]["skipped"] == skipped + 1  # the torn line, ended
    assert share(b)["used"] == used + on_disk(10000)
    assert (b.path / "resume/y.bin").exists()


def test_a_kept_passthrough_backing_file_goes_when_the_journals_say_its_chunk_went(
    tmp_path: Path,
) -> None:
    """b reads a chunk in passthrough and keeps its backing file for the next open; a evicts
    it: once b reads a's journal, an open on b is a miss, not the old bytes."""
    passthrough = ("--session", "kernel", "--verify", "first-read", "--scrub-rate", "0")
    with fleet(tmp_path, ("a", "b"), *passthrough) as (a, b):
        data = os.urandom(CHUNK)
        write(a, "pt/x.bin", data)

        def session() -> dict[str, Any]:
            return dict(b.usage()["session"])

        def read_again() -> bool:  # served and verified; passed through; then the kept file
            assert (b.path / "pt/x.bin").read_bytes() == data
            return bool(session()["backing_reused"] >= 1)

        read_again()
        if not session()["passthrough"]:
            pytest.skip("this kernel refuses passthrough")
        wait_for("b keeps x's backing file between opens", read_again)
        dropped = share(b)["dropped"]
        kvfs("evict", str(a.path), "--namespace", "pt")
        wait_for("b drops x", lambda: share(b)["dropped"] == dropped + 1)
        gone = counters(b)["gone_elsewhere"]
        with pytest.raises(FileNotFoundError):
            (b.path / "pt/x.bin").read_bytes()
        assert counters(b)["gone_elsewhere"] == gone  # a miss at the lookup: never opened


def scrape(port: int) -> dict[str, float]:
    """The unlabelled kvfs samples /metrics serves now."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    families = text_string_to_metric_families(text.decode())
    return {s.name: s.value for f in families for s in f.samples if not s.labels}


def test_the_share_in_metrics(tmp_path: Path) -> None:
    port = free_port()
    with fleet(tmp_path, ("a", "b"), "--capacity", "4M", first=("--metrics-port", str(port))) as (
        a,
        b,
    ):
        write(b, "m/x.bin", os.urandom(10000))
        wait_for("a reads b's journal", lambda: read_by(a, "b") and share(a)["files"] == 1)
        holder = holder_of([a, b])
        wait_for("a's view of it", lambda: scrape(port)["kvfs_share_used_bytes"] == 12288)
        metrics = scrape(port)
        assert metrics["kvfs_share_lease_holder"] == (1 if holder is a else 0)
        assert metrics["kvfs_share_files"] == 1 and metrics["kvfs_share_hosts"] == 1
        assert metrics["kvfs_share_journal_skipped_lines_total"] == 0
        assert 0 <= metrics["kvfs_share_journal_lag_seconds"] < 30
        assert metrics["kvfs_capacity_bytes"] == 4 << 20
        assert metrics["kvfs_used_bytes"] == 12288  # the share's, not this host's own 0
        guide = (Path(__file__).parent.parent / "docs" / "guide.md").read_text()
        section = guide[guide.index("## Metrics") :].split("\n## ")[0]
        listed = set(re.findall(r"`(kvfs_share_[a-z_]+)", section))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        exported = {
            f.name + "_total" if f.type == "counter" else f.name
            for f in text_string_to_metric_families(text.decode())
            if f.name.startswith("kvfs_share_")
        }
        assert listed == exported  # the guide names every share metric, and no other
