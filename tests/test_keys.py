"""Keys, namespaces and paths are vLLM 0.33.0's, computed by its own functions side by side."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import make_offload_key as vllm_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.request import Request
from vllm.v1.utils import tensor_data

from kvfs.keys import (
    BlockHasher,
    Placeholder,
    chunk_keys,
    embeds_digest,
    make_offload_key,
    split_offload_key,
)
from kvfs.run_config import KVCacheGroupConfig, RunConfig
from tests import vllm_tier

pytestmark = pytest.mark.vllm

ALGORITHMS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
rng = random.Random(5)
SEQUENCES = [[], list(range(15)), list(range(16)), [rng.randrange(150_000) for _ in range(1000)]]


def vllm_request(
    algorithm: str, tokens: list[int] | None, tokens_per_hash: int, **request: Any
) -> tuple[Request, str]:
    """A vLLM request hashed by vLLM's own block hasher, and the seed its NONE_HASH came from."""
    fn = hashing.get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(tokens_per_hash, fn)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher, **request)
    return req, kv_cache_utils.get_none_hash_seed()


def vllm_hashes(
    algorithm: str, tokens: list[int] | None, tokens_per_hash: int, **request: Any
) -> tuple[list[bytes], str]:
    """vLLM's block hashes for a request, and the seed its NONE_HASH came from."""
    req, seed = vllm_request(algorithm, tokens, tokens_per_hash, **request)
    return list(req.block_hashes), seed


def features(*placeholders: Placeholder) -> list[MultiModalFeatureSpec]:
    """vLLM's view of kvfs placeholders (data=None: vLLM's "the item is cached")."""
    return [
        MultiModalFeatureSpec(None, "image", p.identifier, PlaceholderRange(p.offset, p.length))
        for p in placeholders
    ]


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


def random_placeholders(r: random.Random, prompt_len: int) -> list[Placeholder]:
    """Up to 4 images, adjacent or apart, starting anywhere in the prompt."""
    placeholders: list[Placeholder] = []
    pos = r.choice([0, r.randrange(prompt_len + 1)])
    for _ in range(r.randrange(5)):
        offset, length = pos + r.choice([0, 0, r.randrange(40)]), r.randrange(1, 80)
        if offset + length > prompt_len:
            break
        placeholders.append(Placeholder(f"img{r.randrange(3)}", offset, length))  # repeats too
        pos = offset + length
    return placeholders


def random_case(r: random.Random, algorithm: str) -> None:
    """One random request, hashed by vLLM and by kvfs, then decoded a few tokens further."""
    size = r.choice([1, 2, 3, 4, 16, 16, 32])
    prompt = [r.randrange(1, 150_000) for _ in range(r.randrange(r.choice([3, 300])))]
    placeholders = random_placeholders(r, len(prompt))
    lora = ("ad", f"/lora/{r.randrange(2)}") if r.random() < 0.3 else None
    salt = r.choice([None, "", "tenant-7"])
    request: dict[str, Any] = {"mm_features": features(*placeholders), "cache_salt": salt}
    if lora:
        request["lora_request"] = LoRARequest(lora[0], 1, lora[1])
    tokens: list[int] | None = prompt
    embeds: Any = None
    if prompt and r.random() < 0.4:
        dtype = r.choice([torch.float32, torch.float16, torch.bfloat16])
        seeded = torch.Generator().manual_seed(r.randrange(2**32))
        tensor = torch.randn(len(prompt), r.choice([1, 8]), dtype=dtype, generator=seeded)
        request["prompt_embeds"] = tensor
        if r.random() < 0.5:  # embeddings only: vLLM's token ids are all 0
            tokens, prompt = None, [0] * len(prompt)
        else:  # mixed: vLLM zeroes the token ids at embedded positions
            mask = [r.random() < 0.5 for _ in prompt]
            request["prompt_is_token_ids"] = mask
            prompt = [t if is_token else 0 for t, is_token in zip(prompt, mask, strict=True)]
        embeds = r.choice(
            [
                tensor.view(torch.int16).numpy() if dtype == torch.bfloat16 else tensor.numpy(),
                lambda s, e, t=tensor: hashlib.sha256(tensor_data(t[s:e])).digest(),
            ]
        )
    req, seed = vllm_request(algorithm, tokens, size, **request)
    mm = r.sample(placeholders, len(placeholders))  # any order
    case = f"{algorithm} size={size} prompt={len(prompt)} {lora} {salt!r} {mm} {type(embeds)}"
    hasher = BlockHasher(algorithm, size, seed=seed)

    def ours(tokens: Sequence[int], known: list[bytes]) -> list[bytes]:
        return hasher.block_hashes(tokens, known, lora, salt, mm, embeds)

    hashes = ours(prompt, [])
    assert hashes == req.block_hashes, case
    if hashes:
        known = hashes[: r.randrange(len(hashes))]
        assert ours(prompt, known) == hashes, f"resumed at block {len(known)}: {case}"
    for _ in range(2):  # decoding: vLLM resumes mid-request, past the prompt embeddings
        req.append_output_token_ids([r.randrange(150_000) for _ in range(r.randrange(40))])
        hashes = ours(req.all_token_ids, hashes)
        assert hashes == req.block_hashes, f"after {req.num_output_tokens} outputs: {case}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_random_multimodal_and_embedding_requests_hash_as_in_vllm(algorithm: str) -> None:
    r = random.Random(f"mm-{algorithm}")
    for _ in range(100):
        random_case(r, algorithm)


