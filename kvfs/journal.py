"""The share's journals: what every host of a shared backing directory tells the others.

Each ``--shared`` daemon appends to its own ``.kvfs/journal/<host>.log`` and reads everyone
else's from the offset it reached (a tail): from all of them it knows the share's usage, the
global recency of every chunk and what went (docs/research/fleet-design.md).

Format (version 1), one line per record, ASCII, every line ``<crc32 of the rest, 8 hex> <body>``:

    H 1 <generation> <host>                 first line of a log or snapshot
    P <stamp_ns> <size> <last_read_ns> <path>  published (size in bytes)
    E <stamp_ns> <path>                     evicted or unlinked (the version published <= stamp)
    R <last_read_ns> <hits> <path>          read

Paths are relative to the backing root, percent-encoded (``/`` kept). A writer appends whole
lines, one ``write`` per batch; a reader consumes only up to the last newline, so a torn last
line is read again, whole, later. Any line that fails its checksum or its syntax, names a path
outside the tree, or carries numbers out of range is skipped and counted, never trusted.

Compaction: past ``COMPACT_BYTES`` a host writes ``<host>.snap`` (its live publishes and its
reads, the same line format, header generation g+1) by temp file + rename, then starts a new
``<host>.log`` with header g+1 the same way. A reader that holds the old log open drains it,
then follows the new one; a reader starting afresh reads the snapshot whose generation matches
the log's, then the log (a snapshot of another generation is ignored: the log is complete).

Everything here blocks on the filesystem (the daemon runs it in its I/O pool) or is pure.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import os
import stat
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import quote_from_bytes, unquote_to_bytes

from kvfs import layout
from kvfs.buffers import on_disk

VERSION = 1
JOURNAL_DIR = layout.PRIVATE_DIR + b"/journal"
MAX_LINE = 8192  # bytes, newline included: a longer line is skipped
MAX_PATH = 4096
MAX_SIZE = 1 << 50  # a chunk larger than a pebibyte is a lie
MAX_READ = 4 << 20  # bytes a reader takes from one journal per poll
COMPACT_BYTES = 16 << 20  # a log past this is compacted
MAX_SNAPSHOT = 1 << 30  # a snapshot is read up to this size (hostile: no further)
TOMBSTONES = 1 << 16  # evictions remembered, so that a late publish of a gone version is ignored


@dataclass(frozen=True, slots=True)
class Record:
    op: str  # "H", "P", "E" or "R"
    path: bytes = b""
    stamp: int = 0  # P, E: when (ns since the epoch); R: the last read; H: the generation
    size: int = 0  # P: bytes; R: hits
    last_read: int = 0  # P only
    host: str = ""  # H only


def log_name(host: str) -> bytes:
    return b"%s/%s.log" % (JOURNAL_DIR, host.encode())


def snap_name(host: str) -> bytes:
    return b"%s/%s.snap" % (JOURNAL_DIR, host.encode())


def host_of(name: bytes) -> str | None:
    """The host whose log a journal directory entry is (None: not a log)."""
    if not name.endswith(b".log"):
        return None
    host = name[:-4]
    ok = 0 < len(host) <= 64 and all(c in b"-_" or chr(c).isalnum() for c in host)
    return host.decode() if ok and host.isascii() else None


# -- lines -----------------------------------------------------------------------------------


def _line(body: str) -> bytes:
    data = body.encode()
    return b"%08x %s\n" % (zlib.crc32(data), data)


def _quote(path: bytes) -> str:
    return quote_from_bytes(path, safe="/")


def header(generation: int, host: str) -> bytes:
    return _line(f"H {VERSION} {generation} {host}")


def published(path: bytes, stamp: int, size: int, last_read: int) -> bytes:
    return _line(f"P {stamp} {size} {last_read} {_quote(path)}")


def evicted(path: bytes, stamp: int) -> bytes:
    return _line(f"E {stamp} {_quote(path)}")


def read(path: bytes, last_read: int, hits: int) -> bytes:
    return _line(f"R {last_read} {hits} {_quote(path)}")


def valid_path(path: bytes) -> bool:
    """A chunk's place in the tree: relative, no ``.``/``..``/empty parts, not .kvfs/."""
    if not path or len(path) > MAX_PATH or b"\0" in path or path.startswith(b"/"):
        return False
    parts = path.split(b"/")
    if parts[0] == layout.PRIVATE_DIR:
        return False
    return all(part not in (b"", b".", b"..") and len(part) <= layout.NAME_MAX for part in parts)


