"""Two hosts sharing one directory over a real network filesystem: an sshd on 127.0.0.1
serves it, each host mounts it with sshfs of its own (its own SSH connection, FUSE superblock
and caches), and each host's kvfs daemon (``--shared a`` / ``--shared b``) uses its sshfs
mount as the backing directory. What holds over sshfs and what does not:
docs/research/fleet-design.md, "Real shared filesystems"."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfs import control_protocol as proto
from kvfs.config import daemon_log
from tests.conftest import SESSION_OPTIONS, Mount, kvfs
from tests.sshfs import (
    SshServer,
    Unavailable,
    listening_addresses,
    shared_sshfs,
    skip_or_fail,
)
from tests.test_batch_lookup import ask, chunk, store
from tests.test_shared import (  # noqa: F401 (the test_*: run again here over sshfs)
    CHUNK,
    TTL,
    caught_up,
    counters,
    disagreement,
    fleet,
    holder_of,
    share_bytes,
    test_a_chunk_another_host_removed_is_a_miss_never_eio,
    test_a_chunk_published_by_one_host_is_a_byte_exact_hit_on_the_other,
    test_a_miss_is_cached_briefly_then_another_hosts_publish_is_found,
    test_a_rename_onto_a_name_another_host_took_keeps_theirs,
    test_one_name_published_by_both_hosts_keeps_one_whole_file,
    wait_for,
    write,
    write_chunks,
)
from tests.test_shared import share as shared_state

HOSTS = ("a", "b")


class Share:
    """The sshd, the served directory, each host's sshfs mount and kvfs mount."""

    def __init__(self, server: SshServer, served: Path, sshfs: dict[str, Path], tmp: Path):
        self.server, self.served, self.sshfs, self.tmp = server, served, sshfs, tmp
        self.kvfs: dict[str, Mount] = {}

    def mount(self, name: str, sshfs_of: str, *options: str, host: str | None = None) -> Mount:
        """A kvfs mount at ``tmp/name`` over the sshfs mount of host ``sshfs_of``, shared as
        ``host`` (default: ``name``; "": not shared, an owner)."""
        (self.tmp / name).mkdir()
        host = name if host is None else host
        shared = ("--shared", host) if host else ()
        return Mount(self.tmp / name, self.sshfs[sshfs_of], (*options, *shared))


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Share]:
    tmp = tmp_path_factory.mktemp("sshfs")
    try:
        with shared_sshfs(tmp, (*HOSTS, "c")) as (server, served, sshfs):
            share = Share(server, served, sshfs, tmp)
            try:
                # No scrub: a host's scrub may find a file a test changes on the server before
                # the read the test makes (a quarantined it first: b then missed; CI saw it).
                for host in HOSTS:
                    options = (*SESSION_OPTIONS, "--scrub-rate", "0")
                    share.kvfs[host] = share.mount(host, host, *options).start()
                yield share
            finally:
                for mount in reversed(share.kvfs.values()):
                    mount.stop()
    except Unavailable as why:
        skip_or_fail(why)


@pytest.fixture(scope="module")
def hosts(share: Share) -> tuple[Mount, Mount]:
    return share.kvfs["a"], share.kvfs["b"]


