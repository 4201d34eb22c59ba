"""Sustained store and load jobs through vLLM 0.33.0's own tier classes, side by side: vLLM's fs
tier on the plain backing directory (``fs_plain``), vLLM's fs tier on a kvfs mount
(``fs_mount``) and KvfsTier on a kvfs mount (``kvfs_mount``: the same jobs, each chunk's
checksum declared as it is written).

    python -m tools.bench_vllm_tier [--json] [--total-gib 2] [--block-mib 2]
                                    [--blocks-per-job 16] [--repeats 3] [--base DIR]

Each target stores ``--total-gib`` of new chunks, a job of ``--blocks-per-job`` blocks at a
time, every job submitted at once to the tier's 16 write threads (an engine's burst of
evictions), then, the page cache dropped, loads them back the same way and checks a sample of
them byte for byte. The default 2 GiB is past the GiB of O_DIRECT chunks a mount lets wait for
their checksums (``--checksum-backlog``): from there on a chunk the mount cannot checksum from
a declaration is read back from the disk at its publish, as in a sustained store load. Each
mount tier has a mount of its own (``kvfs mount`` as it comes: kvfs's own session with
passthrough) over a backing directory beside the plain one; the targets take turns, in the
opposite order each repeat. It prints GB/s per target (medians over the repeats) and the
ratios to the plain directory; ``--json`` prints one object. About two minutes at the
defaults. Run as root (it mounts and drops the page cache).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from tests.vllm_tier import HostRegion, minimal_spec, new_keys
from tools.bench_mount import Target, drop_caches

TARGETS = ("fs_plain", "fs_mount", "kvfs_mount")
MEASURES = ("store", "load")
SAMPLE = 8  # blocks of each load checked byte for byte
# The mount's defaults: kvfs's own session with passthrough (what `--session auto` picks for this
# on a local disk): the kernel reads and writes the chunks' backing files itself, the daemon
# checksums what it cannot see from a declaration or by reading it back.
MOUNT_OPTIONS: tuple[str, ...] = ()


def make_tier(kind: str, root: Path, region: HostRegion) -> Any:
    from kvfs.connector.vllm_tier import KvfsTier

    cls = KvfsTier if kind == "kvfs_mount" else FileSystemTierManager
    return cls(minimal_spec(), region.view, kind, root_dir=str(root))


def run_jobs(tier: Any, jobs: list[list[Any]], slots: list[int], promotion: bool) -> float:
    """Seconds to run every job (its keys to or from ``slots``), all submitted at once."""
    ctx = ReqContext(req_id="bench")
    submit = tier.submit_load if promotion else tier.submit_store
    start = time.perf_counter()
    for job_id, keys in enumerate(jobs):
        submit(TransferJob(job_id, keys, np.array(slots[: len(keys)]), promotion, ctx))
    pending = set(range(len(jobs)))
    while pending:
        for result in tier.get_finished_jobs():
            assert result.success, f"job {result.job_id} failed"
            pending.discard(result.job_id)
        time.sleep(0.001)
    return time.perf_counter() - start


def measure(target: Target, region: HostRegion, jobs: list[list[Any]]) -> dict[str, float]:
    """GB/s of the jobs' stores from the region's first rows, then of their loads (nothing
    cached) into the rows after them, a sample checked against what was stored."""
    per_job = len(jobs[0])
    stored, loaded = list(range(per_job)), list(range(per_job, 2 * per_job))
    gb = sum(map(len, jobs)) * region.array.shape[1] / 1e9
    tier = make_tier(target.name, target.root, region)
    try:
        store_s = run_jobs(tier, jobs, stored, promotion=False)
        drop_caches()
        region.array[per_job:] = 0
        load_s = run_jobs(tier, jobs, loaded, promotion=True)
    finally:
        tier.shutdown()
    sample = range(min(SAMPLE, per_job))  # the last job's blocks are in the rows now
    assert np.array_equal(region.array[per_job:][sample], region.array[sample]), "wrong bytes"
    return {"store": gb / store_s, "load": gb / load_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    block = args.block_mib << 20
    per_job = args.blocks_per_job
    count = max(1, (args.total_gib << 30) // (block * per_job))
    region = HostRegion(rows=2 * per_job, row_bytes=block)
    region.array[:per_job] = np.random.default_rng(0).integers(0, 256, (per_job, block), np.uint8)
    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-tier-", dir=args.base))
    targets = [Target("fs_plain", base / "fs_plain")] + [
        Target(name, base / name, base / f"backing-{name}", MOUNT_OPTIONS) for name in TARGETS[1:]
    ]
    rows: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for target in targets if repeat % 2 == 0 else targets[::-1]:
                jobs = [new_keys(per_job) for _ in range(count)]
                rows.append({"target": target.name, **measure(target, region, jobs)})
                target.clear()
                print(f"repeat {repeat}: {target.name} done", file=sys.stderr)
    finally:
        for target in targets:
            target.unmount()
        shutil.rmtree(base, ignore_errors=True)
    gb_per_s = {
        name: {m: statistics.median(r[m] for r in rows if r["target"] == name) for m in MEASURES}
        for name in TARGETS
    }
    plain = gb_per_s["fs_plain"]
    ratios = {name: {m: gb_per_s[name][m] / plain[m] for m in MEASURES} for name in TARGETS[1:]}
    return {
        "gib_per_target": count * per_job * block / (1 << 30),
        "block_mib": args.block_mib,
        "blocks_per_job": per_job,
        "gb_per_s": gb_per_s,
        "ratio_to_plain": ratios,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--total-gib", type=int, default=2, help="GiB each target stores")
    parser.add_argument("--block-mib", type=int, default=2, help="bytes per chunk (MiB)")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", type=Path, help="working directory (default: a temp dir)")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['gib_per_target']:.1f} GiB per target, {result['block_mib']} MiB chunks")
    print(f"{'target':<12}{'store GB/s':>12}{'load GB/s':>12}{'store/plain':>13}{'load/plain':>12}")
    for name in TARGETS:
        speed, ratio = result["gb_per_s"][name], result["ratio_to_plain"].get(name)
        cells = f"{ratio['store']:>13.3f}{ratio['load']:>12.3f}" if ratio else ""
        print(f"{name:<12}{speed['store']:>12.2f}{speed['load']:>12.2f}{cells}")


if __name__ == "__main__":
    main()
