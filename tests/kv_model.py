"""A small model geometry with every layer type, its full KV tensors, and each rank's shard.

The full tensors are what a TP=1 engine holds; rank r of a TP group holds the heads (or state
bytes) the canonical layout gives it, as vLLM 0.33's packed view (blocks, heads, tokens, K|V)
kept in memory in the device order it uses (NHD: token-major, HND: head-major).
"""

from __future__ import annotations

import torch

from kvfs.geometry import ChunkLayout, GroupGeometry, LayerKind, ModelGeometry

NUM_BLOCKS = 24
TOKENS = 4


def geometry(blocks_per_chunk: int = 2) -> ModelGeometry:
    return ModelGeometry(
        groups=(
            # 2 KV heads: at TP=4 each head is held by two ranks
            GroupGeometry(LayerKind.FULL_ATTENTION, ("attn.0", "attn.1"), TOKENS, "bfloat16", 2, 8),
            GroupGeometry(
                LayerKind.SLIDING_WINDOW, ("swa.0",), TOKENS, "float16", 4, 8, sliding_window=8
            ),
            GroupGeometry(LayerKind.MLA, ("mla.0",), TOKENS, "bfloat16", head_size=24),
            GroupGeometry(LayerKind.MAMBA, ("mamba.0",), TOKENS, "float32", state_bytes=512),
        ),
        blocks_per_chunk=blocks_per_chunk,
    )


def full_tensors(geo: ModelGeometry, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every layer's whole KV cache (all heads) on the CPU; attention (blocks, tokens, heads,
    K|V)."""
    out = {}
    for g, spec in enumerate(geo.groups):
        for i, name in enumerate(spec.layer_names):
            gen = torch.Generator().manual_seed(seed * 1000 + g * 100 + i)
            if spec.kind is LayerKind.MAMBA:
                out[name] = torch.randint(0, 256, (NUM_BLOCKS, spec.state_bytes), generator=gen)
                out[name] = out[name].to(torch.uint8)
                continue
            if spec.kind is LayerKind.MLA:
                shape: tuple[int, ...] = (NUM_BLOCKS, TOKENS, spec.head_size)
            else:
                shape = (NUM_BLOCKS, TOKENS, spec.num_kv_heads, 2 * spec.head_size)
            out[name] = torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype))
    return out


def shard(
    geo: ModelGeometry, full: dict[str, torch.Tensor], tp: int, rank: int, kv_layout: str
) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``tp`` holds: packed views, in its device order."""
    layout = ChunkLayout(geo, tp, kv_layout)
    out = {}
    for g, spec in enumerate(geo.groups):
        share = layout.rank_share(g, tp, rank)
        for name in spec.layer_names:
            tensor = full[name]
            if spec.kind is LayerKind.MAMBA:
                part = spec.state_bytes // tp
                # a rank's state as float32 words, as a Mamba layer would keep it
                local = tensor[:, rank * part : (rank + 1) * part].contiguous()
                out[name] = local.view(torch.float32)
            elif spec.kind is LayerKind.MLA:
                out[name] = tensor.clone()
            else:
                first = (rank // share.holders) * share.local_heads
                local = tensor[:, :, first : first + share.local_heads]
                if kv_layout == "HND":
                    out[name] = local.permute(0, 2, 1, 3).contiguous()
                else:
                    out[name] = local.contiguous().permute(0, 2, 1, 3)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (NaN patterns included, which torch.equal would call unequal)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )
