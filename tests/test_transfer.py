"""The transfer engine: device KV blocks <-> canonical chunks in a shared host region."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from kvfs.connector.transfer import TransferEngine
from kvfs.geometry import ChunkLayout, GeometryError, GroupGeometry, LayerKind, ModelGeometry
from kvfs.host_region import HostRegion
from tests import kv_model, tp_worker


def make_engine(
    geo: ModelGeometry,
    kv: dict[str, torch.Tensor],
    slots: int,
    kv_layout: str = "NHD",
    **options: object,
) -> tuple[TransferEngine, torch.Tensor]:
    layout = ChunkLayout(geo, kv_layout=kv_layout)
    # stale bytes everywhere: a store must leave none in the chunks it writes
    host = torch.full((slots, layout.chunk_bytes), 0xA5, dtype=torch.uint8)
    return TransferEngine(layout, kv, host, **options), host  # type: ignore[arg-type]


def run(engine: TransferEngine, job: int, load: bool, group: int, slots, blocks) -> None:
    (engine.submit_load if load else engine.submit_store)(job, group, slots, blocks)
    engine.wait([job])
    [result] = engine.get_finished()
    assert result.job_id == job and result.success, result


# Staged is the path CUDA takes (gather into scratch, then a few big copies); a scratch of
# one byte makes every chunk a piece of its own.
PATHS = {
    "direct": {"staged": False},
    "staged": {"staged": True},
    "pieces": {"staged": True, "scratch_bytes": 1},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_round_trip_every_layer_type(blocks_per_chunk: int, kv_layout: str, path: str) -> None:
    geo = kv_model.geometry(blocks_per_chunk)
    layout = ChunkLayout(geo, kv_layout=kv_layout)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, kv_layout)
    engine, host = make_engine(geo, kv, slots=6, kv_layout=kv_layout, **PATHS[path])
    back = {name: torch.zeros_like(t) for name, t in kv.items()}
    restorer = TransferEngine(layout, back, host, **PATHS[path])  # type: ignore[arg-type]
    chunks = 3
    for group, spec in enumerate(geo.groups):
        blocks = torch.randperm(kv_model.NUM_BLOCKS)[: chunks * blocks_per_chunk].tolist()
        slots = [5, 0, 3]
        run(engine, group * 2, False, group, slots, blocks)
        # the chunk is the canonical page layout: check every (layer, block) page, and that
        # what the group does not use is zero
        for c, slot in enumerate(slots):
            unused = torch.ones(layout.chunk_bytes, dtype=torch.bool)
            for start, end in layout.used_ranges(group):
                unused[start:end] = False
            assert not host[slot][unused].any(), "stale bytes left in a stored chunk"
            for i, name in enumerate(spec.layer_names):
                for b in range(blocks_per_chunk):
                    at = layout.page_offset(group, i, b)
                    page = host[slot, at : at + spec.page_bytes]
                    assert torch.equal(
                        page,
                        canonical_page(spec, kv[name], blocks[c * blocks_per_chunk + b], kv_layout),
                    )
        run(restorer, group * 2 + 1, True, group, slots, blocks)
        for name in spec.layer_names:
            assert kv_model.same_bytes(back[name][blocks], kv[name][blocks])
            others = [b for b in range(kv_model.NUM_BLOCKS) if b not in blocks]
            assert not back[name][others].any(), "a load wrote blocks it was not given"
    engine.shutdown()
    restorer.shutdown()


def canonical_page(
    spec: GroupGeometry, tensor: torch.Tensor, block: int, kv_layout: str
) -> torch.Tensor:
    """vLLM's canonical page, built independently: attention [token][head][K|V] (v1-nhd) or
    [head][token][K|V] (v1-hnd), from the packed (heads, tokens, K|V) view of the block."""
    data = tensor[block]
    if spec.kind.is_attention and kv_layout == "NHD":
        data = data.transpose(0, 1)  # (H, T, 2d) -> (T, H, 2d)
    return data.contiguous().view(torch.uint8).reshape(-1)


def test_chunk_sizes_are_4k_aligned_and_fixed() -> None:
    geo = kv_model.geometry(blocks_per_chunk=4)
    layout = ChunkLayout(geo)
    assert layout.chunk_bytes % 4096 == 0
    assert layout.chunk_bytes >= max(layout.group_bytes(g) for g in range(len(geo.groups)))
    # a Llama-3-8B-like group: 32 layers x K,V x 8 heads x 16 tokens x 128 dims x bf16 = 2 MiB
    llama = ModelGeometry(
        (
            GroupGeometry(
                LayerKind.FULL_ATTENTION, tuple(f"l{i}" for i in range(32)), 16, "bfloat16", 8, 128
            ),
        )
    )
    assert ChunkLayout(llama).chunk_bytes == 2 << 20


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_tp_1_2_4_write_identical_chunks_and_reload_every_shard(kv_layout: str) -> None:
    """Ranks in processes of their own. The rows' sizes follow vLLM's (replicated heads and
    MLA take a copy per rank), so a reload gets another TP's used bytes, as a file would
    bring them, in a region of its own row size."""
    geo = kv_model.geometry(blocks_per_chunk=2)
    layouts = {tp: ChunkLayout(geo, tp, kv_layout) for tp in (1, 2, 4)}
    tag = uuid.uuid4().hex[:8]
    names = {tp: f"tp{tp}-{tag}" for tp in (1, 2, 4)}
    reload_names = {tp: f"re{tp}-{tag}" for tp in (1, 2, 4)}
    regions = {
        tp: HostRegion.create(name, 8, layouts[tp].chunk_bytes, geo.fingerprint())
        for tp, name in names.items()
    }
    reloads = {
        tp: HostRegion.create(name, 8, layouts[tp].chunk_bytes, geo.fingerprint())
        for tp, name in reload_names.items()
    }
    gen = torch.Generator().manual_seed(3)
    plan: tp_worker.Plan = []
    for group in range(len(geo.groups)):
        blocks = torch.randperm(kv_model.NUM_BLOCKS, generator=gen)[:4].tolist()
        plan.append((group, [group * 2, group * 2 + 1], blocks))

    def used(tp: int) -> list[bytes]:
        """Per chunk of the plan: the bytes its group uses."""
        rows = np.asarray(regions[tp].view)
        return [
            b"".join(rows[slot, a:b].tobytes() for a, b in layouts[tp].used_ranges(group))
            for group, slots, _ in plan
            for slot in slots
        ]

    ctx = multiprocessing.get_context("spawn")
    ranks = [(tp, r) for tp in (1, 2, 4) for r in range(tp)]
    barrier, results = ctx.Barrier(len(ranks) + 1), ctx.Queue()
    staged = {1: False, 2: True, 4: False}  # nor does the copy path change a chunk
    load_from = {1: 4, 2: 1, 4: 2}  # each reloads what another TP wrote
    procs = [
        ctx.Process(
            target=tp_worker.run_rank,
            args=(
                tp,
                r,
                kv_layout,
                staged[tp],
                names[tp],
                reload_names[tp],
                plan,
                barrier,
                results,
            ),
        )
        for tp, r in ranks
    ]
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(timeout=120)
            written = {tp: used(tp) for tp in regions}
            assert any(any(chunk) for chunk in written[1]), "nothing was stored"
            assert written[1] == written[2] == written[4]
            for tp, source in load_from.items():
                for group, slots, _ in plan:
                    for slot in slots:
                        for a, b in layouts[tp].used_ranges(group):
                            target = np.asarray(reloads[tp].view)
                            target[slot, a:b] = np.asarray(regions[source].view)[slot, a:b]
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass  # a rank failed: its report says why
        outcome = [results.get(timeout=120) for _ in ranks]
        failures = [f"TP={tp} rank {r}:\n{err}" for tp, r, err in outcome if err]
        assert not failures, "\n".join(failures)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for region in [*regions.values(), *reloads.values()]:
            region.close()
    assert all(proc.exitcode == 0 for proc in procs)
    assert not any(r.path.exists() for r in [*regions.values(), *reloads.values()]), "left behind"


def test_geometry_that_does_not_match_the_tensors_is_refused() -> None:
    geo = kv_model.geometry()
    layout = ChunkLayout(geo)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
    host = torch.zeros((2, layout.chunk_bytes), dtype=torch.uint8)
    wrong_heads = dict(
        kv, **{"attn.0": torch.zeros(kv_model.NUM_BLOCKS, 3, 4, 16, dtype=torch.bfloat16)}
    )
    with pytest.raises(GeometryError, match=r"attn\.0: shape"):
        TransferEngine(layout, wrong_heads, host)
    wrong_dtype = dict(kv, **{"mla.0": kv["mla.0"].float()})
    with pytest.raises(GeometryError, match=r"mla\.0: dtype"):
        TransferEngine(layout, wrong_dtype, host)
    with pytest.raises(GeometryError, match="no tensor for layers"):
        TransferEngine(layout, {k: v for k, v in kv.items() if k != "swa.0"}, host)
    with pytest.raises(GeometryError, match="does not describe"):
        TransferEngine(layout, dict(kv, stray=kv["mla.0"]), host)
    with pytest.raises(GeometryError, match="state bytes"):
        TransferEngine(layout, dict(kv, **{"mamba.0": torch.zeros(kv_model.NUM_BLOCKS, 100)}), host)
    with pytest.raises(GeometryError, match="kv_layout"):
        ChunkLayout(geo, kv_layout="NCHW")
    with pytest.raises(GeometryError, match="chunk is"):
        TransferEngine(layout, kv, torch.zeros((2, layout.chunk_bytes + 4096), dtype=torch.uint8))
    with pytest.raises(GeometryError, match="layer type 'linear'"):
        GroupGeometry("linear", ("x",), 16)  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="do not split"):
        layout.rank_share(1, 3, 0)  # 4 heads over 3 ranks


def test_bad_jobs_are_refused_and_write_nothing() -> None:
    geo = kv_model.geometry(blocks_per_chunk=2)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
    engine, host = make_engine(geo, kv, slots=4)
    bad = [
        (0, [0], [1]),  # one block for a two-block chunk
        (0, [4], [0, 1]),  # no slot 4
        (0, [0, 0], [0, 1, 2, 3]),  # one slot twice
        (0, [0], [0, kv_model.NUM_BLOCKS]),  # no such block
        (0, [0], [-1, 2]),
        (7, [0], [0, 1]),  # no group 7
    ]
    for group, slots, blocks in bad:
        with pytest.raises(ValueError):
            engine.submit_store(1, group, slots, blocks)
        with pytest.raises(ValueError):
            engine.submit_load(2, group, slots, blocks)
    assert bool((host == 0xA5).all()) and engine.get_finished() == []
    before = {k: v.clone() for k, v in kv.items()}
    engine.shutdown()
    assert all(kv_model.same_bytes(before[k], kv[k]) for k in kv)


def test_gpu_check_runs_on_the_cpu() -> None:
    """tools/gpu_check.py is run by hand on a GPU; here it runs its CPU smoke test."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check",
            "--device",
            "cpu",
            "--sizes",
            "0.5",
            "--batch-mib",
            "4",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert row["bytes_identical"] and row["d2h_gbps"] > 0 and row["chunks"] == 8