IMAGE_TOKEN = 151_655


@pytest.mark.parametrize(
    "placeholders",
    [
        [Placeholder("a", 5, 40)],  # spans 3 blocks: offsets 5, -11, -27
        [Placeholder("a", 16, 16), Placeholder("b", 32, 16)],  # exactly blocks 1 and 2
        [Placeholder("a", 0, 64), Placeholder("b", 64, 1)],  # ends where the next starts
        [Placeholder("a", 15, 2), Placeholder("b", 17, 15), Placeholder("c", 95, 1)],
        [Placeholder("a", 97, 3)],  # in the last, partial block: hashes no block
    ],
    ids=["spanning", "on-boundaries", "adjacent", "straddling", "partial-block"],
)
def test_placeholder_edges_hash_as_in_vllm(placeholders: list[Placeholder]) -> None:
    tokens = [IMAGE_TOKEN] * 100
    theirs, seed = vllm_hashes(
        "sha256_cbor",
        tokens,
        16,
        mm_features=features(*placeholders),
        lora_request=LoRARequest("ad", 1, "/ad"),
        cache_salt="t7",
    )
    hasher = BlockHasher("sha256_cbor", 16, seed=seed)

    def ours(mm: list[Placeholder], known: Sequence[bytes] = ()) -> list[bytes]:
        return hasher.block_hashes(tokens, known, ("ad", "/ad"), "t7", mm)

    assert ours(placeholders[::-1]) == theirs
    for resumed in range(len(theirs)):  # incl. right after an image ends on a block boundary
        assert ours(placeholders, theirs[:resumed]) == theirs
    changed = ours([Placeholder(p.identifier + "'", p.offset, p.length) for p in placeholders])
    covered = {b for p in placeholders for b in range(p.offset // 16, (p.end - 1) // 16 + 1)}
    first = min(covered)
    assert changed[:first] == theirs[:first]  # blocks before the first image are shared
    assert all(a != b for a, b in zip(changed[first:], theirs[first:], strict=True))


def test_the_same_placeholder_tokens_with_other_images_get_other_keys() -> None:
    hasher = BlockHasher("sha256", 16)
    tokens = [1, 2, 3] + [IMAGE_TOKEN] * 64 + [4, 5, 6]
    cat, dog = ([Placeholder(image, 3, 64)] for image in ("cat", "dog"))
    assert hasher.block_hashes(tokens, mm=cat) != hasher.block_hashes(tokens, mm=dog)
    assert hasher.block_hashes(tokens, mm=()) == hasher.block_hashes(tokens)
    assert hasher.block_hashes([], mm=cat, prompt_embeds=np.zeros((0, 4))) == []


def test_embeddings_hash_their_bytes_and_dtype_as_in_vllm() -> None:
    tensor = torch.randn(40, 8)
    theirs, seed = vllm_hashes("sha256", None, 16, prompt_embeds=tensor)
    hasher = BlockHasher("sha256", 16, seed=seed)
    assert hasher.block_hashes([0] * 40, prompt_embeds=tensor.numpy()) == theirs
    assert hasher.block_hashes([0] * 40, prompt_embeds=memoryview(tensor.numpy())) == theirs
    as_half = hasher.block_hashes([0] * 40, prompt_embeds=tensor.half().numpy())
    assert as_half[0] != theirs[0]
    assert embeds_digest(tensor.numpy())(32, 48) == hashlib.sha256(tensor[32:].numpy()).digest()


def test_malformed_inputs_are_refused() -> None:
    hasher = BlockHasher("sha256", 16)
    with pytest.raises(ValueError, match="overlap"):
        hasher.block_hashes([0] * 32, mm=[Placeholder("a", 0, 10), Placeholder("b", 9, 4)])
    with pytest.raises(ValueError, match="positions"):
        hasher.block_hashes([0] * 32, prompt_embeds=bytes(32 * 16))
    with pytest.raises(ValueError, match="length > 0"):
        Placeholder("a", 3, 0)
    assert Placeholder("a", np.int64(3), np.int64(4)) == Placeholder("a", 3, 4)  # type: ignore[arg-type]
    assert type(Placeholder("a", np.int64(3), 4).offset) is int  # type: ignore[arg-type]


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
