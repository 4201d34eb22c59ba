"""vLLM's canonical chunk layout, computed without vLLM: offsets, row sizes, and the bytes each
TP rank contributes."""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvfs.geometry import ChunkLayout, GeometryError, GroupGeometry, LayerKind, ModelGeometry
from tests import kv_model


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_writers_of_a_chunk_tile_every_page_exactly_once(tp: int, kv_layout: str) -> None:
    """Whatever slot a chunk lands in, the ranks that write it cover each byte once, and
    every rank's runs cover its own bytes once."""
    geo = kv_model.geometry(blocks_per_chunk=2)
    layout = ChunkLayout(geo, tp, kv_layout)
    for group, spec in enumerate(geo.groups):
        if spec.kind is LayerKind.MAMBA and spec.state_bytes % tp:
            continue
        shares = [layout.rank_share(group, tp, r) for r in range(tp)]
        for slot in range(tp):
            covered = sorted(
                (run.page_offset, run.page_offset + run.length)
                for share in shares
                if share.writes(slot)
                for run in share.runs
            )
            assert covered[0][0] == 0 and covered[-1][1] == spec.page_bytes
            assert all(a[1] == b[0] for a, b in pairwise(covered))
        for share in shares:
            local = sorted((r.local_offset, r.local_offset + r.length) for r in share.runs)
            assert local[0][0] == 0 and local[-1][1] == share.local_page_bytes


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_at_tp1_each_area_of_a_chunk_is_one_run(kv_layout: str) -> None:
    geo = kv_model.geometry(blocks_per_chunk=4)
    layout = ChunkLayout(geo, kv_layout=kv_layout)
    for group, spec in enumerate(geo.groups):
        runs = layout.row_runs(group, layout.rank_share(group, 1, 0))
        assert [(r.page_offset, r.page_offset + r.length) for r in runs] == layout.used_ranges(
            group
        )
        assert (
            sum(r.length for r in runs)
            == layout.group_bytes(group)
            == (len(spec.layer_names) * 4 * spec.page_bytes)
        )


def test_areas_are_canonical_tensors_then_blocks() -> None:
    """Tensor t is layer t of every group (vLLM's hybrid planner); its area holds
    blocks_per_chunk pages of the largest of their pages."""
    geo = kv_model.geometry(blocks_per_chunk=4)
    layout = ChunkLayout(geo)
    pages = [g.page_bytes for g in geo.groups]  # attn (2 layers), swa, mla, mamba
    assert layout.area_pages == [max(pages), pages[0]]
    page = pages[0]
    assert layout.page_offset(0, "attn.1", 2) == 4 * max(pages) + 2 * page
    assert layout.page_offset(0, 1, 2) == layout.page_offset(0, "attn.1", 2)
    assert layout.page_offset(3, "mamba.0", 1) == pages[3]  # area 0, block 1
    with pytest.raises(GeometryError):
        layout.page_offset(0, 0, 4)


def test_row_size_and_namespace_fields_follow_vllm() -> None:
    """The row is the worker's device bytes per block x copies x blocks_per_chunk, rounded
    to 4 KiB; Mamba makes the namespace topology-specific; all-MLA keeps one copy."""
    geo = kv_model.geometry(blocks_per_chunk=16)
    at = {tp: ChunkLayout(geo, tp) for tp in (1, 2, 4)}
    assert at[1].canonical_format == "v1-nhd" and not at[1].parallel_agnostic
    assert ChunkLayout(geo, kv_layout="HND").canonical_format == "v1-hnd"
    # TP 1: tensor 0's largest page is swa/mamba's 512 B, tensor 1 is attn.1's 256 B
    assert at[1].chunk_bytes == (512 + 256) * 16
    # TP 4: local pages 192 (mla, whole latent) + 128 (attn.1: one of 2 heads, on two
    # ranks), a copy per rank: rows grow where bytes are replicated
    assert at[4].chunk_bytes == (192 + 128) * 4 * 16
    mla = ModelGeometry((GroupGeometry(LayerKind.MLA, ("m0", "m1"), 16, head_size=576),), 1)
    for tp in (1, 2, 4):
        layout = ChunkLayout(mla, tp)
        assert layout.replicated_layout and layout.parallel_agnostic
        assert layout.chunk_bytes == 2 * 16 * 576 * 2  # one copy at every TP (9 x 4 KiB)


def test_the_fingerprint_names_the_layout() -> None:
    assert kv_model.geometry(2).fingerprint() == kv_model.geometry(2).fingerprint()
    assert kv_model.geometry(2).fingerprint() != kv_model.geometry(4).fingerprint()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "conv"}, "layer type 'conv'"),
        ({"dtype": "float64"}, "dtype 'float64'"),
        ({"num_kv_heads": 0}, "num_kv_heads and head_size"),
        ({"layer_names": ()}, "layer_names"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"sliding_window": 128}, "sliding_window is set for sliding-window groups only"),
    ],
)
def test_bad_geometry_is_refused(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(
        kind=LayerKind.FULL_ATTENTION,
        layer_names=("a",),
        tokens_per_block=16,
        num_kv_heads=8,
        head_size=64,
    )
    with pytest.raises(GeometryError, match=message):
        GroupGeometry(**{**base, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="more than one group"):
        group = GroupGeometry(LayerKind.MLA, ("a",), 16, head_size=8)
        ModelGeometry((group, group))