@pytest.fixture
def lag() -> float:
    """Seconds another host's change may take to show here past what the tests allow on one
    local directory (1 s unloaded; generous, as the bounds are asserted there)."""
    return 30.0


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` (a callable) until true; the seconds it took. Generous deadlines:
    the bound under test is asserted separately where it matters."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


# -- the server: loopback only, keys only -----------------------------------------------------


def test_the_sshd_listens_on_loopback_only_and_takes_no_passwords(share: Share) -> None:
    assert listening_addresses(share.server.port) == {"0100007F"}  # 127.0.0.1, nothing else
    ssh = [
        "ssh",
        "-F",
        "/dev/null",
        "-p",
        str(share.server.port),
        "-o",
        f"UserKnownHostsFile={share.server.home / 'known_hosts'}",
        "-o",
        "BatchMode=yes",
        "-o",
        "PubkeyAuthentication=no",  # no key: what is left to try is refused
        "root@127.0.0.1",
        "true",
    ]
    done = subprocess.run(ssh, capture_output=True, text=True, timeout=30)
    assert done.returncode == 255
    assert "Permission denied (publickey)" in done.stderr  # publickey is all it offers


# -- what sshfs itself offers, measured on two hosts' sshfs mounts ----------------------------


def test_sshfs_has_hard_links_and_atomic_rename_but_no_xattrs(share: Share) -> None:
    a, b = share.sshfs["a"], share.sshfs["b"]
    (a / "probe").mkdir()
    (a / "probe" / "one").write_bytes(b"one")
    os.link(a / "probe" / "one", a / "probe" / "linked")  # hardlink@openssh.com
    with pytest.raises(FileExistsError):  # link() never replaces: kvfs's publish
        os.link(a / "probe" / "one", b / "probe" / "linked")
    assert (b / "probe" / "linked").read_bytes() == b"one"
    (b / "probe" / "two").write_bytes(b"two")
    os.rename(b / "probe" / "two", b / "probe" / "one")  # posix-rename@openssh.com: replaces
    assert (a / "probe" / "one").read_bytes() == b"two"
    assert (a / "probe" / "linked").read_bytes() == b"one"
    for call in (
        lambda: os.setxattr(a / "probe" / "one", "user.kvfs.checksum", b"x"),
        lambda: os.getxattr(a / "probe" / "one", "user.kvfs.checksum"),
    ):
        with pytest.raises(OSError) as err:
            call()
        assert err.value.errno == errno.EOPNOTSUPP


def test_flock_excludes_within_one_sshfs_mount_but_not_across_two(share: Share) -> None:
    a, b = share.sshfs["a"], share.sshfs["b"]
    (a / "lockfile").write_bytes(b"")
    with open(a / "lockfile") as one, open(a / "lockfile") as same, open(b / "lockfile") as other:
        fcntl.flock(one, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(same, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one host: excluded
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another host: granted as well


def test_appends_from_two_hosts_keep_every_line_whole(share: Share) -> None:
    """With direct_io, each write() under O_APPEND reaches the server as one SFTP write to a
    file opened with SSH_FXF_APPEND: lines appended from two hosts at once stay whole (the
    journals' one write per batch). Without it the kernel splits a write at a page boundary
    and the other host's line can land between the halves (measured: 6 torn lines in 1 of 6
    runs of this test)."""
    lines, line = 300, "{} {:05d} " + "x" * 100 + "\n"  # 109 bytes: many cross a page edge

    def append(sshfs: Path, tag: str) -> None:
        fd = os.open(sshfs / "journal.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for i in range(lines):
                os.write(fd, line.format(tag, i).encode())
        finally:
            os.close(fd)

    writers = [threading.Thread(target=append, args=(share.sshfs[h], h)) for h in HOSTS]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    got = (share.served / "journal.log").read_text()
    assert sorted(got.splitlines(keepends=True)) == sorted(
        line.format(h, i) for h in HOSTS for i in range(lines)
    )


# -- kvfs's shared promises over sshfs --------------------------------------------------------


def test_sshfs_caches_add_no_lateness_to_a_removal(
    share: Share, hosts: tuple[Mount, Mount]
) -> None:
    """With SHARED_OPTIONS every stat kvfs makes reaches the server: a name b's sshfs has
    just seen and a then removed is a miss on b at once (with sshfs's defaults b would find
    the removed file for up to 20 s, each open of it then a miss)."""
    a, b = hosts
    names = [f"seen/{i}.bin" for i in range(20)]
    for name in names:
        write(a, name, b"soon gone")
    for name in names:
        os.stat(share.sshfs["b"] / name)  # b's sshfs has its attributes now
        (a.path / name).unlink()
    assert [name for name in names if (b.path / name).exists()] == []


def test_a_batched_lookup_finds_another_hosts_chunks(hosts: tuple[Mount, Mount]) -> None:
    """The connector's batched lookup: b finds a's chunks in folders b never saw, in one trip
    to the share; names nobody stored stay misses."""
    a, b = hosts
    base = "model_0123456789ab_r0"
    theirs = [chunk(k) for k in range(8)]
    store(a.path / base, theirs)
    a.settle()
    answer = ask(b, ("\n".join([base, *theirs, chunk(100), chunk(101)]) + "\n").encode())
    assert answer == bytes([proto.LOOKUP_HIT] * 8 + [proto.LOOKUP_MISS] * 2)
    assert (b.path / base / theirs[3]).read_bytes() == b"kv"


def attempt(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """``call()`` in a thread of its own, and what it returned, or its errno, once it did."""
    got: list[object] = []

    def run() -> None:
        try:
            got.append(call())
        except OSError as err:
            got.append(err.errno)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def test_a_hung_server_costs_at_most_the_io_timeout(share: Share) -> None:
    """The deadline promise over a network filesystem: with b's sshfs client stopped (every
    call on its mount hangs, as on a server that stopped answering), a read through a kvfs
    mount over it fails with EIO after --io-timeout, in either session (no passthrough read
    that would hang in the kernel); once the client runs again, the chunk is a hit."""
    data = os.urandom(64 * 1024)
    write(share.kvfs["a"], "hang/c.bin", data)
    late = share.mount("late", "c", *SESSION_OPTIONS, "--io-timeout", "2")
    client = share.server.clients[share.sshfs["c"]].proc
    assert client is not None
    try:
        late.start()
        os.kill(client.pid, signal.SIGSTOP)
        start = time.monotonic()
        reading, read = attempt((late.path / "hang" / "c.bin").read_bytes)
        reading.join(2 + 15)  # 2 s and the machine's load (a stalled mount fails, not hangs)
        took = time.monotonic() - start
        assert read == [errno.EIO], f"{read} after {took:.1f} s"
        os.kill(client.pid, signal.SIGCONT)
        wait_until(lambda: (late.path / "hang" / "c.bin").exists(), 30, "the chunk, again")
        assert (late.path / "hang" / "c.bin").read_bytes() == data
    finally:
        os.kill(client.pid, signal.SIGCONT)
        late.stop()


def test_a_read_waiting_on_a_hung_server_stalls_nothing_else(
    share: Share, hosts: tuple[Mount, Mount]
) -> None:
    """A chunk opened while the server answered, read once it stopped: the read fails with EIO
    after --io-timeout, and meanwhile the mount answers what needs no trip to the server (no
    stat or read of the backing store runs in the request loop: a stat of a file on sshfs
    asks the server)."""
    write(hosts[0], "stall/c.bin", os.urandom(64 * 1024))
    mount = share.mount("stall", "c", *SESSION_OPTIONS, "--io-timeout", "2")
    client = share.server.clients[share.sshfs["c"]].proc
    assert client is not None
    try:
        mount.start()
        with open(mount.path / "stall" / "c.bin", "rb", buffering=0) as reader:
            try:
                os.kill(client.pid, signal.SIGSTOP)
                reading, read = attempt(reader.read)
                time.sleep(0.5)  # its READ waits on the server
                asking, asked = attempt(lambda: os.getxattr(mount.path, "user.kvfs.pid"))
                asking.join(10)  # answered from memory, in the loop (stalled: until SIGCONT)
                assert asked == [str(mount.pid).encode()], "the mount stopped answering"
                reading.join(2 + 15)  # 2 s and the machine's load
                assert read == [errno.EIO]
            finally:  # before the close: a stalled mount's would wait for the server
                os.kill(client.pid, signal.SIGCONT)
    finally:
        os.kill(client.pid, signal.SIGCONT)
        mount.stop()


# -- what does not hold over sshfs, as documented ---------------------------------------------


def test_no_xattrs_checksums_stay_in_memory_and_another_host_cannot_verify(
    share: Share, hosts: tuple[Mount, Mount]
) -> None:
    """sshfs has no xattrs: each daemon keeps the checksums of its own publishes in memory
    only (logged once), so a file changed on the server after a's publish is served by b,
    which has nothing to check it against (documented as lost over sshfs); a, which
    published it, still refuses it (EIO, quarantined)."""
    a, b = hosts
    data = os.urandom(64 * 1024)
    write(a, "nosum/c.bin", data)
    assert "has no user xattrs: checksums are kept in memory only" in daemon_log(a.path).read_text()
    bad = bytearray(data)
    bad[1000] ^= 0xFF
    with open(share.served / "nosum" / "c.bin", "r+b") as f:  # on the server, same size
        f.write(bad)
    assert (b.path / "nosum" / "c.bin").read_bytes() == bytes(bad)
    assert counters(b)["quarantined"] == 0
    before = counters(a)["quarantined"]
    with pytest.raises(OSError) as err:  # a, the publisher, has the checksum in memory
        (a.path / "nosum" / "c.bin").read_bytes()
    assert err.value.errno == errno.EIO
    assert counters(a)["quarantined"] == before + 1


def test_a_pin_is_refused_where_the_share_has_no_xattrs(hosts: tuple[Mount, Mount]) -> None:
    a, _ = hosts
    write(a, "pin/c.bin", b"p" * 4096)
    with pytest.raises(OSError) as err:
        os.setxattr(a.path / "pin" / "c.bin", "user.kvfs.pin", b"1")
    assert err.value.errno == errno.EOPNOTSUPP


def test_locks_exclude_on_one_host_but_not_across_two(share: Share) -> None:
    """flock on sshfs holds within one sshfs mount only: a host id twice on one host is
    refused, but not on two hosts, and neither is an owner (no ``--shared``) beside sharers
    on another host (documented; the daemon logs a warning on a FUSE backing)."""
    twice = share.mount("c1", "a", *SESSION_OPTIONS, host="c")
    same_host = share.mount("c2", "a", *SESSION_OPTIONS, host="c")
    elsewhere = share.mount("c3", "b", *SESSION_OPTIONS, host="c")
    owner = share.mount("owner", "c", *SESSION_OPTIONS, host="")
    try:
        twice.start()
        refused = kvfs(
            "mount",
            str(same_host.path),
            "--backing",
            str(same_host.backing),
            *same_host.options,
            check=False,
        )
        assert refused.returncode != 0
        assert "served as host c by another kvfs daemon" in refused.stderr
        elsewhere.start()  # not refused: a's sshfs mount holds the lock, b's does not see it
        owner.start()  # not refused either, though a and b share the directory
        assert "its locks hold on this host only" in daemon_log(twice.path).read_text()
    finally:
        owner.stop()
        elsewhere.stop()
        twice.stop()


def test_sessions_over_sshfs_serve_every_read(share: Share) -> None:
    """A FUSE backing store gets no passthrough (the kernel would take an sshfs file as a
    backing file, and a hung server would then hang the read past any deadline): ``auto``
    picks pyfuse3 there even for ``--verify first-read``; an explicit kernel session does not
    ask for passthrough and serves the reads itself."""
    a = share.kvfs["a"]
    write(a, "sess/c.bin", b"s" * 8192)
    auto = share.mount("auto", "b", "--session", "auto", "--verify", "first-read")
    kernel = share.mount("kern", "b", "--session", "kernel", "--verify", "first-read")
    try:
        auto.start()
        assert "session: pyfuse3 (backing store on fuse.sshfs" in daemon_log(auto.path).read_text()
        kernel.start()
        for _ in range(2):
            assert (kernel.path / "sess" / "c.bin").read_bytes() == b"s" * 8192
        usage = kernel.usage()["session"]
        assert usage["name"] == "kernel" and not usage["passthrough"]
        assert usage["passthrough_opens"] == 0
        assert "backing store on fuse.sshfs: no passthrough" in daemon_log(kernel.path).read_text()
        assert usage["served_opens"] >= 2
    finally:
        kernel.stop()
        auto.stop()


# -- the share's capacity and sweep lease over sshfs (journals, lease file, link, rename) -----


@pytest.fixture
def own_share(tmp_path: Path) -> Iterator[tuple[Path, list[Path]]]:
    """A share of the test's own: the served directory, each host's sshfs mount of it."""
    try:
        with shared_sshfs(tmp_path, HOSTS) as (_, served, sshfs):
            yield served, [sshfs[h] for h in HOSTS]
    except Unavailable as why:
        skip_or_fail(why)


def test_two_hosts_over_sshfs_share_one_cache_and_one_capacity(
    tmp_path: Path, own_share: tuple[Path, list[Path]]
) -> None:
    """What sshfs proves: link() takes a name atomically (EEXIST) across two SFTP clients,
    O_APPEND journals are read whole by the other client, renames are atomic; it has no user
    xattrs (checksums stay in memory, pins are refused), so it shows the share's coordination
    working without them."""
    served, backings = own_share
    capacity = 4 << 20
    with fleet(tmp_path, HOSTS, "--capacity", "4M", backings=backings) as (a, b):
        data = os.urandom(CHUNK)
        write(a, "hit/x.bin", data)
        assert (b.path / "hit/x.bin").read_bytes() == data  # found through b's own client
        (a.path / "race").mkdir()
        with open(a.path / "race/n.bin", "wb") as fa, open(b.path / "race/n.bin", "wb") as fb:
            fa.write(b"a" * 5000)
            fb.write(b"b" * 5000)
            fa.close()
            a.settle()
        b.settle()
        assert (served / "race/n.bin").read_bytes() == b"a" * 5000
        assert counters(b)["publish_conflicts"] == 1
        failures: list[OSError] = []
        (a.path / "wa").mkdir()
        (b.path / "wb").mkdir()
        writers = [
            threading.Thread(target=write_chunks, args=(m, f"{d}/c", 16, failures))
            for m, d in ((a, "wa"), (b, "wb"))
        ]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()
        a.settle()
        b.settle()
        wait_for(
            "the hosts agree with the disk",
            lambda: caught_up([a, b]) and shared_state(a)["used"] == share_bytes(served),
            timeout=120,
            explain=lambda: disagreement([a, b], served),
        )
        final = share_bytes(served)
        print(f"sshfs: {final / capacity:.3f} of the capacity, {len(failures)} refused")
        assert final <= 1.05 * capacity and not failures
        assert shared_state(a)["used"] == final
        swept = sum(shared_state(m)["swept"] for m in (a, b))
        assert swept >= (32 * CHUNK - capacity) // CHUNK
        gone = next(
            f"wa/c{i:03d}.bin" for i in range(16) if not (served / f"wa/c{i:03d}.bin").exists()
        )
        with pytest.raises(FileNotFoundError):  # evicted: a miss on both hosts, not EIO
            (b.path / gone).read_bytes()


def test_a_chunk_evicted_while_its_host_has_it_open_leaves_nothing_among_the_chunks(
    tmp_path: Path, own_share: tuple[Path, list[Path]]
) -> None:
    """sshfs hides a file its client has open when that client unlinks it (.fuse_hidden*, until
    the release; for good when the release races the unlink, as CI saw after the scrub's
    reads). The daemon finds that at mount and unlinks from its own temp directory: what the
    client keeps lies there (emptied at each mount), not among the chunks."""
    served, backings = own_share
    with fleet(tmp_path, ("a",), backings=backings[:1]) as (a,):
        assert "hides a file unlinked while open" in daemon_log(a.path).read_text()
        (a.path / "ns").mkdir()
        write(a, "ns/c.bin", os.urandom(CHUNK))
        with open(backings[0] / "ns" / "c.bin", "rb"):  # open in a's own sshfs client
            assert "evicted 1 files" in kvfs("evict", str(a.path), "--namespace", "ns").stdout
            assert not (a.path / "ns" / "c.bin").exists()
            assert os.listdir(served / "ns") == []  # was [".fuse_hidden…"]
            tmp = served / ".kvfs" / "hosts" / "a" / "tmp"
            assert len(list(tmp.glob(".fuse_hidden*"))) == 1  # beside the lease's temp files
        a.restart()
        assert not list(tmp.glob(".fuse_hidden*"))


def test_a_killed_lease_holder_is_replaced_over_sshfs(
    tmp_path: Path, own_share: tuple[Path, list[Path]]
) -> None:
    """Two hosts, each over its own sshfs mount, one capacity: kill -9 of the lease holder
    while the other writes; the other takes the lease (the lease file read through its own
    sshfs client, link() to take it, rename() to break the stale one) and the share is back
    under its capacity, no write refused."""
    served, backings = own_share
    capacity = 4 << 20
    with fleet(tmp_path, HOSTS, "--capacity", "4M", backings=backings) as mounts:
        holder = holder_of(mounts)
        other = next(m for m in mounts if m is not holder)
        (other.path / "ns").mkdir()
        write_chunks(other, "ns/before-", 15, [])  # near the high watermark
        failures: list[OSError] = []
        writer = threading.Thread(target=write_chunks, args=(other, "ns/after-", 32, failures))
        writer.start()
        try:
            wait_for("a sweep", lambda: shared_state(holder)["swept"] > 0)
            killed = time.monotonic()
            holder.kill()  # kill -9; its dead kvfs mount is cleared, its sshfs mount stays
            wait_for("the takeover", lambda: shared_state(other)["lease_holder"], timeout=60)
            took = time.monotonic() - killed
        finally:
            writer.join()
        print(f"sshfs: takeover {took:.2f}s after kill -9 (TTL {TTL}s)")
        # The design's bound is TTL + TTL/3; sshfs round trips and a loaded machine add to
        # it, so the test allows a few seconds more (the figure is printed and documented).
        assert took <= TTL + TTL / 3 + 5
        assert shared_state(other)["leases_broken"] == 1
        other.settle()
        wait_for("the sweep", lambda: share_bytes(served) <= capacity)
        assert not failures  # the writes waited for the new sweeper, none was refused
