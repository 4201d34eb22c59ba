"""How fast the inspection commands answer on a big tier, against `du -sb`.

    python -m tools.bench_cli [--chunks 100000] [--repeats 3] [--json]

Lays out CHUNKS 4 KiB chunks in two vLLM namespaces (each with its config.json) directly in a
backing directory, mounts it (the index scan is timed too: that is a restart), and times, as
medians of REPEATS: `kvfs du` and `kvfs ls` on the mount, and `du -sb` on the mount and on the
plain backing directory. Targets: `kvfs du` under one second, `kvfs ls` under three.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import vllm_io

KVFS = [sys.executable, "-m", "kvfs.cli"]
NAMESPACES = {"bench-llama_aaaaaaaaaaaa": "bench/llama", "bench-qwen_bbbbbbbbbbbb": "bench/qwen"}


def lay_out(backing: Path, chunks: int) -> None:
    page = os.urandom(4096)
    for index, (namespace, model) in enumerate(NAMESPACES.items()):
        (backing / namespace).mkdir(parents=True)
        config = {
            "model_name": model,
            "dtype": "bfloat16",
            "blocks_per_file": 1,
            "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
        }
        (backing / namespace / "config.json").write_text(json.dumps(config))
        for key in range(index, chunks, len(NAMESPACES)):
            path = Path(vllm_io.chunk_path(str(backing), key * 7919, namespace=namespace))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(page)


def timed(command: list[str], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-cli-"))
    mnt, backing = base / "mnt", base / "backing"
    mnt.mkdir()
    try:
        start = time.perf_counter()
        lay_out(backing, args.chunks)
        layout_s = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(
            [*KVFS, "mount", str(mnt), "--backing", str(backing)], check=True, capture_output=True
        )
        mount_s = time.perf_counter() - start
        try:
            results = {
                "kvfs_du": timed([*KVFS, "du", str(mnt)], args.repeats),
                "kvfs_ls": timed([*KVFS, "ls", str(mnt)], args.repeats),
                "du_sb_mount": timed(["du", "-sb", str(mnt)], args.repeats),
                "du_sb_backing": timed(
                    ["du", "-sb", "--exclude=.kvfs", str(backing)], args.repeats
                ),
            }
            listing = subprocess.run([*KVFS, "ls", str(mnt)], capture_output=True, text=True)
        finally:
            subprocess.run([*KVFS, "umount", str(mnt)], check=False, capture_output=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = {
        "chunks": args.chunks,
        "layout_s": layout_s,
        "mount_with_index_scan_s": mount_s,
        "seconds": results,
        "targets_met": results["kvfs_du"] < 1 and results["kvfs_ls"] < 3,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.chunks} chunks; mount (index scan) {mount_s:.2f}s")
    for name, seconds in results.items():
        print(f"{name:>14}: {seconds:.3f}s (median of {args.repeats})")
    print(listing.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
