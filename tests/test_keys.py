"""Keys, namespaces and paths are vLLM 0.33.0's, computed by its own functions side by side."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import make_offload_key as vllm_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.request import Request

from kvfs.keys import BlockHasher, chunk_keys, make_offload_key, split_offload_key
from kvfs.run_config import KVCacheGroupConfig, RunConfig
from tests import vllm_tier

pytestmark = pytest.mark.vllm

ALGORITHMS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
rng = random.Random(5)
SEQUENCES = [[], list(range(15)), list(range(16)), [rng.randrange(150_000) for _ in range(1000)]]


def vllm_hashes(
    algorithm: str, tokens: list[int], tokens_per_hash: int, **request: object
) -> tuple[list[bytes], str]:
    """vLLM's block hashes for a request, and the seed its NONE_HASH came from."""
    fn = hashing.get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(tokens_per_hash, fn)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher, **request)  # type: ignore[arg-type]
    return list(req.block_hashes), kv_cache_utils.get_none_hash_seed()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("tokens", SEQUENCES, ids=lambda t: f"{len(t)}tok")
def test_block_hashes_equal_vllms(algorithm: str, tokens: list[int]) -> None:
    theirs, seed = vllm_hashes(algorithm, tokens, 16)
    ours = BlockHasher(algorithm, 16, seed=seed)  # xxhash: vLLM's seed is random per process
    assert ours.block_hashes(tokens) == theirs
    assert len(theirs) == len(tokens) // 16


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_the_default_seed_is_vllms_without_being_told(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    theirs, _ = vllm_hashes(algorithm, SEQUENCES[3], 16)
    assert BlockHasher(algorithm, 16).block_hashes(SEQUENCES[3]) == theirs


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pythonhashseed_is_the_seed_as_in_vllm(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    theirs, _ = vllm_hashes(algorithm, SEQUENCES[3], 32)
    assert BlockHasher(algorithm, 32).block_hashes(SEQUENCES[3]) == theirs


def test_lora_and_cache_salt_enter_the_hash_as_in_vllm() -> None:
    tokens = SEQUENCES[3][:100]
    theirs, seed = vllm_hashes(
        "sha256_cbor",
        tokens,
        16,
        lora_request=LoRARequest("ad", 3, "/lora/ad"),
        cache_salt="tenant-7",
    )
    hasher = BlockHasher("sha256_cbor", 16, seed=seed)
    assert hasher.block_hashes(tokens, lora=("ad", "/lora/ad"), cache_salt="tenant-7") == theirs
    assert hasher.block_hashes(tokens) != theirs


def test_a_later_turn_extends_the_previous_hashes() -> None:
    hasher = BlockHasher("sha256_cbor", 16)
    first = SEQUENCES[3][:500]
    known = hasher.block_hashes(first)
    assert hasher.block_hashes(SEQUENCES[3], known=known) == hasher.block_hashes(SEQUENCES[3])
    assert hasher.block_hashes(np.array(SEQUENCES[3])) == hasher.block_hashes(SEQUENCES[3])


@pytest.mark.parametrize(("tokens_per_chunk", "group"), [(16, 0), (64, 1), (256, 3)])
def test_chunk_keys_are_vllms_offload_keys(tokens_per_chunk: int, group: int) -> None:
    hashes = BlockHasher("sha256_cbor", 16).block_hashes(SEQUENCES[3])
    scaled = kv_cache_utils.BlockHashListWithBlockSize(hashes, 16, tokens_per_chunk)
    theirs = [vllm_offload_key(scaled[i], group) for i in range(len(scaled))]
    assert chunk_keys(hashes, group, tokens_per_chunk, 16) == theirs
    assert split_offload_key(theirs[-1]) == (scaled[len(scaled) - 1], group)
    assert make_offload_key(hashes[0], group) == vllm_offload_key(hashes[0], group)


GROUPS = (KVCacheGroupConfig(16, ("model.layers.0.self_attn", "model.layers.1.self_attn")),)
CONFIGS = [
    RunConfig("meta-llama/Llama-3.1-8B", 16, 1, "bfloat16", GROUPS),
    RunConfig("tiny", 16, 4, "float16", (*GROUPS, KVCacheGroupConfig(32, ("swa.0",)))),
    RunConfig("m/o/d", 32, 2, "fp8", GROUPS, tp_size=2, rank=1, parallel_agnostic=False),
    RunConfig("mla", 16, 1, "bfloat16", GROUPS, replicated_layout=True, canonical_format="v1-hnd"),
    RunConfig("agnostic-tp", 16, 1, "bfloat16", GROUPS, tp_size=4, pp_size=2, rank=3),
]


def file_mapper(root: str, config: RunConfig) -> FileMapper:
    return FileMapper(
        root_dir=root,
        model_name=config.model_name,
        tokens_per_hash=config.tokens_per_hash,
        blocks_per_file=config.blocks_per_file,
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        pcp_size=config.pcp_size,
        dcp_size=config.dcp_size,
        rank=config.rank,
        dtype=config.dtype,
        kv_cache_groups=[
            {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
            for g in config.kv_cache_groups
        ],
        parallel_agnostic=config.parallel_agnostic,
        replicated_layout=config.replicated_layout,
        canonical_format=config.canonical_format,
    )


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.model_name)
def test_namespace_and_paths_equal_vllms(config: RunConfig) -> None:
    mapper = file_mapper("/mnt/kv-cache", config)
    assert config.fields() == mapper.get_run_config()
    assert f"/mnt/kv-cache/{config.namespace}" == mapper.base_path
    assert config.config_path("/mnt/kv-cache") == mapper.get_config_file_path()
    hashes = BlockHasher("sha256_cbor", 16).block_hashes(SEQUENCES[3][:64]) + BlockHasher(
        "xxhash", 16, seed="1"
    ).block_hashes(SEQUENCES[3][:64])
    for group in (0, 1, 12):
        for block_hash in hashes:
            key = make_offload_key(block_hash, group)
            assert config.chunk_path("/mnt/kv-cache", key) == mapper.get_file_name(
                vllm_offload_key(block_hash, group)
            )


def test_config_json_is_the_file_vllms_fs_tier_writes(tmp_path: Path) -> None:
    spec = vllm_tier.minimal_spec(
        "org/model-7b", blocks_per_chunk=2, tp_size=2, layer_names=("l.0", "l.1")
    )
    region = np.zeros((2, 4096), dtype=np.uint8)
    tier = FileSystemTierManager(
        spec, memoryview(region), "fs", root_dir=str(tmp_path), n_read_threads=1, n_write_threads=1
    )
    tier.shutdown()
    ours = RunConfig(
        "org/model-7b", 16, 2, "bfloat16", (KVCacheGroupConfig(16, ("l.0", "l.1")),), tp_size=2
    )
    written = Path(ours.config_path(str(tmp_path)))
    assert written.read_text() == ours.config_json()
    assert json.loads(ours.config_json()) == ours.fields()
