"""One chunk file, written and read the way vLLM's fs tier does, so a kvfs mount (or any
directory) sees one open, one I/O and one close per chunk, and a name appears only complete.

store: exists? -> O_CREAT|O_EXCL temp ``<name>_<u63>.tmp`` (mkdir -p only where the directory
is missing) -> one write -> close -> rename over the final name. No fsync: a cache may lose
chunks, never serve partial ones.
load: open -> the size (a seek to the end) must be the chunk size -> one preadv into the
caller's buffer.

Both run in C where the package was built with it (``kvfs/_chunk_calls.c``): a store's
exists-create-write-close-rename and a load's four calls each let the GIL go once, not four times;
the same calls in Python otherwise (``_store_calls``, ``_load_calls``: the reference).

O_DIRECT needs page-aligned buffers and sizes (the host region's slots are); ``probe_o_direct``
tells once whether a directory takes it, as vLLM probes at start.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

from kvfs import checksum, vllm_layout

O_DIRECT = getattr(os, "O_DIRECT", 0)


class ChunkError(OSError):
    """A chunk file cannot be stored or loaded; the store or load changed nothing."""


def store(
    path: str,
    data: memoryview | bytes | mmap.mmap,
    o_direct: bool = False,
    declare: bool = False,
) -> bool:
    """Publish ``data`` under ``path``; False if a chunk was already there (content-addressed:
    it holds the same bytes). ``declare``: set the bytes' checksum (``kvfs.checksum``) on the
    file before its close, so that a kvfs mount keeps it rather than read the bytes back from
    its disk (a filesystem that refuses the attribute: stored without it)."""
    tmp = vllm_layout.temp_name(path)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | (O_DIRECT if o_direct else 0)
    try:
        written = _store(tmp, path, data, flags, 0o644, declare)
        if written is None:
            # mkdir -p only for a new directory: on a FUSE mount a mkdir of one that is there
            # still costs a LOOKUP round trip (the kernel revalidates every name it creates).
            _make_dirs(os.path.dirname(tmp))
            written = _store(tmp, path, data, flags, 0o644, declare)
            if written is None:  # removed again meanwhile
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), tmp)
    except FileExistsError as err:
        if err.filename != path:  # the temp name (a 63-bit draw) was taken: not stored
            raise
        return False
    if written != len(data):
        raise ChunkError(f"short write of {path}: {written} of {len(data)} bytes")
    return True


def store_blocks(
    paths: list[str],
    buffer: memoryview,
    offsets: list[int],
    block_size: int,
    o_direct: bool = False,
    declare: bool = False,
) -> int:
    """``store`` of ``buffer[offset : offset + block_size]`` under each path in turn, as vLLM's
    fs tier stores a job's blocks from its host region; the first failure raises (the blocks
    before it stay stored). The number stored (those already there are not). ValueError, and
    nothing stored, where a block lies outside the buffer."""
    flat = buffer.cast("B")
    if len(paths) != len(offsets):
        raise ValueError(f"{len(paths)} paths for {len(offsets)} blocks")
    if any(offset < 0 or offset + block_size > len(flat) for offset in offsets):
        raise ValueError(f"blocks of {block_size} bytes at {offsets} overrun {len(flat)} bytes")
    stored = 0
    for path, offset in zip(paths, offsets, strict=True):
        stored += store(path, flat[offset : offset + block_size], o_direct, declare)
    return stored


def _store_calls(
    tmp: str,
    path: str,
    data: memoryview | bytes | mmap.mmap,
    flags: int,
    mode: int,
    declare: bool = False,
) -> int | None:
    """FileExistsError naming ``path`` where it is there already; else create ``tmp``
    (``flags`` hold O_EXCL), one write (then, with ``declare``, its checksum set), close,
    rename over ``path``: the bytes written (short: not renamed), or None where the directory
    is missing. The temp file is gone afterwards unless renamed, whatever is raised."""
    if os.path.exists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:
        return None
    renamed = False
    try:
        try:
            written = os.write(fd, data)
            if declare and written == len(data):  # hashed after the write (_chunk_calls.c)
                with contextlib.suppress(OSError):
                    os.setxattr(fd, checksum.XATTR, checksum.checksum(data).encode())
        finally:
            os.close(fd)  # a kvfs mount reports a failed publish here
        if written == len(data):
            # a filesystem that refuses to replace: the chunk is there
            with contextlib.suppress(FileExistsError):
                os.replace(tmp, path)
                renamed = True
        return written
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _make_dirs(directory: str) -> None:
    """mkdir -p that asks only mkdir, from the deepest directory up to the first that is there.
    os.makedirs stats each parent first: on a FUSE mount that is a GETATTR round trip each
    time, since the kernel drops a directory's attributes at every name made in it."""
    try:
        os.mkdir(directory)
    except FileExistsError:  # made meanwhile (or not a directory: the open after says so)
        pass
    except FileNotFoundError:
        parent = os.path.dirname(directory)
        if parent == directory:
            raise
        _make_dirs(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory)


def load_into(path: str, buffer: memoryview | mmap.mmap, o_direct: bool = False) -> None:
    """Read the chunk at ``path`` into ``buffer``, all of it, or raise.

    A file of another size is not a chunk of this configuration (all are one size): a shorter
    one is a torn or truncated file and is removed, as vLLM removes it; a longer one is left.
    """
    size, got = _load(path, buffer, O_DIRECT if o_direct else 0)
    if size != len(buffer):
        if size < len(buffer):
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise ChunkError(f"{path} has {size} bytes, a chunk is {len(buffer)}")
    if got != len(buffer):
        raise ChunkError(f"short read of {path}: {got} of {len(buffer)} bytes")


def _load_calls(path: str, buffer: memoryview | mmap.mmap, flags: int) -> tuple[int, int]:
    """open, the size, and one pread where it is the buffer's: (size, bytes read or -1)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        # The size by seeking, not fstat: on a FUSE mount the read before this one made the
        # kernel's atime stale, and fstat would cost a GETATTR round trip to the daemon.
        size = os.lseek(fd, 0, os.SEEK_END)
        return size, os.preadv(fd, [buffer], 0) if size == len(buffer) else -1
    finally:
        os.close(fd)


# The same calls in C, letting the GIL go once instead of at each: a call that blocks (a FUSE
# round trip) lets another thread of the engine take the GIL, and the I/O thread then waits
# behind it to go on (docs/benchmarks.md, session 13). Built with the package where a C
# compiler is (pyproject.toml); the calls above otherwise.
try:
    from kvfs._chunk_calls import load as _load
    from kvfs._chunk_calls import store as _store
except ImportError:  # pragma: no cover
    _load, _store = _load_calls, _store_calls


def probe_o_direct(directory: str) -> bool:
    """Whether O_DIRECT writes work in ``directory``: one aligned page, written and removed."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, vllm_layout.o_direct_probe_name())
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
