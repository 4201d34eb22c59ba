"""Lookups of a scheduler step, side by side: vLLM's fs tier on a kvfs mount, kvfs's tier
(KvfsTier: one batched request per step) on the same mount, and vLLM's fs tier on the plain
backing directory.

    python -m tools.bench_lookup [--json] [--keys 1000,10000,50000] [--repeats 3]
                                 [--sessions pyfuse3] [--base DIR]

Each step asks N first-time keys (half of them stored) of one request, through vLLM 0.33.0's
own tier classes and lookup manager: the time runs from the first lookup() to the step whose
lookups all answer (RETRY until then), the on_schedule_end() flush included. Every repeat uses
keys no tier asked before (no cached verdict or kernel entry; each session its own), each key
set asked by the three tiers in turn, so each row's three figures come from the same minutes.
The chunks are made in the backing directory before the mount (empty files at vLLM's paths: a
lookup reads none). It prints the median seconds per step and keys per second, and the ratios
kvfs-tier/fs-on-mount and kvfs-tier/fs-on-plain-dir; ``--json`` prints one object. Under 2
minutes at the defaults on a quiet machine, most of it vLLM's fs tier on the mount (~4k
keys/s): ``--keys 1000,10000,100000`` takes ~2.5 minutes, ``--sessions pyfuse3,kernel`` adds
the kernel session (~4 minutes for both with 100k).
vLLM's fs tier uses its C batch_lookup when vllm.fs_io_C imports, else os.path.exists
per key: the output says which ran. Run as root (it mounts).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

from tests.vllm_tier import HostRegion, minimal_spec, new_keys

KVFS = [sys.executable, "-m", "kvfs.cli"]
TIERS = ("fs_mount", "kvfs_mount", "fs_plain")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_tier(kind: str, root: Path, region: HostRegion) -> Any:
    from kvfs.connector.vllm_tier import KvfsTier

    cls = KvfsTier if kind == "kvfs_mount" else fs_manager.FileSystemTierManager
    return cls(minimal_spec(), region.view, kind, root_dir=str(root))


def one_step(tier: Any, keys: list[Any], expected: list[LookupResult]) -> float:
    """Seconds from the first lookup of ``keys`` to the step that answers them all."""
    ctx = ReqContext(req_id="bench")
    manager = tier._lookup_manager
    start = time.perf_counter()
    while True:
        results = [tier.lookup(key, ctx) for key in keys]
        if LookupResult.RETRY not in results:
            break
        tier.on_schedule_end(END)
        while manager._pending_results.empty():  # the answers' arrival, not a re-ask per poll
            time.sleep(0.0001)
    elapsed = time.perf_counter() - start
    assert results == expected, "a tier answered wrongly"
    tier.on_request_finished(ctx)
    return elapsed


def chunk_paths(root: Path, keys: list[Any]) -> list[Path]:
    """Where vLLM's fs tier keeps ``keys`` under ``root``."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(str(root), minimal_spec(), 1, parallel_agnostic=True)
    return [Path(mapper.get_file_name(key)) for key in keys]


def prepare(backing: Path, sizes: list[int], repeats: int) -> dict[tuple[int, int], Any]:
    """Key sets per (N, repeat), half of each stored as empty files at vLLM's paths."""
    sets: dict[tuple[int, int], Any] = {}
    for n in sizes:
        for r in range(repeats):
            keys = new_keys(n)
            for path in chunk_paths(backing, keys[::2]):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            expected = [LookupResult.MISS if i % 2 else LookupResult.HIT for i in range(n)]
            sets[(n, r)] = (keys, expected)
    return sets


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(n) for n in args.keys.split(",")]
    sessions = args.sessions.split(",")
    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-lookup-", dir=args.base))
    backing, mnt = base / "backing", base / "mnt"
    backing.mkdir()
    mnt.mkdir()
    region = HostRegion(rows=1, row_bytes=4096)
    times: dict[str, dict[str, dict[int, list[float]]]] = {}
    try:
        begun = time.perf_counter()
        # Keys of their own per session: first-time for all three tiers in each (the plain
        # directory's dentries would be warm for keys an earlier session asked).
        sets = {session: prepare(backing, sizes, args.repeats) for session in sessions}
        print(f"prepared {sum(sizes) * args.repeats * len(sessions)} keys", file=sys.stderr)
        # The key sets (millions of objects) are the benchmark's, not the scheduler's: out of
        # the collector's way, as vLLM's engine freezes its start-up heap (freeze_gc_heap), so
        # a full collection over them does not land in whichever step happens to allocate.
        gc.collect()
        gc.freeze()
        for session in sessions:
            mount = [*KVFS, "mount", str(mnt), "--backing", str(backing), "--session", session]
            subprocess.run(mount, check=True, stdout=sys.stderr)
            try:
                # The plain directory is measured in each session, interleaved with the
                # mount, so that each row's ratios come from the same minutes.
                tiers = {
                    kind: make_tier(kind, backing if kind == "fs_plain" else mnt, region)
                    for kind in TIERS
                }
                per = times.setdefault(session, {kind: {n: [] for n in sizes} for kind in TIERS})
                try:
                    for (n, _), (keys, expected) in sets[session].items():
                        for kind, tier in tiers.items():
                            per[kind][n].append(one_step(tier, keys, expected))
                finally:
                    for tier in tiers.values():
                        tier.shutdown()
            finally:
                subprocess.run([*KVFS, "umount", str(mnt)], check=True, stdout=sys.stderr)
        wall = time.perf_counter() - begun
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return summarize(times, sizes, args.repeats, wall)


def summarize(
    times: dict[str, dict[str, dict[int, list[float]]]], sizes: list[int], repeats: int, wall: float
) -> dict[str, Any]:
    rows = []
    for session, per in times.items():
        for n in sizes:
            median = {kind: statistics.median(per[kind][n]) for kind in per}
            rows.append(
                {
                    "session": session,
                    "keys": n,
                    "seconds": median,
                    "keys_per_s": {kind: n / s for kind, s in median.items()},
                    "speedup_vs_fs_mount": median["fs_mount"] / median["kvfs_mount"],
                    "speedup_vs_fs_plain": median["fs_plain"] / median["kvfs_mount"],
                }
            )
    return {
        "repeats": repeats,
        "fs_tier_lookup": "vllm.fs_io_C" if fs_manager._HAS_BATCH_LOOKUP_C else "os.path.exists",
        "wall_seconds": wall,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"vLLM fs tier lookups: {result['fs_tier_lookup']}; medians of {result['repeats']}; "
        "keys per second (a step's lookups, first lookup to all answered)"
    )
    print(
        f"{'session':8} {'keys':>7} {'fs/mount':>10} {'kvfs/mount':>11} {'fs/plain':>10} "
        f"{'kvfs÷fs-mount':>14} {'kvfs÷fs-plain':>14}"
    )
    for row in result["rows"]:
        rate = row["keys_per_s"]
        print(
            f"{row['session']:8} {row['keys']:>7} {rate['fs_mount']:>10.0f} "
            f"{rate['kvfs_mount']:>11.0f} {rate['fs_plain']:>10.0f} "
            f"{row['speedup_vs_fs_mount']:>13.1f}x {row['speedup_vs_fs_plain']:>13.2f}x"
        )
    print(f"run: {result['wall_seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="1000,10000,50000", help="N per step, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", default="pyfuse3", help="pyfuse3, kernel or both")
    parser.add_argument("--base", default=None, help="where the temporary mount goes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_lookup mounts: run it as root")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
