"""One capacity and one eviction order for a shared backing directory (``--shared``).

Every host journals what it publishes, removes and reads (kvfs/journal.py) and tails the other
hosts' journals; from them it keeps a view of the whole share: its usage, the global recency
of every chunk, what went. The host that holds the sweep lease (kvfs/lease.py) evicts the
globally least recently read unpinned chunks while the share is over its high watermark, down
to the low one, journaling each eviction; the others see those as misses, and drop the nodes
(and kept passthrough backing files) of chunks the journals say went.

The bound. Publishes are admitted while the share (as this host sees it, having just read the
others' journals) stays under the high watermark (95 %); the rest of the capacity is the room
for what other hosts admitted and this host cannot know of yet (admitted and not published, or
published and not journaled): each host keeps that within its part of the room left under the
high watermark (the room over the number of hosts), and at least UNJOURNALED (1 % of the
capacity); past it, its publishes wait for the ones before them and for the journal write. The
lease holder evicts for its own publishes there and then, and sweeps from SWEEP_AT (92.5 %)
down to the low watermark (90 %); another host waits (within half the deadline) for the
holder's evictions to reach it, else the publish fails with ENOSPC.

Every journal and lease operation runs in the I/O pool; the loops that wait on them never hold
up a request (a request waits on them only through ``admit``, within its deadline).
Design and its bounds: docs/research/fleet-design.md.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from kvfs import journal, vllm_layout
from kvfs.buffers import on_disk
from kvfs.index import Node
from kvfs.io_queues import Queue
from kvfs.journal import Record
from kvfs.lease import Lease
from kvfs.mount.eviction import HIGH_WATERMARK, LOW_WATERMARK, EvictionReason
from kvfs.store import PINNED_XATTR

if TYPE_CHECKING:
    from kvfs.mount.objects import Objects

log = logging.getLogger(__name__)
T = TypeVar("T")

FLUSH_SECONDS = 1.0  # the journal is written once a second (like recency)
# ... and at once when unwritten publishes pass this share of the capacity, or the share is
# past its low watermark
TAIL_SECONDS = 0.2  # the other hosts' journals are read this often
# The journal directory is listed for new hosts at every read when its mtime changed, and this
# often in any case (a filesystem with coarse mtimes may not show a second new journal).
DISCOVER_SECONDS = 1.0
SWEEP_SECONDS = 0.5  # the lease holder looks at the share's usage this often
# Publishes are admitted up to the high watermark: the rest of the capacity is the room for
# what the other hosts publish meanwhile (unseen until their journals are read). The sweeper
# starts halfway between the watermarks, so that every publish waiting for room gets it.
SWEEP_AT = (LOW_WATERMARK + HIGH_WATERMARK) / 2
# What one host may have admitted or published and not yet journaled: its part of the room
# left under the high watermark, and at least this share of the capacity; past it the journal
# is written at once and publishes wait.
UNJOURNALED = 0.01
CLOCK_AHEAD = 60.0  # seconds another host's records may be ahead of our clock (else clamped)


class Share:
    """This host's part in a shared backing directory; built (blocking) at mount."""

    def __init__(self, objects: Objects, ttl: float) -> None:
        store = objects.store
        assert store.host is not None
        self.objects = objects
        self.index = objects.index
        self.host: str = store.host
        self.root = store.root
        self.view = journal.View()
        self.writer = journal.Writer(self.root, self.host)
        self.lease = Lease(self.root, self.host, store.tmp_dir, ttl)
        self.tails: dict[str, journal.Tail] = {}
        self._journals_seen: tuple[int, int] | None = None  # the directory as last listed
        self.pending: list[bytes] = []
        self.pending_published = 0  # bytes of the pending P lines
        self.flushing = 0  # bytes of the P lines being written
        self.phantoms = 0  # paths the journals said were there and were not
        self.dropped = 0  # nodes dropped because the journals said their chunk went
        self.swept = 0  # chunks this host evicted as the share's sweeper
        self.admission_waits = 0  # publishes that waited for the sweeper's evictions
        self.stalls = 0  # journal or lease operations that outlived the deadline
        self.write_failures = 0
        self.own_skipped = 0  # lines of our own journal skipped at mount
        self.last_tail = time.monotonic()
        self._stamp = 0
        # Set (and replaced) when what they name happens; made before _load(), which may
        # already remove entries (a trio.Event needs no running loop).
        self.changed = trio.Event()  # a chunk went, or this host took the lease
        self._flush_wanted = trio.Event()
        self._progress = trio.Event()  # a journal write or a publish completed
        self._tail_wanted = trio.Event()
        self._sweep_wanted = trio.Event()
        self._load()
        self._tail_lock: trio.Lock

    @property
    def used(self) -> int:
        return self.view.used

    def holding(self) -> bool:
        return self.lease.holding()

    # -- at mount (blocking) ----------------------------------------------------------------

    def _load(self) -> None:
        """Read every journal (ours too, from its snapshot), resume ours, and square the view
        with what the scan found: files nobody journaled are journaled now; paths journaled
        that are not there (published after the scan and removed again, or lies) go."""
        for host in journal.hosts(self.root):
            tail = journal.Tail(host)
            latest = time.time_ns() + int(CLOCK_AHEAD * 1e9)
            for rec in tail.poll(self.root):
                self.view.apply(host, rec, latest)
            if host == self.host:
                self.own_skipped = tail.skipped
                tail.close()
            else:
                self.tails[host] = tail
        self.writer.open()
        files = {self.index.path(n): n for n in self.index.walk_files() if n.on_backing}
        for path, entry in list(self.view.entries.items()):
            if path not in files and not self._exists(path):  # its E was lost (a crash)
                self.removed(path, entry.stamp)  # that version went: the others hear it too
                self.phantoms += 1
        for path, node in files.items():
            if path not in self.view.entries and not node.links:
                self.published(path, node.size, node.last_read_ns)
        log.info(
            "share: %d hosts' journals, %d files, %d bytes used; %d lines skipped",
            len(self.tails) + 1,
            len(self.view.entries),
            self.view.used,
            self.skipped,
        )

    def _exists(self, rel: bytes) -> bool:
        try:
            return stat.S_ISREG(os.lstat(os.path.join(self.root, rel)).st_mode)
        except OSError:
            return False

    # -- what this host did (on the loop) ----------------------------------------------------

    @property
    def unjournaled(self) -> int:
        """Bytes this host published that its journal does not hold yet."""
        return self.pending_published + self.flushing

    def _now(self) -> int:
        """A stamp for a record: the wall clock, strictly increasing at this host (an E and
        the P that follows it in one rename must not share a stamp)."""
        self._stamp = max(time.time_ns(), self._stamp + 1)
        return self._stamp

    def published(self, rel: bytes, size: int, last_read: int | None = None) -> None:
        now = self._now()
        last = now if last_read is None else last_read
        self.view.apply(self.host, Record("P", rel, now, size, last))
        self._append(journal.published(rel, now, size, last))
        self.pending_published += on_disk(size)
        capacity = self.objects.evictor.capacity
        if (
            self.pending_published >= UNJOURNALED * capacity
            or self.view.used > LOW_WATERMARK * capacity
        ):  # near the bound, the others must hear of it now
            self._flush_soon()
        if self.view.used > SWEEP_AT * capacity:
            self._sweep_wanted.set()

    def removed(self, rel: bytes, stamp: int | None = None) -> None:
        stamp = self._now() if stamp is None else stamp
        self.view.remove(rel, stamp)
        self._append(journal.evicted(rel, stamp))
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Publishes waiting for room look again (a chunk went, or this host took the lease)."""
        self.changed.set()
        self.changed = trio.Event()

    def forget(self, rel: bytes) -> None:
        """Another host removed it (an open found it gone): out of the view, not journaled."""
        entry = self.view.entries.get(rel)
        if entry is not None:
            self.view.remove(rel, entry.stamp)

    def reads(self, reads: list[tuple[bytes, int, int]]) -> None:
        for rel, last_read, hits in reads:
            if rel in self.view.entries:
                self.view.apply(self.host, Record("R", rel, last_read, hits))
                self._append(journal.read(rel, last_read, hits))

    def moved(self, moves: list[tuple[bytes, bytes, Node]]) -> None:
        """Published files renamed (old path, new path, node)."""
        for old, new, node in moves:
            self.removed(old)
            self.published(new, node.size, node.last_read_ns)

    def _append(self, line: bytes) -> None:
        self.pending.append(line)

    def _flush_soon(self) -> None:
        self._flush_wanted.set()

    # -- the loops ---------------------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        self._tail_lock = trio.Lock()
        nursery.start_soon(self.flush_forever)
        nursery.start_soon(self.tail_forever)
        nursery.start_soon(self.lease_forever)
        nursery.start_soon(self.sweep_forever)

    async def _io(self, queue: Queue, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on the I/O pool; past the deadline it is counted and logged, and waited for
        still (the loops keep their order; no request waits here)."""
        future = self.objects.io.submit(queue, fn, *args)
        with trio.move_on_after(self.objects.cfg.io_timeout):
            return await future.wait()
        self.stalls += 1
        log.warning("share: %s outlived %.1fs", what, self.objects.cfg.io_timeout)
        return await future.wait()

    async def flush_forever(self) -> None:
        """Write the pending journal lines: once a second, or at once when asked."""
        while True:
            with trio.move_on_after(FLUSH_SECONDS):
                await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        batch, published = b"".join(self.pending), self.pending_published
        self.pending, self.pending_published = [], 0
        self.flushing += published
        try:
            # The read queue: a small write that must not wait behind chunks being written
            await self._io(Queue.READ, "journal write", self.writer.append, batch)
        except OSError as err:
            self.write_failures += 1
            log.warning("share: journal write failed (%s): retried with the next batch", err)
            self.pending.insert(0, batch)
            self.pending_published += published
            return
        finally:
            self.flushing -= published
            self._wake_progress()
        if self.writer.size > journal.COMPACT_BYTES:
            lines = list(self.view.snapshot(self.host))
            try:
                await self._io(Queue.WRITE, "journal compaction", self.writer.compact, lines)
            except OSError as err:
                log.warning("share: journal compaction failed: %s", err)

    async def tail_forever(self) -> None:
        looked = 0.0
        while True:
            with trio.move_on_after(TAIL_SECONDS):
                await self._tail_wanted.wait()
            self._tail_wanted = trio.Event()
            discover = time.monotonic() - looked >= DISCOVER_SECONDS
            looked = time.monotonic() if discover else looked
            try:
                await self.refresh(discover)
            except OSError as err:
                log.warning("share: reading the journals failed: %s", err)

    async def refresh(self, discover: bool = False) -> None:
        """Read what the other hosts journaled since the last time, and apply it;
        ``discover``: look for new hosts' journals first."""
        async with self._tail_lock:
            found = await self._io(Queue.READ, "journal read", self._poll, discover)
            gone: list[bytes] = []
            changed = False
            latest = time.time_ns() + int(CLOCK_AHEAD * 1e9)
            for host, records in found:
                for rec in records:
                    if self.view.apply(host, rec, latest) or rec.op == "E":
                        changed = True
                        if rec.op == "E" and rec.path not in self.view.entries:
                            gone.append(rec.path)
            self.last_tail = time.monotonic()
            if gone:
                await self._drop_local(gone)
            if changed:
                self._wake_waiters()
                if self.view.used > SWEEP_AT * self.objects.evictor.capacity:
                    self._sweep_wanted.set()

    def _poll(self, discover: bool) -> list[tuple[str, list[Record]]]:
        """On the pool: new hosts' journals found, and every tail read on. A host that joins
        while the others write must count at once: until they know of it, what it publishes
        is room none of them keeps."""
        stamp = journal.directory_stamp(self.root)
        if stamp != self._journals_seen:
            discover, self._journals_seen = True, stamp
        for host in journal.hosts(self.root) if discover else ():
            if host != self.host and host not in self.tails:
                self.tails[host] = journal.Tail(host)
        return [(host, tail.poll(self.root)) for host, tail in list(self.tails.items())]

    async def _drop_local(self, paths: list[bytes]) -> None:
        """Chunks the journals say went: out of the index (and the kernel's caches, and the
        kept passthrough backing files)."""
        objects = self.objects
        async with objects._ns:
            dropped = []
            for rel in paths:
                node = self.lookup(rel)
                if (
                    node is None
                    or not node.is_file
                    or not node.on_backing
                    or node.links
                    or node.ino in objects.writes
                ):
                    continue
                dropped.append((objects._take_out(node), node))
                self.dropped += 1
        for parent, node in dropped:
            objects.listener.name_gone(parent, node.name, node)

    def lookup(self, rel: bytes) -> Node | None:
        node: Node | None = self.index.root
        for part in rel.split(b"/"):
            if node is None or node.children is None:
                return None
            node = node.children.get(part)
        return node

    async def lease_forever(self) -> None:
        """Take the lease, or renew it, every TTL/3."""
        period = self.lease.ttl / 3
        while True:
            was = self.lease.holding()
            try:
                held = await self._io(Queue.READ, "sweep lease", self.lease.step)
            except OSError as err:
                log.warning("share: sweep lease: %s", err)
                held = False
            if held and not was:
                log.info("share: this host took the sweep lease")
                self._sweep_wanted.set()
                self._wake_waiters()
            elif was and not held:
                log.warning("share: this host lost the sweep lease (now %s)", self.lease.holder)
            await trio.sleep(period)

    async def sweep_forever(self) -> None:
        """As the lease holder: from the high watermark down to the low one, globally oldest
        unpinned chunks first."""
        evictor = self.objects.evictor
        while True:
            with trio.move_on_after(SWEEP_SECONDS):
                await self._sweep_wanted.wait()
            self._sweep_wanted = trio.Event()
            if not self.lease.holding() or self.view.used <= SWEEP_AT * evictor.capacity:
                continue
            try:
                await self.refresh()
                before, count = self.view.used, 0
                while (
                    self.lease.holding()
                    and self.view.used > LOW_WATERMARK * evictor.capacity
                    and await self.evict_oldest(EvictionReason.WATERMARK)
                ):
                    count += 1
            except OSError as err:
                log.warning("share: sweep stopped: %s", err)
                continue
            if count:
                self._flush_soon()
                log.info(
                    "share: sweep evicted %d files, %d bytes; %d of %d bytes used",
                    count,
                    before - self.view.used,
                    self.view.used,
                    evictor.capacity,
                )

    # -- eviction and admission --------------------------------------------------------------

    async def evict_oldest(self, reason: EvictionReason) -> bool:
        """Evict the globally least recently read chunk that may go; False if none can."""
        deferred: list[bytes] = []
        try:
            while True:
                path = self.view.pop_oldest()
                if path is None:
                    return False
                if await self._evict_path(path, reason):
                    return True
                deferred.append(path)
        finally:
            for path in deferred:
                self.view.requeue(path)

    async def _evict_path(self, rel: bytes, reason: EvictionReason) -> bool:
        entry = self.view.entries.get(rel)
        if entry is None:
            return False
        node = self.lookup(rel)
        if node is not None and (not node.is_file or self.objects.busy(node)):
            return False
        what = await self.objects.io.read(_state, self.root, rel)
        if rel not in self.view.entries or self.view.entries[rel] is not entry:
            return False  # changed while we looked
        if what == "missing":  # gone already (a lie, or removed around the mount)
            self.phantoms += 1
            self.removed(rel, entry.stamp)
            return True
        if what == "kept" or (node is None and _is_config(rel)):
            return False
        size = entry.size
        if node is not None:
            if not await self.objects.evict(node, reason):  # journals the E
                return False
        else:
            await self.objects.io.read(self.objects.store.discard, rel)
            self.removed(rel)
        self.swept += 1
        self.objects.evictor.evicted(reason, size)
        self._flush_soon()  # the hosts waiting for room hear of it at once
        return True

    def _may_admit(self, need: int) -> bool:
        evictor = self.objects.evictor
        unseen = evictor.reserved + self.unjournaled
        if not unseen:
            return True
        room = HIGH_WATERMARK * evictor.capacity - self.view.used - evictor.reserved
        allowance = max(UNJOURNALED * evictor.capacity, room / (len(self.tails) + 1))
        return unseen + need <= allowance

    def released(self) -> None:
        """A publish admitted here completed (or was dropped): its room is no longer unseen."""
        self._wake_progress()

    def _wake_progress(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def admit(self, need: int) -> None:
        """Room for a publish of ``need`` bytes (on disk) under the share's high watermark
        (the rest of the capacity is the room for what other hosts publish meanwhile, which
        this host hears of only through their journals): the lease holder evicts for it,
        another host waits for the holder's evictions (ENOSPC if they do not come within half
        the deadline)."""
        evictor = self.objects.evictor

        def over() -> bool:
            used = self.view.used + evictor.reserved
            if used + need <= HIGH_WATERMARK * evictor.capacity:
                return False
            # A chunk too large for the room under the high watermark still goes in while
            # the share is below where the sweeper starts (it would not make more room).
            return self.lease.holding() or used > SWEEP_AT * evictor.capacity

        deadline = trio.current_time() + self.objects.cfg.io_timeout / 2
        # What the others cannot know of yet (admitted and not published, published and not
        # journaled) stays within this host's part of the room left, at least 1 % of the
        # capacity: past it, a publish waits for the publishes before it and the journal.
        while not self._may_admit(need):
            progress = self._progress
            self._flush_soon()
            with trio.move_on_at(deadline):
                await progress.wait()
            if trio.current_time() >= deadline:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        await self.refresh()  # what the others published up to now: no lag at the bound
        waited = False
        while over():
            if self.lease.holding():
                if not await self.evict_oldest(EvictionReason.CAPACITY):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                continue
            if not waited:
                self.admission_waits += 1
                waited = True
            changed = self.changed
            self._tail_wanted.set()
            with trio.move_on_at(deadline):
                await changed.wait()
            if trio.current_time() >= deadline and over():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # -- the end, and the report -------------------------------------------------------------

    def shutdown(self) -> None:
        """Queue the last journal lines and the lease's release (the pool runs them before it
        stops), then close the journal."""
        batch = b"".join(self.pending)
        self.pending = []
        writer, lease = self.writer, self.lease

        def last() -> None:
            try:
                if batch:
                    writer.append(batch)
                lease.release()
            finally:
                writer.close()
                for tail in self.tails.values():
                    tail.close()

        self.objects.pool.submit(Queue.WRITE, last, _log_failure)

    @property
    def skipped(self) -> int:
        return self.own_skipped + sum(t.skipped for t in self.tails.values())

    def report(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "used": self.view.used,
            "files": len(self.view.entries),
            "lease_holder": self.lease.holding(),
            "holder": self.lease.holder,
            "lease_ttl": self.lease.ttl,
            "leases_taken": self.lease.taken,
            "leases_broken": self.lease.broken,
            "leases_lost": self.lease.lost,
            "journal_lag_seconds": round(time.monotonic() - self.last_tail, 3),
            "skipped_lines": self.skipped,
            "journal_bytes": self.writer.size,
            "journal_generation": self.writer.generation,
            "pending_lines": len(self.pending),
            "phantoms": self.phantoms,
            "dropped": self.dropped,
            "swept": self.swept,
            "admission_waits": self.admission_waits,
            "stalls": self.stalls,
            "write_failures": self.write_failures,
            "hosts": {
                host: {
                    "offset": t.offset,
                    "size": t.size,
                    "generation": t.generation,
                    "lines": t.lines,
                    "skipped": t.skipped,
                }
                for host, t in self.tails.items()
            },
        }


def _log_failure(_: object, error: BaseException | None) -> None:
    if error is not None:
        log.warning("share: last journal write failed: %s", error)


def _is_config(rel: bytes) -> bool:
    return rel.count(b"/") == 1 and rel.endswith(b"/" + vllm_layout.CONFIG_NAME)


def _state(root: bytes, rel: bytes) -> str:
    """On the pool: "missing", "kept" (not a lone regular file, or pinned, itself or a
    directory above it) or "evictable"."""
    path = os.path.join(root, rel)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        return "kept"
    parts = rel.split(b"/")
    for depth in range(len(parts), 0, -1):
        try:
            if os.getxattr(os.path.join(root, *parts[:depth]), PINNED_XATTR) == b"1":
                return "kept"
        except OSError:
            pass
    return "evictable"
