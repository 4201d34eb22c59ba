"""The transfer engine's device->host and host->device throughput against a plain pinned copy.

For chunk sizes from 0.5 to 16 MiB (a 32-layer bf16 model, 16-token blocks, more KV heads for
bigger chunks) it stores a batch of chunks from paged KV tensors into a pinned shared host
region and loads them back into other blocks, and times the same bytes moved by one plain
``copy_`` between a device tensor and a pinned host tensor (the DMA ceiling). It checks that
every reloaded block equals the stored one and that a chunk's pages are the canonical layout.

    python -m tools.gpu_check [--device cuda|cpu] [--tp N] [--repeats 5] [--json]

On a machine without CUDA, ``--device cpu`` runs the same code on CPU tensors (a smoke test;
its figures are memcpy speeds, not DMA).

    python -m tools.gpu_check --vllm-spec MOUNTPOINT [--tp N]

instead runs vLLM 0.33.0's scheduler and OffloadingConnector with kvfs's
``KvfsOffloadingSpec`` as the README configures it (root_dir on the kvfs mount at MOUNTPOINT),
its worker vLLM's own CUDA one (the CPU tests replace it with memmoves): a request's KV goes
GPU -> host -> mount -> host -> GPU and must come back identical, and the chunk files must
equal, byte for byte in their KV areas, those the CPU harness (tests/vllm_cpu_spec.py) writes
for the same KV. Needs the test requirements (tests/vllm_engine.py) and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable

import torch

from kvfs.connector.host_memory import host_tensor, pin, unpin
from kvfs.connector.transfer import TransferEngine
from kvfs.geometry import ChunkLayout, GroupGeometry, LayerKind, ModelGeometry
from kvfs.host_region import HostRegion

LAYERS, TOKENS, HEAD = 32, 16, 128
MIB = 1 << 20


def geometry(chunk_mib: float) -> ModelGeometry:
    heads = int(chunk_mib * MIB) // (LAYERS * 2 * TOKENS * HEAD * 2)
    names = tuple(f"model.layers.{i}" for i in range(LAYERS))
    group = GroupGeometry(LayerKind.FULL_ATTENTION, names, TOKENS, "bfloat16", heads, HEAD)
    return ModelGeometry((group,), blocks_per_chunk=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, action: Callable[[], None]) -> float:
    synchronize(device)
    start = time.perf_counter()
    action()
    synchronize(device)
    return time.perf_counter() - start


def measure(chunk_mib: float, device: torch.device, tp: int, repeats: int, batch_mib: int) -> dict:
    geo = geometry(chunk_mib)
    layout = ChunkLayout(geo, tp)
    spec = geo.groups[0]
    share = layout.rank_share(0, tp, 0)
    chunks = max(1, batch_mib * MIB // layout.chunk_bytes)
    blocks = 2 * chunks  # stored from the first half, loaded into the second
    gen = torch.Generator(device=device).manual_seed(0)
    # vLLM 0.33's packed view (blocks, heads, tokens, K|V), token-major in memory (NHD)
    kv = {
        name: torch.randn(
            (blocks, TOKENS, share.local_heads, 2 * HEAD), generator=gen, device=device
        )
        .to(torch.bfloat16)
        .permute(0, 2, 1, 3)
        for name in spec.layer_names
    }
    region = HostRegion.create(
        f"gpu-check-{uuid.uuid4().hex[:8]}", chunks, layout.chunk_bytes, geo.fingerprint()
    )
    host = host_tensor(region)
    pinned = pin(host)
    engine = TransferEngine(layout, kv, host, 0)
    moved = chunks * share.local_page_bytes * LAYERS
    slots = list(range(chunks))
    job = iter(range(1 << 30))

    def transfer(load: bool) -> None:
        submit = engine.submit_load if load else engine.submit_store
        ids = list(range(chunks, blocks)) if load else list(range(chunks))
        job_id = next(job)
        submit(job_id, 0, slots, ids)
        engine.wait([job_id])
        assert all(r.success for r in engine.get_finished())

    baseline_dev = torch.empty(moved, dtype=torch.uint8, device=device)
    baseline_host = torch.empty(moved, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rows = {
        "d2h": [timed(device, lambda: transfer(False)) for _ in range(repeats)],
        "h2d": [timed(device, lambda: transfer(True)) for _ in range(repeats)],
        "d2h_plain": [
            timed(device, lambda: baseline_host.copy_(baseline_dev, non_blocking=True))
            for _ in range(repeats)
        ],
        "h2d_plain": [
            timed(device, lambda: baseline_dev.copy_(baseline_host, non_blocking=True))
            for _ in range(repeats)
        ],
    }
    identical = all(
        torch.equal(t[chunks:].view(torch.uint8), t[:chunks].view(torch.uint8)) for t in kv.values()
    )
    first = kv[spec.layer_names[0]][0].transpose(0, 1).contiguous().view(torch.uint8)
    page = host[0, : spec.page_bytes] if tp == 1 else None
    canonical = page is None or torch.equal(page, first.reshape(-1).cpu())
    engine.shutdown()
    if pinned:
        unpin(host)
    del host
    region.close()
    gbps = {k: moved / statistics.median(v) / 1e9 for k, v in rows.items()}
    return {
        "chunk_mib": chunk_mib,
        "chunks": chunks,
        "tp": tp,
        "pinned": pinned,
        "d2h_gbps": round(gbps["d2h"], 2),
        "d2h_plain_gbps": round(gbps["d2h_plain"], 2),
        "d2h_ratio": round(gbps["d2h"] / gbps["d2h_plain"], 3),
        "h2d_gbps": round(gbps["h2d"], 2),
        "h2d_plain_gbps": round(gbps["h2d_plain"], 2),
        "h2d_ratio": round(gbps["h2d"] / gbps["h2d_plain"], 3),
        "bytes_identical": identical and canonical,
    }


def vllm_spec_check(mount: str, tp: int, devices: tuple[str, ...] = ("cuda", "cpu")) -> dict:
    """See the module's doc (``--vllm-spec``). Raises AssertionError on any difference.
    ``devices=("cpu",)``: only the CPU harness's half (what the test suite runs of this)."""
    import tempfile
    from pathlib import Path

    from tests import vllm_engine
    from tests.test_vllm_engine import check_files_hold_canonical_pages, check_loaded, used_tree
    from tests.test_vllm_spec import PROMPT, spec_config

    why = vllm_engine.unavailable()
    assert why is None, why
    assert "cuda" not in devices or torch.cuda.is_available(), "--vllm-spec needs a CUDA GPU"
    real = {"spec_name": "KvfsOffloadingSpec", "spec_module_path": "kvfs.connector.vllm_spec"}
    trees, seconds = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = vllm_engine.write_tiny_model(Path(scratch) / "model")
        for device in devices:
            root = Path(mount) / f"gpu-check-{device}-{uuid.uuid4().hex[:8]}"
            config = spec_config(root, **(real if device == "cuda" else {}))
            start = time.perf_counter()
            with vllm_engine.Engine(
                root, model_dir, tp=tp, extra_config=config, device=device
            ) as engine:
                worker = engine.workers[0].connector_worker.worker
                kv = engine.snapshot()
                stored = engine.store(PROMPT)
                check_files_hold_canonical_pages(engine, stored, kv)
                check_loaded(engine, engine.load(PROMPT), stored, kv)
                trees[device] = used_tree(engine)
            seconds[device] = time.perf_counter() - start
            if device == "cuda":
                assert type(worker).__name__ == "CPUOffloadingWorker", type(worker)
    first = trees[devices[0]]
    assert all(tree == first for tree in trees.values()), "the CUDA worker's files differ"
    return {"tp": tp, "chunk_files": len(first), "identical": True, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", type=int, default=1, help="measure rank 0 of this TP size")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16])
    parser.add_argument("--batch-mib", type=int, default=256, help="bytes per transfer job")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vllm-spec", metavar="MOUNTPOINT", help="check KvfsOffloadingSpec")
    args = parser.parse_args()
    if args.vllm_spec:
        print(json.dumps(vllm_spec_check(args.vllm_spec, args.tp), indent=2))
        return
    device = torch.device(args.device)
    rows = [measure(size, device, args.tp, args.repeats, args.batch_mib) for size in args.sizes]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"device {name}, TP={args.tp} rank 0, medians of {args.repeats}, GB/s")
        print(
            f"{'chunk MiB':>9} {'chunks':>6} {'d2h':>7} {'plain':>7} {'ratio':>6} "
            f"{'h2d':>7} {'plain':>7} {'ratio':>6}  identical"
        )
        for r in rows:
            print(
                f"{r['chunk_mib']:>9} {r['chunks']:>6} {r['d2h_gbps']:>7} {r['d2h_plain_gbps']:>7} "
                f"{r['d2h_ratio']:>6} {r['h2d_gbps']:>7} {r['h2d_plain_gbps']:>7} "
                f"{r['h2d_ratio']:>6}  {r['bytes_identical']}"
            )
    if not all(r["bytes_identical"] for r in rows):
        raise SystemExit("bytes differ after a round trip")


if __name__ == "__main__":
    main()
