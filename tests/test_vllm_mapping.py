"""kvfs/geometry.py (no vLLM) derives the same page mappings as vLLM 0.33.0's own
``_layer_mapping``: the bytes each rank contributes to a canonical page, where, and which rank
writes replicated bytes, for packed NHD/HND attention (TP 1/2/4, GQA replication) and MLA."""

from __future__ import annotations

import pytest
import torch

from kvfs.geometry import ChunkLayout, GroupGeometry, LayerKind, ModelGeometry
from tests import vllm_engine

UNAVAILABLE = vllm_engine.unavailable()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

TOKENS, HEAD, LATENT, BLOCKS = 16, 8, 24, 4


def byte_map(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(canonical offset, local offset, length) runs, sorted and merged where contiguous."""
    merged: list[tuple[int, int, int]] = []
    for canon, local, size in sorted(runs):
        if (
            merged
            and merged[-1][0] + merged[-1][2] == canon
            and merged[-1][1] + merged[-1][2] == local
        ):
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((canon, local, size))
    return merged


def vllm_map(mapping: object) -> list[tuple[int, int, int]]:
    runs = []
    for run in mapping.runs:  # type: ignore[attr-defined]
        for i in range(run.num_fragments):
            runs.append(
                (
                    run.canonical_offset + i * run.canonical_stride,
                    run.local_offset + i * run.local_stride,
                    run.fragment_size,
                )
            )
    return byte_map(runs)


def device_tensor(local_heads: int, kv_layout: str) -> torch.Tensor:
    """vLLM 0.33's packed view (blocks, heads, tokens, K|V) with the layout's strides."""
    if kv_layout == "HND":
        return torch.zeros(BLOCKS, local_heads, TOKENS, 2 * HEAD, dtype=torch.bfloat16)
    physical = torch.zeros(BLOCKS, TOKENS, local_heads, 2 * HEAD, dtype=torch.bfloat16)
    return physical.permute(0, 2, 1, 3)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [4, 2, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_runs_match_vllms_mapping(tp: int, heads: int, kv_layout: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        _layer_mapping,
        _RankContext,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    local = max(1, heads // tp)
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=local, head_size=HEAD, dtype=torch.bfloat16
    )
    group = GroupGeometry(LayerKind.FULL_ATTENTION, ("a",), TOKENS, "bfloat16", heads, HEAD)
    layout = ChunkLayout(ModelGeometry((group,)), tp, kv_layout)
    for rank in range(tp):
        ctx = _RankContext(
            tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=heads, rank=rank
        )
        mapping = _layer_mapping(spec, device_tensor(local, kv_layout), BLOCKS, ctx)
        assert mapping is not None and mapping.parallelism_agnostic
        share = layout.rank_share(0, tp, rank)
        assert mapping.canonical_page_size_bytes == group.page_bytes
        assert mapping.local_page_size_bytes == share.local_page_bytes
        assert (mapping.num_writers, mapping.writer_index) == (share.holders, share.holder_index)
        ours = byte_map([(r.page_offset, r.local_offset, r.length) for r in share.runs])
        assert ours == vllm_map(mapping), f"rank {rank}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_runs_match_vllms_mapping(tp: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        _layer_mapping,
        _RankContext,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16
    )
    group = GroupGeometry(LayerKind.MLA, ("m",), TOKENS, "bfloat16", head_size=LATENT)
    layout = ChunkLayout(ModelGeometry((group,)), tp)
    assert layout.replicated_layout
    for rank in range(tp):
        ctx = _RankContext(
            tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=1, rank=rank
        )
        kv = torch.zeros(BLOCKS, TOKENS, LATENT, dtype=torch.bfloat16)
        mapping = _layer_mapping(spec, kv, BLOCKS, ctx)
        assert mapping is not None
        share = layout.rank_share(0, tp, rank)
        assert mapping.canonical_page_size_bytes == group.page_bytes
        assert (mapping.num_writers, mapping.writer_index) == (share.holders, share.holder_index)
        ours = byte_map([(r.page_offset, r.local_offset, r.length) for r in share.runs])
        assert ours == vllm_map(mapping)
