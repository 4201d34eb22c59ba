"""One TP rank in its own process: stores its shard into a shared host region, then reloads
chunks that other TP sizes stored and checks it gets its shard back exactly."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from kvfs.geometry import ChunkLayout
from kvfs.host_region import HostRegion
from tests import kv_model

# (group, slots, block ids): the same chunks for every TP size
Plan = list[tuple[int, list[int], list[int]]]


def transfer_all(engine: Any, plan: Plan, load: bool) -> None:
    submit = engine.submit_load if load else engine.submit_store
    for job, (group, slots, blocks) in enumerate(plan):
        submit(job, group, slots, blocks)
    engine.wait(range(len(plan)))
    results = engine.get_finished()
    assert len(results) == len(plan) and all(r.success for r in results), results


def run_rank(
    tp: int,
    rank: int,
    kv_layout: str,
    staged: bool,
    store_into: str,
    load_from: str,
    plan: Plan,
    barrier: Any,
    results: Any,
) -> None:
    from kvfs.connector.host_memory import host_tensor
    from kvfs.connector.transfer import TransferEngine

    torch.set_num_threads(1)
    try:
        geo = kv_model.geometry()
        layout = ChunkLayout(geo, tp, kv_layout)
        mine = kv_model.shard(geo, kv_model.full_tensors(geo), tp, rank, kv_layout)
        with HostRegion.attach(store_into, geo.fingerprint()) as region:
            engine = TransferEngine(layout, mine, host_tensor(region), rank, staged=staged)
            transfer_all(engine, plan, load=False)
            engine.shutdown()
            barrier.wait()  # every rank of every TP size has stored: the parent compares
            barrier.wait()
        with HostRegion.attach(load_from, geo.fingerprint()) as region:
            loaded = {name: torch.zeros_like(t) for name, t in mine.items()}
            engine = TransferEngine(layout, loaded, host_tensor(region), rank, staged=staged)
            transfer_all(engine, plan, load=True)
            engine.shutdown()
        for group, _, blocks in plan:
            for name in geo.groups[group].layer_names:
                check_layer(loaded[name], mine[name], set(blocks), name)
        results.put((tp, rank, None))
    except BaseException:
        results.put((tp, rank, traceback.format_exc()))
        barrier.abort()


def check_layer(loaded: torch.Tensor, mine: torch.Tensor, used: set[int], name: str) -> None:
    """The loaded blocks hold this rank's shard exactly; the others were not touched."""
    for block in range(kv_model.NUM_BLOCKS):
        want = mine[block] if block in used else torch.zeros_like(mine[block])
        assert kv_model.same_bytes(loaded[block], want), f"{name} block {block}"
