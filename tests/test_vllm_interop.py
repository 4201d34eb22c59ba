"""vLLM 0.33.0's native tiering and kvfs's connector share chunks on one root, both ways.

vLLM (tests/vllm_engine.py: its OffloadingConnector, canonical layout, fs tier) stores a
prompt and kvfs's connector, over the same device tensors and root, loads every chunk
byte-exact; then kvfs's connector stores and vLLM loads. Hybrid model (sliding window + full
attention), TP 1/2/4, NHD and HND, on a plain directory and on a kvfs mount.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvfs.geometry import GroupGeometry, LayerKind, ModelGeometry
from kvfs.keys import BlockHasher, chunk_keys
from tests import vllm_engine
from tests.conftest import Mount
from tests.test_vllm_engine import PROMPT, check_files_hold_canonical_pages
from tests.vllm_engine import BLOCK_SIZE, HEAD_SIZE, HEADS, SLIDING_WINDOW, Engine, RequestRun

UNAVAILABLE = vllm_engine.unavailable()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

CASES = [(tp, layout) for tp in (1, 2, 4) for layout in ("NHD", "HND")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.write_tiny_model(tmp_path_factory.mktemp("tiny-hybrid"))


def kvfs_connector(engine: Engine, root: Path, model_dir: Path) -> object:
    """kvfs's connector for the harness's model, over the harness's device tensors (every
    rank's, in one process), its fs tier on ``root``."""
    from kvfs.connector.kv_connector import KVConnector

    groups = []
    for g, layers in enumerate(engine.group_layers):
        sliding = engine.is_sliding(g)
        groups.append(
            GroupGeometry(
                LayerKind.SLIDING_WINDOW if sliding else LayerKind.FULL_ATTENTION,
                layers,
                BLOCK_SIZE,
                "bfloat16",
                HEADS,
                HEAD_SIZE,
                sliding_window=SLIDING_WINDOW if sliding else None,
            )
        )
    geometry = ModelGeometry(tuple(groups), engine.blocks_per_chunk)
    config = {
        "cpu_bytes_to_use": 4 << 20,
        "blocks_per_chunk": engine.blocks_per_chunk,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    return KVConnector(
        config,
        geometry,
        engine.kv,
        str(model_dir),
        f"interop-{uuid.uuid4().hex[:8]}",
        tokens_per_hash=BLOCK_SIZE,
        kv_layout=engine.layout_name,
    )


def prompt_keys(engine: Engine, group: int) -> list[bytes]:
    hashes = BlockHasher("sha256", BLOCK_SIZE).block_hashes(PROMPT)
    return chunk_keys(hashes, group, engine.blocks_per_chunk * BLOCK_SIZE, BLOCK_SIZE)


def kvfs_loads(connector: object, keys: list[bytes], blocks: list[int], group: int) -> None:
    """Look ``keys`` up (waiting while they come up from the fs tier), load them all."""
    deadline = time.monotonic() + 30
    while (found := connector.lookup(keys, "load")).retry:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "lookup never resolved"
        connector.step()  # type: ignore[attr-defined]
        time.sleep(0.002)
    assert found.hits == len(keys), f"group {group}: {found.hits} of {len(keys)} chunks found"
    job = connector.load(keys, blocks, "load", group)  # type: ignore[attr-defined]
    connector.wait([job])  # type: ignore[attr-defined]
    assert [f.success for f in connector.step() if f.job_id == job] == [True]  # type: ignore[attr-defined]


def vllm_stores_kvfs_loads(engine: Engine, root: Path, model_dir: Path) -> None:
    kv = engine.snapshot()
    stored = engine.store(PROMPT)
    files = engine.expected_chunk_files(PROMPT)
    engine.zero_kv()
    connector = kvfs_connector(engine, root, model_dir)
    try:
        # the same rows: vLLM's file size is kvfs's chunk size
        assert connector.layout.chunk_bytes == engine.fs_tier._block_size  # type: ignore[attr-defined]
        bpc = engine.blocks_per_chunk
        loaded: dict[int, set[int]] = {}
        for group in range(len(engine.group_layers)):
            keys = prompt_keys(engine, group)
            present = [c for c, path in enumerate(files[group]) if path.exists()]
            assert present, f"vLLM stored nothing of group {group}"
            for c in present:  # one at a time: the sliding window keeps only its last chunks
                blocks = stored.block_ids[group][c * bpc : (c + 1) * bpc]
                kvfs_loads(connector, [keys[c]], blocks, group)
                loaded.setdefault(group, set()).update(blocks)
    finally:
        connector.close()  # type: ignore[attr-defined]
    compared = 0
    for group, layers in enumerate(engine.group_layers):
        for block in loaded[group]:
            for layer in layers:
                got = engine.block_kv(layer, block)
                assert torch.equal(got, kv[layer][block]), f"group {group} {layer} block {block}"
                compared += 1
    assert compared >= 2 * (len(PROMPT) // BLOCK_SIZE)
    # what kvfs did not load stayed zero (the bytes came from the files, not from memory)
    every = set().union(*loaded.values())
    for layer in vllm_engine.LAYER_NAMES:
        rest = [b for b in range(engine.kv_cache_config.num_blocks) if b not in every]
        assert not engine.snapshot()[layer][rest].any()


def kvfs_stores_vllm_loads(
    engine: Engine,
    root: Path,
    model_dir: Path,
    backing: Path,
    settle: Callable[[], None] = lambda: None,
) -> None:
    kv = engine.snapshot()
    bpc = engine.blocks_per_chunk
    nblocks = len(PROMPT) // BLOCK_SIZE
    # distinct device blocks per group (1..): the groups overlay one memory
    block_ids = tuple(
        list(range(1 + g * nblocks, 1 + (g + 1) * nblocks)) for g in range(len(engine.group_layers))
    )
    connector = kvfs_connector(engine, root, model_dir)
    try:
        for group, blocks in enumerate(block_ids):
            job = connector.store(prompt_keys(engine, group), blocks, "store", group)  # type: ignore[attr-defined]
            assert job is not None
        connector.drain()  # type: ignore[attr-defined]
    finally:
        connector.close()  # type: ignore[attr-defined]
    settle()
    written = engine.chunk_files()
    assert len(written) == 2 * nblocks // bpc
    stored = RequestRun(block_ids, 0, written)
    # kvfs's files hold vLLM's canonical pages, and zeros after them (deterministic files)
    assert check_files_hold_canonical_pages(engine, stored, kv, root=backing) == len(written)
    for path in written:
        data = (backing / path.relative_to(root)).read_bytes()
        assert len(data) == engine.fs_tier._block_size
        assert not any(data[engine.used_chunk_bytes :]), f"{path}: tail not zeroed"
    loaded = engine.load(PROMPT)
    # kvfs stored every chunk of both groups (vLLM keeps only the window's), so vLLM loads
    # the whole prompt and would compute only its last token
    assert loaded.loaded_tokens == len(PROMPT) - 1
    compared = 0
    for group, layers in enumerate(engine.group_layers):
        for old, new in zip(stored.block_ids[group], loaded.block_ids[group], strict=True):
            if new == 0:  # vLLM's null block: out of the sliding window, not loaded
                continue
            for layer in layers:
                assert torch.equal(engine.block_kv(layer, new), kv[layer][old]), (group, layer)
                compared += 1
    assert compared == 2 * (nblocks + SLIDING_WINDOW // BLOCK_SIZE)


@pytest.mark.parametrize(("tp", "layout"), CASES)
def test_vllm_stores_kvfs_loads(model_dir: Path, tmp_path: Path, tp: int, layout: str) -> None:
    with Engine(tmp_path, model_dir, tp=tp, layout=layout) as engine:
        vllm_stores_kvfs_loads(engine, tmp_path, model_dir)


@pytest.mark.parametrize(("tp", "layout"), CASES)
def test_kvfs_stores_vllm_loads(model_dir: Path, tmp_path: Path, tp: int, layout: str) -> None:
    with Engine(tmp_path, model_dir, tp=tp, layout=layout) as engine:
        kvfs_stores_vllm_loads(engine, tmp_path, model_dir, tmp_path)


@pytest.mark.parametrize(("tp", "layout"), [(2, "NHD"), (4, "HND")])
def test_both_ways_on_a_kvfs_mount(model_dir: Path, kv_mount: Mount, tp: int, layout: str) -> None:
    root = kv_mount.path / f"interop-{uuid.uuid4().hex[:6]}"
    backing = kv_mount.backing / root.name
    with Engine(root / "a", model_dir, tp=tp, layout=layout) as engine:
        vllm_stores_kvfs_loads(engine, root / "a", model_dir)
    with Engine(root / "b", model_dir, tp=tp, layout=layout) as engine:
        kvfs_stores_vllm_loads(engine, root / "b", model_dir, backing / "b", kv_mount.settle)
