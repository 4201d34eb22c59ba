"""vLLM's fs-tier I/O pattern on the mount: byte-exact, buffered and O_DIRECT, concurrent."""

from __future__ import annotations

import multiprocessing
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Mount
from tools import vllm_io

SIZES = [4096, 8192, 64 << 10, 1 << 20, (2 << 20) + 4096, 16 << 20]


def test_o_direct_probe_succeeds_and_leaves_nothing(kv_mount: Mount) -> None:
    probe_dir = kv_mount.path / "probe"
    probe_dir.mkdir()
    assert vllm_io.probe_o_direct(str(probe_dir))
    assert os.listdir(probe_dir) == []
    kv_mount.settle()
    held = kv_mount.backing / "probe"  # (made with the first file published in it, if any)
    assert not held.exists() or os.listdir(held) == []


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("size", SIZES)
def test_store_then_load_is_byte_exact(kv_mount: Mount, size: int, o_direct: bool) -> None:
    key = size * 2 + o_direct
    path = vllm_io.chunk_path(str(kv_mount.path), key)
    data = vllm_io.aligned(size)
    data.write(vllm_io.chunk_bytes(key, size))
    assert vllm_io.store(path, data, o_direct)
    assert not vllm_io.store(path, data, o_direct)  # exists: vLLM never rewrites
    assert vllm_io.load(path, size, o_direct) == bytes(data)
    assert vllm_io.load(path, size, not o_direct) == bytes(data)
    assert kv_mount.on_backing(path).read_bytes() == bytes(data)
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]


def _worker(root: str, seed: int, keys: int, size: int) -> list[str]:
    """16 threads storing and loading overlapping keys; returns every mismatch seen."""
    problems: list[str] = []

    def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        for _ in range(40):
            key = rng.randrange(keys)
            path = vllm_io.chunk_path(root, key)
            expected = vllm_io.chunk_bytes(key, size)
            if rng.random() < 0.5:
                vllm_io.store(path, expected)
            elif os.path.exists(path):
                got = vllm_io.load(path, size)
                if got != expected:
                    problems.append(f"{path}: wrong bytes")

    with ThreadPoolExecutor(16) as pool:
        for future in [pool.submit(one, i) for i in range(16)]:
            future.result()
    return problems


def test_two_processes_of_16_threads_on_overlapping_keys(kv_mount: Mount) -> None:
    root = str(kv_mount.path / "concurrent")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(_worker, [(root, seed, 64, 256 << 10) for seed in (1, 2)])
    assert results == [[], []]
    stored = [k for k in range(64) if os.path.exists(vllm_io.chunk_path(root, k))]
    assert stored, "the workload stored nothing"
    for key in stored:
        assert vllm_io.load(vllm_io.chunk_path(root, key), 256 << 10) == vllm_io.chunk_bytes(
            key, 256 << 10
        )
    assert not [p for p in Path(root).rglob("*.tmp")]


def test_concurrent_direct_stores_into_new_directories_land_whole(fresh_mount: Mount) -> None:
    """16 threads store at once into directories none of them has made yet (their publishes
    share the namespace lock and race to make the same directories on the backing store):
    every chunk lands whole under its name, and a restarted daemon serves each verified."""
    root, size = str(fresh_mount.path), 256 << 10
    keys = [(i << 244) | t for i in range(8) for t in range(16)]  # 16 to each new directory

    def store(key: int) -> bool:
        return vllm_io.store(vllm_io.chunk_path(root, key), vllm_io.chunk(key, size), True)

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(store, keys))
    for key in keys:
        backing = fresh_mount.on_backing(vllm_io.chunk_path(root, key))
        assert backing.read_bytes() == vllm_io.chunk_bytes(key, size)
    assert not [p for p in fresh_mount.backing.rglob("*.tmp")]
    fresh_mount.restart()
    for key in keys:
        assert vllm_io.load(vllm_io.chunk_path(root, key), size) == vllm_io.chunk_bytes(key, size)
