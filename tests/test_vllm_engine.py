"""The vLLM engine harness (tests/vllm_engine.py) is real: vLLM 0.33.0's OffloadingConnector,
scheduler and worker sides, with its TieringOffloadingSpec and fs tier in the canonical layout,
moves a hybrid model's KV device → host → fs and back, byte for byte, under vLLM's names, the
same bytes for TP 1, 2 and 4, NHD and HND, on a plain directory and through a kvfs mount."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfs.keys import BlockHasher, chunk_keys
from kvfs.run_config import KVCacheGroupConfig, RunConfig
from tests import vllm_engine
from tests.conftest import Mount
from tests.vllm_engine import BLOCK_SIZE, Engine, RequestRun

UNAVAILABLE = vllm_engine.unavailable()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

PROMPT = [100 + (i * 7919) % 800 for i in range(16 * BLOCK_SIZE)]  # 16 blocks, 8 chunks
LAYOUTS = ["NHD", "HND"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.write_tiny_model(tmp_path_factory.mktemp("tiny-hybrid"))


def chunk_tokens(engine: Engine) -> int:
    return engine.blocks_per_chunk * BLOCK_SIZE


def check_files_hold_canonical_pages(
    engine: Engine, stored: RequestRun, kv: dict[str, torch.Tensor], root: Path | None = None
) -> int:
    """Every chunk file of the prompt holds the canonical pages of its blocks (computed from
    the KV, not by vLLM); the full-attention group has every chunk, the sliding-window group
    at least one. ``root``: read the files there instead (a mount's backing directory).
    Returns how many files it checked."""
    bpc = engine.blocks_per_chunk
    checked = 0
    for group, paths in engine.expected_chunk_files(PROMPT).items():
        present = [c for c, path in enumerate(paths) if path.exists()]
        if engine.is_sliding(group):
            assert present, "the sliding-window group stored nothing"
        else:
            assert present == list(range(len(paths))), f"full-attention chunks {present}"
        for c in present:
            path = paths[c]
            if root is not None:
                path = root / path.relative_to(engine.root_dir)
            data = path.read_bytes()
            assert len(data) >= engine.used_chunk_bytes
            want = engine.canonical_chunk(
                group, stored.block_ids[group][c * bpc : (c + 1) * bpc], kv
            )
            assert data[: engine.used_chunk_bytes] == want, f"{path}: not vLLM's canonical pages"
            checked += 1
    return checked


def check_loaded(
    loader: Engine, loaded: RequestRun, stored: RequestRun, kv: dict[str, torch.Tensor]
) -> None:
    """Every block the load covered holds exactly the stored KV, all heads; the blocks it did
    not cover are still zero (so the KV was zeroed, and the bytes came from the load)."""
    hit = (len(PROMPT) - 1) // chunk_tokens(loader) * chunk_tokens(loader)
    assert loaded.loaded_tokens == hit
    hit_blocks = hit // BLOCK_SIZE
    compared = 0
    for group, layers in enumerate(loader.group_layers):
        window: range = range(hit_blocks)
        if loader.is_sliding(group):  # only the chunk ending the hit is loaded
            window = range(hit_blocks - loader.blocks_per_chunk, hit_blocks)
        for i, (old, new) in enumerate(
            zip(stored.block_ids[group], loaded.block_ids[group], strict=True)
        ):
            for layer in layers:
                got = loader.block_kv(layer, new)
                if i in window:
                    assert torch.equal(got, kv[layer][old]), f"group {group} block {i} {layer}"
                    compared += 1
                elif new != 0:  # 0: vLLM's null block, for blocks out of the window
                    assert not got.any(), f"group {group} block {i}: not zeroed, not loaded"
    assert compared == 2 * (hit_blocks + loader.blocks_per_chunk)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_goes_device_host_fs_and_back_byte_identical(
    model_dir: Path, tmp_path: Path, layout: str
) -> None:
    with Engine(tmp_path, model_dir, layout=layout) as engine:
        from tests.vllm_cpu_spec import CpuOffloadingWorker

        # vLLM loaded the spec by spec_module_path, and its own fs tier by type
        worker = engine.workers[0].connector_worker.worker
        assert isinstance(worker, CpuOffloadingWorker)
        assert type(engine.fs_tier).__name__ == "FileSystemTierManager"

        kv = engine.snapshot()
        stored = engine.store(PROMPT)
        assert stored.loaded_tokens == 0
        assert stored.files == engine.chunk_files() != []
        assert check_files_hold_canonical_pages(engine, stored, kv) == len(stored.files)

        loaded = engine.load(PROMPT)
        check_loaded(engine, loaded, stored, kv)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_files_and_config_are_named_as_vllms_file_mapper_names_them(
    model_dir: Path, tmp_path: Path, layout: str
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        canonical_format_id,
    )

    with Engine(tmp_path, model_dir, layout=layout) as engine:
        stored = engine.store(PROMPT)
        groups = engine.group_layers

    format_id = canonical_format_id(vllm_engine.LAYOUTS[layout])
    assert format_id == {"NHD": "v1-nhd", "HND": "v1-hnd"}[layout]
    # kvfs's own names (kvfs.keys, kvfs.run_config), computed without vLLM
    run = RunConfig(
        model_name=str(model_dir),
        tokens_per_hash=BLOCK_SIZE,
        blocks_per_file=2,
        dtype="bfloat16",
        kv_cache_groups=tuple(KVCacheGroupConfig(BLOCK_SIZE, layers) for layers in groups),
        canonical_format=format_id,
    )
    hashes = BlockHasher("sha256", BLOCK_SIZE).block_hashes(PROMPT)
    names = {
        Path(run.chunk_path(str(tmp_path), key))
        for group in range(len(groups))
        for key in chunk_keys(hashes, group, 2 * BLOCK_SIZE, BLOCK_SIZE)
    }
    assert stored.files and set(stored.files) <= names
    assert {f.parent.parent.parent.name for f in stored.files} == {f"{run.namespace}_r0"}
    config = tmp_path / run.namespace / "config.json"
    assert config.read_text() == run.config_json()
    assert engine.config_json()["canonical_format"] == format_id


def used_tree(engine: Engine) -> dict[str, tuple[int, bytes]]:
    """Each chunk file by path under the root: its size and its used bytes (vLLM leaves stale
    bytes in the padding of reused host rows)."""
    return {
        str(path.relative_to(engine.root_dir)): (
            path.stat().st_size,
            path.read_bytes()[: engine.used_chunk_bytes],
        )
        for path in engine.chunk_files()
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_1_2_4_write_identical_trees(model_dir: Path, tmp_path: Path, layout: str) -> None:
    trees = {}
    for tp in (1, 2, 4):
        with Engine(tmp_path / f"tp{tp}", model_dir, tp=tp, layout=layout) as engine:
            assert len(engine.workers) == tp
            assert {tuple(kv[n].shape[1] for n in kv) for kv in engine.kv} == {(4 // tp,) * 4}
            kv = engine.snapshot()
            stored = engine.store(PROMPT)
            check_files_hold_canonical_pages(engine, stored, kv)
            trees[tp] = used_tree(engine)
    assert len(trees[1]) == 9  # 8 full-attention chunks + the sliding window's last
    assert trees[1] == trees[2] == trees[4]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp4_engine_loads_what_tp1_stored(model_dir: Path, tmp_path: Path, layout: str) -> None:
    with Engine(tmp_path, model_dir, tp=1, layout=layout) as engine:
        kv = engine.snapshot()
        stored = engine.store(PROMPT)
    with Engine(tmp_path, model_dir, tp=4, layout=layout, seed=1) as engine:
        loaded = engine.load(PROMPT)
        check_loaded(engine, loaded, stored, kv)


def test_round_trip_through_a_kvfs_mount(model_dir: Path, kv_mount: Mount) -> None:
    root = kv_mount.path / "vllm-canonical"
    with Engine(root, model_dir, tp=2, layout="HND") as engine:
        kv = engine.snapshot()
        stored = engine.store(PROMPT)
        assert engine.fs_tier._use_o_direct  # the mount passed vLLM's O_DIRECT probe
        assert len(stored.files) == 9
        kv_mount.settle()
        backing = kv_mount.backing / root.relative_to(kv_mount.path)
        assert check_files_hold_canonical_pages(engine, stored, kv, root=backing) == 9
        loaded = engine.load(PROMPT)
        check_loaded(engine, loaded, stored, kv)
