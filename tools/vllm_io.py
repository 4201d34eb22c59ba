"""vLLM 0.33.0's fs-tier I/O pattern, syscall for syscall (DESIGN.md, research/vllm-tiering.md §3).

Written out here so the tests, the demo and the benchmark can drive it with and without
O_DIRECT, from many threads and processes, and check every byte; tests/test_vllm_tier.py drives
vLLM's own code as well.
"""

from __future__ import annotations

import mmap
import os
import random

from kvfs import chunk_io, vllm_layout

# Stores and the O_DIRECT probe are the syscalls kvfs's own fs tier makes too.
store = chunk_io.store
probe_o_direct = chunk_io.probe_o_direct


def aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer, as O_DIRECT needs (vLLM's host region is mmap memory)."""
    return mmap.mmap(-1, size)


def load_into(path: str, buf: mmap.mmap, o_direct: bool = False) -> None:
    """open → one readv of the whole chunk into ``buf`` (vLLM reads into its host region);
    a short read is corruption (vLLM deletes the file)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    try:
        got = os.readv(fd, [buf])
    finally:
        os.close(fd)
    if got != len(buf):
        raise AssertionError(f"short read: {got} of {len(buf)} bytes from {path}")


def load(path: str, size: int, o_direct: bool = False) -> bytes:
    buf = aligned(size)
    load_into(path, buf, o_direct)
    return bytes(buf)


NAMESPACE = "test-model_0123456789ab"  # <model>_<12 hex digest>, as vLLM names a run config


def chunk_path(root: str, key: int, group: int = 0, namespace: str = NAMESPACE) -> str:
    """A path shaped like vLLM's: <root>/<ns>_r0/<hex[:3]>/<hex[3:5]>_g<group>/<hex>.bin."""
    data_dir = vllm_layout.data_dir(namespace, 0)
    return f"{root}/{data_dir}/{vllm_layout.chunk_relpath(f'{key:064x}', group)}"


def chunk_bytes(key: int, size: int) -> bytes:
    """Deterministic bytes for a key, different for every key and every page."""
    return random.Random(key).randbytes(size)


def chunk(key: int, size: int) -> mmap.mmap:
    """``chunk_bytes`` in page-aligned memory, where vLLM keeps a chunk it stores (O_DIRECT
    takes nothing else: from a plain directory, or a mount that passes writes through)."""
    buf = aligned(size)
    buf.write(chunk_bytes(key, size))
    return buf
