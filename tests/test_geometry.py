"""The canonical chunk layout: offsets, and the bytes each TP rank contributes."""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvfs.geometry import ChunkLayout, GeometryError, GroupGeometry, LayerKind, ModelGeometry
from tests import kv_model


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_writers_of_a_chunk_tile_every_page_exactly_once(tp: int) -> None:
    """Whatever slot a chunk lands in, the ranks that write it cover each byte once, and
    every rank's runs cover its own bytes once."""
    geo = kv_model.geometry(blocks_per_chunk=2)
    layout = ChunkLayout(geo)
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


def test_a_chunk_at_tp1_is_one_run() -> None:
    geo = kv_model.geometry(blocks_per_chunk=4)
    layout = ChunkLayout(geo)
    for group in range(len(geo.groups)):
        runs = layout.row_runs(group, layout.rank_share(group, 1, 0))
        assert len(runs) == 1 and runs[0].length == layout.group_bytes(group)


def test_pages_are_layer_major_then_block() -> None:
    layout = ChunkLayout(kv_model.geometry(blocks_per_chunk=4))
    page = layout.group(0).page_bytes
    assert layout.page_offset(0, "attn.1", 2) == (1 * 4 + 2) * page == layout.page_offset(0, 1, 2)
    with pytest.raises(GeometryError):
        layout.page_offset(0, 0, 4)


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