def _number(text: str, limit: int) -> int:
    if not text.isdigit() or len(text) > 20:  # no sign, no spaces, no underscores
        raise ValueError(text)
    value = int(text)
    if value > limit:
        raise ValueError(text)
    return value


NS_MAX = 1 << 63


def parse(line: bytes) -> Record | None:
    """One line (without its newline), or None if it is not a valid record."""
    try:
        crc, _, body = line.partition(b" ")
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        fields = body.decode("ascii").split(" ")
        op = fields[0]
        if op == "H" and len(fields) == 4:
            host = fields[3]
            if _number(fields[1], 1 << 16) < 1 or host_of(host.encode() + b".log") != host:
                return None
            return Record("H", stamp=_number(fields[2], NS_MAX), size=int(fields[1]), host=host)
        if op == "P" and len(fields) == 5:
            path = unquote_to_bytes(fields[4])
            stamp, size = _number(fields[1], NS_MAX), _number(fields[2], MAX_SIZE)
            last = _number(fields[3], NS_MAX)
            return Record("P", path, stamp, size, last) if valid_path(path) else None
        if op == "E" and len(fields) == 3:
            path = unquote_to_bytes(fields[2])
            return Record("E", path, _number(fields[1], NS_MAX)) if valid_path(path) else None
        if op == "R" and len(fields) == 4:
            path = unquote_to_bytes(fields[3])
            stamp, hits = _number(fields[1], NS_MAX), _number(fields[2], NS_MAX)
            return Record("R", path, stamp, hits) if valid_path(path) else None
    except (ValueError, UnicodeDecodeError):
        pass
    return None


def split(data: bytes) -> tuple[list[bytes], int]:
    """Whole lines of ``data`` and how many bytes they took (a torn last line stays)."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], end


# -- the view --------------------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    size: int
    stamp: int  # when the version was published
    last_read: int
    hits: int
    owner: str  # the host whose publish it is
    reader: str  # the host whose read set last_read
    seq: int = 0  # of its current place in the eviction heap


@dataclass
class View:
    """The share as the journals tell it: live paths, their sizes and global recency."""

    entries: dict[bytes, Entry] = field(default_factory=dict)
    tombstones: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    used: int = 0  # sum of on_disk(size): what counts against the capacity
    _heap: list[tuple[int, int, bytes]] = field(default_factory=list)
    _seq: int = 0

    def apply(self, host: str, rec: Record, latest: int | None = None) -> bool:
        """Apply one record from ``host``; True if the share changed (an E: a path went).

        ``latest``: no time in another host's record counts as later than this (a lie or a
        clock far ahead must not make a chunk the newest for ever, nor outlive every E)."""
        if latest is not None and max(rec.stamp, rec.last_read) > latest:
            rec = Record(
                rec.op, rec.path, min(rec.stamp, latest), rec.size, min(rec.last_read, latest)
            )
        if rec.op == "P":
            return self._publish(host, rec)
        if rec.op == "E":
            return self.remove(rec.path, rec.stamp)
        if rec.op == "R":
            entry = self.entries.get(rec.path)
            if entry is not None and rec.stamp > entry.last_read:
                entry.last_read, entry.reader = rec.stamp, host
                entry.hits = max(entry.hits, rec.size)
                self._push(rec.path, entry)
        return False

    def _publish(self, host: str, rec: Record) -> bool:
        gone = self.tombstones.get(rec.path)
        if gone is not None and gone >= rec.stamp:  # a version already evicted
            return False
        entry = self.entries.get(rec.path)
        if entry is not None and entry.stamp > rec.stamp:  # a newer version is known
            return False
        if entry is None:
            entry = self.entries[rec.path] = Entry(rec.size, rec.stamp, 0, 0, host, host)
        else:
            self.used -= on_disk(entry.size)
        self.used += on_disk(rec.size)
        entry.size, entry.stamp, entry.owner = rec.size, rec.stamp, host
        if rec.last_read > entry.last_read:
            entry.last_read, entry.reader = rec.last_read, host
        self._push(rec.path, entry)
        return True

    def remove(self, path: bytes, stamp: int) -> bool:
        """The version of ``path`` published at or before ``stamp`` went."""
        old = self.tombstones.pop(path, None)
        self.tombstones[path] = max(stamp, old or 0)
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)
        entry = self.entries.get(path)
        if entry is None or entry.stamp > stamp:
            return False
        del self.entries[path]
        self.used -= on_disk(entry.size)
        return True

    def _push(self, path: bytes, entry: Entry) -> None:
        self._seq += 1
        entry.seq = self._seq
        heapq.heappush(self._heap, (entry.last_read, self._seq, path))
        if len(self._heap) > 4 * len(self.entries) + 1024:  # drop what is no longer current
            self._heap = [(e.last_read, e.seq, p) for p, e in self.entries.items()]
            heapq.heapify(self._heap)

    def pop_oldest(self) -> bytes | None:
        """The least recently read live path, taken out of the order (``requeue`` puts it
        back if it cannot go); None if the order is empty."""
        while self._heap:
            _, seq, path = heapq.heappop(self._heap)
            entry = self.entries.get(path)
            if entry is not None and entry.seq == seq:
                return path
        return None

    def requeue(self, path: bytes) -> None:
        entry = self.entries.get(path)
        if entry is not None:
            self._push(path, entry)

    def snapshot(self, host: str) -> Iterator[bytes]:
        """``host``'s share of the view as lines: its live publishes, and its reads."""
        for path, entry in self.entries.items():
            if entry.owner == host:
                yield published(path, entry.stamp, entry.size, entry.last_read)
            elif entry.reader == host:
                yield read(path, entry.last_read, entry.hits)


# -- the files -------------------------------------------------------------------------------


def open_regular(path: bytes) -> int | None:
    """Open a file in the share for reading, only if it is a regular file: a symlink, fifo or
    device planted under a journal's name would point the reader elsewhere or block it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symlink
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _read_all(path: bytes, limit: int) -> bytes | None:
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        chunks, size = [], 0
        while size < limit and (data := os.read(fd, min(1 << 20, limit - size))):
            chunks.append(data)
            size += len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _replace(root: bytes, rel: bytes, data: bytes) -> None:
    """Write ``data`` to ``rel`` whole, atomically (temp file, fsync, rename)."""
    tmp = b"%s.%s.tmp" % (rel, os.urandom(6).hex().encode())
    fd = os.open(
        os.path.join(root, tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
    )
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(os.path.join(root, tmp), os.path.join(root, rel))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Writer:
    """This host's own log: resumed at a restart, appended in batches, compacted."""

    def __init__(self, root: bytes, host: str) -> None:
        self.root, self.host = root, host
        self.path = os.path.join(root, log_name(host))
        self.generation = 0
        self.size = 0
        self.fd = -1

    def open(self) -> None:
        """Resume the log (a torn last line is ended, so readers skip it), or start one."""
        directory = os.path.join(self.root, JOURNAL_DIR)
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):  # temp files a crash left in a compaction
            if name.startswith(self.host.encode() + b".") and name.endswith(b".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
        first = b""
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            self.generation = 1
            _replace(self.root, log_name(self.host), header(1, self.host))
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        else:
            first = os.pread(self.fd, MAX_LINE, 0).split(b"\n", 1)[0]
            head = parse(first)
            self.generation = head.stamp if head is not None and head.op == "H" else 0
        self.size = os.fstat(self.fd).st_size
        if self.size and os.pread(self.fd, 1, self.size - 1) != b"\n":
            _write_all(self.fd, b"\n")
            self.size += 1
        if self.generation == 0:  # no valid header: start over (the lines are unreadable)
            self.compact([])

    def append(self, data: bytes) -> None:
        """One batch of whole lines, in one write (O_APPEND)."""
        _write_all(self.fd, data)
        self.size += len(data)

    def compact(self, lines: Iterable[bytes]) -> None:
        """Snapshot ``lines`` as generation g+1 and start the log g+1 (each by rename: a crash
        between them leaves the log g whole, and readers ignore the snapshot g+1)."""
        generation = self.generation + 1
        snapshot = header(generation, self.host) + b"".join(lines)
        _replace(self.root, snap_name(self.host), snapshot)
        _replace(self.root, log_name(self.host), header(generation, self.host))
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd, self.generation = fd, generation
        self.size = os.fstat(fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Tail:
    """Where this host is in another host's journal."""

    host: str
    fd: int = -1
    ino: int = 0
    offset: int = 0
    generation: int = 0
    skipped: int = 0  # lines that failed their checksum or syntax
    lines: int = 0  # records read
    size: int = 0  # of the log, at the last poll

    def poll(self, root: bytes) -> list[Record]:
        """New records: the snapshot first for a fresh start, then the log from the offset;
        a log replaced by compaction is drained first, then followed."""
        records: list[Record] = []
        path = os.path.join(root, log_name(self.host))
        if self.fd < 0 and not self._open(root, path, records, fresh=True):
            return records
        self._drain(records)
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # removed (a host gone for good): let its space go
            self.close()
            return records
        if st.st_ino != self.ino:  # compacted: the old log was drained above
            after = self.generation
            self.close()
            if self._open(root, path, records, fresh=False, after=after):
                self._drain(records)
        return records

    def _open(
        self, root: bytes, path: bytes, records: list[Record], fresh: bool, after: int = 0
    ) -> bool:
        fd = open_regular(path)
        if fd is None:
            return False
        self.fd, self.ino, self.offset = fd, os.fstat(fd).st_ino, 0
        first = os.pread(fd, MAX_LINE, 0)
        if b"\n" not in first:  # its header is still being written (or hostile): later
            self.close()
            return False
        line = first.split(b"\n", 1)[0]
        head = parse(line)
        self.offset = len(line) + 1
        if head is None or head.op != "H" or head.host != self.host:
            self.skipped += 1
            self.generation = 0
            return True
        self.generation = head.stamp
        if fresh or head.stamp != after + 1:  # we know nothing of its earlier generations
            self._snapshot(root, records)
        return True

    def _snapshot(self, root: bytes, records: list[Record]) -> None:
        data = _read_all(os.path.join(root, snap_name(self.host)), MAX_SNAPSHOT)
        if not data:
            return
        lines, _ = split(data)
        head = parse(lines[0]) if lines else None
        if head is None or head.op != "H" or head.stamp != self.generation:
            return  # another generation's: the log is complete without it
        self._parse(lines[1:], records)

    def _drain(self, records: list[Record]) -> None:
        while True:
            data = os.pread(self.fd, MAX_READ, self.offset)
            if not data:
                break
            lines, used = split(data)
            if not lines and len(data) >= MAX_LINE:  # one endless line: skip what came
                self.skipped += 1
                used = len(data)
            self._parse(lines, records)
            self.offset += used
            if used == 0 or len(data) < MAX_READ:
                break
        self.size = max(self.offset, os.fstat(self.fd).st_size)

    def _parse(self, lines: list[bytes], records: list[Record]) -> None:
        for line in lines:
            rec = parse(line) if len(line) < MAX_LINE else None
            if rec is None or rec.op == "H":
                self.skipped += 1
            else:
                records.append(rec)
                self.lines += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def directory_stamp(root: bytes) -> tuple[int, int] | None:
    """What changes when a journal appears in the journal directory (its inode and mtime):
    one stat, where listing it costs a readdir (a round trip per page on a network share)."""
    try:
        st = os.stat(os.path.join(root, JOURNAL_DIR))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def hosts(root: bytes) -> list[str]:
    """Every host with a log in the share's journal directory."""
    try:
        names = os.listdir(os.path.join(root, JOURNAL_DIR))
    except FileNotFoundError:
        return []
    return sorted(h for name in names if (h := host_of(name)) is not None)
